"""A measured routing histogram: the rows each rank sent to each expert, per MoE layer (a JSON file).

The memory and time estimates of an expert-parallel plan assume **balanced routing** unless given
one (`planc explain/check --routing FILE`, `planc.compile(..., routing=load_routing(FILE))`).
`planc.analysis.routing.record_routing` writes it from a real step, with or without expert
parallelism. The format (`FORMAT`, one JSON object):

    {"planc_routing": 1,
     "batch": [2, 16],             # each rank's model input shape when it was recorded
     "expert_degree": 2,           # the expert degree it was recorded under (1: a dense run)
     "layers": [{"name": "layers.0.moe.experts",      # an experts container's path
                 "counts": [[9, 23, 17, 15],          # rank 0's rows to experts 0..3
                            [20, 12, 14, 18]]}, ...]} # rank 1's

`counts[r][e]`: the rows (token x chosen-expert pairs) recorded rank `r` routed to expert `e` in
one forward. How the estimate reads it (`Routing.received`): an expert group is `expert` consecutive
ranks (the expert axis is the innermost axis of the expert view); one recorded rank (a dense run)
stands for every rank of a group (each routes as it did). Each source rank's counts are scaled to
the rows it routes in the estimated step (`rows / recorded rows`, rounded by largest remainder, so
each rank still sends exactly its rows); the same batch is an exact copy. The estimated rank is, per
layer, the expert rank receiving the most rows (the binding rank: memory's peak and the slowest
all-to-all), or one chosen rank (`Routing.at_rank`: compared with that rank's measurement).
A file that does not match the plan (layer names, expert counts, ranks vs the expert degree) is
refused with P436 at the `parallel ... expert` statement; a file that is not this format, P437.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from planc.diagnostics import Diagnostic, Span
from planc.lower.program import DispatchExperts

FORMAT = 1
MAX_BYTES = 16 << 20  # a routing file is small: counts per layer, rank and expert


@dataclass(frozen=True)
class Layer:
    """One experts container's histogram: `counts[rank][expert]` rows."""

    name: str
    counts: tuple[tuple[int, ...], ...]

    @property
    def experts(self) -> int:
        return len(self.counts[0])


@dataclass(frozen=True)
class Routing:
    """A routing histogram (see the module docstring); hashable (the trace cache keys on it)."""

    layers: tuple[Layer, ...]
    batch: tuple[int, ...]
    expert_degree: int = 1
    file: str = "<routing>"
    rank: int | None = None  # the expert rank estimated; None: per layer the one receiving the most rows

    @property
    def ranks(self) -> int:
        return len(self.layers[0].counts)

    def layer(self, name: str) -> Layer:
        return next(x for x in self.layers if x.name == name)

    def at_rank(self, rank: int) -> "Routing":
        """The same histogram, estimating global rank `rank` (its expert group and expert rank)."""
        return dataclasses.replace(self, rank=rank)

    def to_json(self) -> str:
        """The file's text: one line per layer's rank."""
        layers = ",\n".join(f'  {{"name": {json.dumps(x.name)}, "counts": [\n' + ",\n".join(
            f"    {json.dumps(list(r))}" for r in x.counts) + "]}" for x in self.layers)
        return (f'{{"planc_routing": {FORMAT}, "batch": {json.dumps(list(self.batch))}, '
                f'"expert_degree": {self.expert_degree},\n "layers": [\n{layers}]}}')

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    # ------------------------------------------------------------ what one expert rank receives
    def groups(self, name: str, ep: int) -> list[list[tuple[int, ...]]]:
        """The recorded ranks' counts of layer `name` as expert groups of `ep` source ranks."""
        rows = self.layer(name).counts
        if len(rows) == 1:
            return [[rows[0]] * ep]
        return [list(rows[g:g + ep]) for g in range(0, len(rows), ep)]

    def received(self, name: str, ep: int, rows: int) -> list[list[int]]:
        """`[source rank][local expert]`: the rows the estimated expert rank receives in layer `name`
        when each of the `ep` ranks of its group routes `rows` rows (its counts scaled to them)."""
        local = self.layer(name).experts // ep
        best: list[list[int]] | None = None
        for g, group in enumerate(self.groups(name, ep)):
            scaled = [scale(row, rows) for row in group]
            for j in range(ep):
                got = [row[j * local:(j + 1) * local] for row in scaled]
                if self.rank is not None:
                    if (self.ranks == 1 or g == self.rank // ep) and j == self.rank % ep:
                        return got
                elif best is None or sum(map(sum, got)) > sum(map(sum, best)):
                    best = got
        if best is None:
            raise ValueError(f"rank {self.rank} is not a rank of the routing histogram {self.file}")
        return best

    def load(self, name: str, ep: int) -> float:
        """Rows the estimated expert rank receives in layer `name` over the rows each rank sends (1.0: balanced)."""
        rows = sum(self.layer(name).counts[0])
        return sum(map(sum, self.received(name, ep, rows))) / rows

    def reweighted(self, profile, names: list[str], ep: int):
        """A step profile (`planc.estimate.flops.StepProfile`) with the FLOPs of each experts container in
        `names` (and below it) times `load`: the estimated rank computes the rows it receives."""
        factor = {n: self.load(n, ep) for n in names}

        def k(path: str) -> float:
            return next((f for n, f in factor.items() if path == n or path.startswith(n + ".")), 1.0)

        def table(t: dict) -> dict:
            return {p: round(v * k(p)) for p, v in t.items()}

        return dataclasses.replace(
            profile, forward=table(profile.forward), backward=table(profile.backward),
            recomputed=table(profile.recomputed), recompute_full=table(profile.recompute_full),
            recompute_selective=table(profile.recompute_selective),
            forward_segments=[(p, round(v * k(p))) for p, v in profile.forward_segments],
            backward_segments=[(p, round(v * k(p))) for p, v in profile.backward_segments])

    def imbalance(self, ep: int) -> float:
        """The largest ratio, over layers, of the most rows an expert rank receives to the mean."""
        worst = 1.0
        for x in self.layers:
            per_rank = [sum(sum(row[j * (x.experts // ep):(j + 1) * (x.experts // ep)]) for row in group)
                        for group in self.groups(x.name, ep) for j in range(ep)]
            mean = sum(per_rank) / len(per_rank)
            worst = max(worst, max(per_rank) / mean if mean else 1.0)
        return worst

    def describe(self, ep: int) -> str:
        """The routing assumption, as the estimate's source line states it."""
        which = (f"expert rank {self.rank}" if self.rank is not None else
                 "per layer the expert rank receiving the most rows")
        return (f"routing measured in {self.file} ({self.ranks} rank{'s' * (self.ranks > 1)}, batch "
                f"{'x'.join(map(str, self.batch))}, each rank's counts scaled to its rows): {which}; the busiest "
                f"expert rank receives {self.imbalance(ep):.2f}x the mean rows")


def scale(row: tuple[int, ...], rows: int) -> list[int]:
    """`row`'s counts scaled to sum to `rows`: floors of the proportional shares, the remainder one
    each to the largest fractional parts (ties: the lower expert); `row` itself when it sums to `rows`."""
    total = sum(row)
    if total == rows:
        return list(row)
    exact = [c * rows / total for c in row]
    out = [int(x) for x in exact]
    for e in sorted(range(len(row)), key=lambda e: (out[e] - exact[e], e))[:rows - sum(out)]:
        out[e] += 1
    return out


# ------------------------------------------------------------------ reading a file (P437)
class RoutingError(Exception):
    """A routing file that cannot be read or is not the format: `diagnostic` (P437) says where."""

    def __init__(self, diagnostic: Diagnostic, text: str | None = None) -> None:
        super().__init__(diagnostic.message)
        self.diagnostic, self.text = diagnostic, text


def _refuse(path: str, text: str | None, message: str, key: str | None = None, *, label: str = "") -> RoutingError:
    """P437 at `key`'s first occurrence in `text` (else the file's start); `text` None: unreadable."""
    line, column = 1, 1
    if key is not None and text and f'"{key}"' in text:
        before = text[:text.index(f'"{key}"')]
        line, column = before.count("\n") + 1, len(before) - before.rfind("\n")
    return RoutingError(Diagnostic(
        code="P437", severity="error", message=f"routing histogram {path}: {message}",
        span=Span(path, line, column, line, column + (len(key) + 2 if key else 1)), label=label or "here",
        help=("write it with `planc.analysis.routing.record_routing(model)` around one real step "
              "(docs/language.md, \"Routing\"), or leave `--routing` out to assume balanced routing",)), text)


def load_routing(path: str | os.PathLike) -> Routing:
    """Read a routing histogram file; `RoutingError` (P437, located in the file) when it is not one."""
    path = os.fspath(path)
    try:
        if os.path.getsize(path) > MAX_BYTES:
            raise _refuse(path, None, f"larger than {MAX_BYTES >> 20} MiB")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise _refuse(path, None, f"cannot be read ({getattr(err, 'strerror', None) or err})") from None
    return parse_routing(text, path)


def parse_routing(text: str, path: str = "<routing>") -> Routing:
    """A routing histogram from its JSON text; `RoutingError` (P437) when it is not one."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise RoutingError(Diagnostic(code="P437", severity="error", message=f"routing histogram {path}: not JSON: "
                                      f"{err.msg}", span=Span.point(path, err.lineno, err.colno), label="here",
                                      help=("the file `record_routing(...).save(path)` writes is JSON",)), text) from None
    if not isinstance(data, dict) or data.get("planc_routing") != FORMAT:
        raise _refuse(path, text, f"not a planc routing histogram (format {FORMAT}: an object with "
                      f"\"planc_routing\": {FORMAT})", "planc_routing" if isinstance(data, dict) else None)
    batch, degree, layers = data.get("batch"), data.get("expert_degree", 1), data.get("layers")
    if not (isinstance(batch, list) and batch and all(_count(b) and b > 0 for b in batch)):
        raise _refuse(path, text, "\"batch\" must be the recorded input shape, a list of positive integers", "batch")
    if not (_count(degree) and degree > 0):
        raise _refuse(path, text, "\"expert_degree\" must be a positive integer", "expert_degree")
    if not (isinstance(layers, list) and layers):
        raise _refuse(path, text, "\"layers\" must be a non-empty list of {\"name\", \"counts\"}", "layers")
    out = []
    for i, x in enumerate(layers):
        name, counts = (x.get("name"), x.get("counts")) if isinstance(x, dict) else (None, None)
        where = name if isinstance(name, str) else "layers"
        if not isinstance(name, str) or not isinstance(counts, list) or not counts or \
                not all(isinstance(r, list) and r and all(_count(c) for c in r) for r in counts):
            raise _refuse(path, text, f"layer {f'`{name}`' if isinstance(name, str) else i}: needs \"name\" (a module "
                          f"path) and \"counts\" (rows per rank per expert: a list of lists of non-negative integers)",
                          where)
        if len({len(r) for r in counts}) != 1 or any(sum(r) == 0 for r in counts):
            raise _refuse(path, text, f"layer {name}: every rank needs a count for each expert and at least one row",
                          where)
        out.append(Layer(name, tuple(tuple(r) for r in counts)))
    if len({len(x.counts) for x in out}) != 1:
        raise _refuse(path, text, "every layer must list the same ranks", "layers")
    return Routing(tuple(out), tuple(batch), degree, path)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# ------------------------------------------------------------------ against a plan (P436)
def routing_problems(routing: Routing, program, ep: int) -> list[Diagnostic]:
    """P436 for each `parallel ... expert` container the histogram does not fit: a layer it lacks,
    another expert count, ranks that do not form expert groups of `ep`; and one for layers it has
    that the plan does not dispatch."""
    ops = list(program.of_type(DispatchExperts))
    names = {x.name for x in routing.layers}
    out: list[Diagnostic] = []

    found: dict[tuple, list[str]] = {}  # (statement's span, what is wrong) -> containers, one diagnostic each

    def problem(op, message: str, fix: str) -> None:
        found.setdefault((op.origin.span, message, fix), []).append(op.module)

    for op in ops:
        if op.module not in names:
            problem(op, "has no layer for", "record the histogram on the model this plan shards")
        elif routing.layer(op.module).experts != op.experts:
            problem(op, f"counts {routing.layer(op.module).experts} experts, the model has {op.experts}, in",
                    "record the histogram on the model this plan shards")
        elif routing.ranks != 1 and routing.ranks % ep:
            problem(op, f"its {routing.ranks} recorded ranks do not form expert groups of {ep} (the expert degree), for",
                    f"record it on one process (a dense run) or on a multiple of {ep} ranks")
    extra = sorted(names - {op.module for op in ops})
    if ops and extra:
        found[(ops[0].origin.span, "has layers the plan does not make expert-parallel:", "record the histogram on "
               "the model this plan shards, or mark those experts `expert`")] = extra
    for (span, message, fix), modules in found.items():
        out.append(Diagnostic(code="P436", severity="error", label="these experts", span=span, help=(fix,),
                              message=f"routing histogram {routing.file}: {message} {_some(modules)}"))
    return out


def _some(names: list[str]) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


__all__ = ["FORMAT", "Layer", "Routing", "RoutingError", "load_routing", "parse_routing", "routing_problems", "scale"]
