"""Repeated blocks in a traced step: run four of a run of identical blocks, write out the rest.

A 126-block model traced on fake tensors spends nearly all its time in 122 blocks that do
exactly what their neighbours do. Within a run of identical blocks (same class, parameter
and buffer shapes, same unit policy, checkpointing and tensor-parallel styles, each block
one unit of its own), block k+1's events are block k's with every live byte moved by the
same amount: what one block keeps from forward for backward. So the step is traced with the
run cut to its first two and last two blocks (`shorten`), and the events of the blocks left
out are written back (`restore`) as copies of the second block's, moved by that amount,
with the moments after them moved by what the copies keep.

`restore` checks the assumption on the trace itself: the second and third traced blocks
(neighbours in the short step) must differ in forward and in backward by one constant live
amount and no gradient bytes; when they do not, it returns None and the caller traces the
full step. tests/test_trace_repeat.py checks that restored traces equal full ones event for
event.

The container must be a plain `nn.ModuleList` or `nn.ModuleDict` that the model's forward
iterates; a forward that indexes it by position (`self.layers[i]` for `i in
range(config.n_layers)`) fails on the short container, and the caller traces in full.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from planc.estimate.trace import Event
from planc.lower.job import FORWARD, FULL_BACKWARD, LossParallel, Reader, ShardBatch
from planc.lower.program import (
    AttendOverContext,
    Checkpoint,
    Compile,
    DispatchExperts,
    FullyShard,
    Parallelize,
    SetPrefetch,
    UnitMethod,
)

# What makes blocks' traced events equal: their units, checkpointing, tensor, context and expert
# styles (in `_signature`); compile, prefetch lists and unit methods change no traced byte, nor
# does the sequence cut (every block sees the same shard), nor the experts' dispatch (routing is
# assumed balanced, so every block's all-to-all moves the same rows; `restore` checks it).
READER = Reader("the repeated-block trace",
                (FullyShard, Parallelize, AttendOverContext, DispatchExperts, Checkpoint, Compile, SetPrefetch, UnitMethod),
                (FORWARD, FULL_BACKWARD), (LossParallel, ShardBatch))

MIN_RUN = 5  # blocks: the two first, the two last, and at least one written out


@dataclass(frozen=True)
class Run:
    """Consecutive identical children of one container, each one unit."""

    container: str               # the ModuleList / ModuleDict path
    keys: tuple[str, ...]        # the children's names in the container, in order
    units: tuple[int, ...]       # each child's unit index in the program

    @property
    def kept(self) -> tuple[str, ...]:
        return (*self.keys[:2], *self.keys[-2:])


def _signature(compiled, path: str, unit) -> tuple | None:
    """What a block's traced events depend on (None: it may not be written out as a copy)."""
    graph, program = compiled.graph, compiled.program
    mod = graph.model.get_submodule(path)
    prefix = path + "."
    inside = lambda p: p == path or p.startswith(prefix)  # noqa: E731
    rel = lambda p: p[len(path):]  # noqa: E731
    if tuple(unit.modules) != (path,) or not all(p.startswith(prefix) for p in unit.params):
        return None
    if any(not u.is_root and u is not unit and any(inside(m) for m in u.modules) for u in program.units):
        return None  # a unit inside the block
    if any(a != c and (inside(a) or inside(c)) for a, c in graph.aliases.items()):
        return None  # tied to something else
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in mod.named_parameters())
    if tuple(sorted(rel(p) for p in unit.params)) != tuple(sorted("." + n for n, *_ in params)):
        return None
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in mod.named_buffers())
    checkpoints = tuple(sorted((rel(op.module), op.mode) for op in program.of_type(Checkpoint) if inside(op.module)))
    styles = tuple(sorted((rel(op.module), repr(op.style)) for op in program.of_type(Parallelize) if inside(op.module)))
    styles += tuple(sorted((rel(op.module), "context") for op in program.of_type(AttendOverContext) if inside(op.module)))
    styles += tuple(sorted((rel(op.module), "expert") for op in program.of_type(DispatchExperts) if inside(op.module)))
    ignored = tuple(sorted(rel(p) for p in compiled.resolution.ignored if inside(p)))
    return type(mod), params, buffers, unit.policy.precision, checkpoints, styles, ignored


def find_runs(compiled, min_run: int = MIN_RUN) -> list[Run]:
    """The runs of at least `min_run` identical single-block units (see the module docstring)."""
    graph, units = compiled.graph, READER.compiled(compiled).program.units
    unit_of = {u.modules[0]: i for i, u in enumerate(units) if not u.is_root and len(u.modules) == 1}
    runs: list[Run] = []
    for parent in dict.fromkeys(path.rpartition(".")[0] for path in unit_of if "." in path):
        box = graph.model.get_submodule(parent)
        if type(box) not in (nn.ModuleList, nn.ModuleDict):
            continue
        groups: list[list[tuple[str, int, tuple | None]]] = [[]]
        for key in box._modules:
            i = unit_of.get(f"{parent}.{key}")
            sig = _signature(compiled, f"{parent}.{key}", units[i]) if i is not None else None
            if sig is None or (groups[-1] and groups[-1][-1][2] != sig):
                groups.append([])
            if sig is not None:
                groups[-1].append((key, i, sig))
        runs += [Run(parent, tuple(k for k, _, _ in g), tuple(i for _, i, _ in g)) for g in groups if len(g) >= min_run]
    return runs


def shorten(model: nn.Module, runs: list[Run]) -> None:
    """Cut each run in `model` (a throwaway copy) to its kept blocks (the same module objects)."""
    by_container: dict[str, set[str]] = {}
    for run in runs:
        by_container.setdefault(run.container, set()).update(set(run.keys) - set(run.kept))
    for path, dropped in by_container.items():
        box = model.get_submodule(path)
        short = type(box)()
        for k, m in box._modules.items():  # the kept children keep their names: module paths do not change
            if k not in dropped:
                short.add_module(k, m)
        parent, _, name = path.rpartition(".")
        model.get_submodule(parent)._modules[name] = short


def elided_units(runs: list[Run]) -> set[int]:
    """The unit indices of the blocks `shorten` leaves out."""
    return {u for run in runs for u in run.units[2:-2]}


def _index(events: list[Event], kind: str, unit: int) -> int | None:
    return next((k for k, e in enumerate(events) if e.kind == kind and e.unit == unit), None)


def _shift(segment: list[Event], base: list[Event], names: dict, unit_map: dict) -> tuple[int, int] | None:
    """The constant (live, grads) difference of `segment` over `base`, if they are copies."""
    if len(segment) != len(base):
        return None
    diffs = set()
    for a, b in zip(segment, base):
        if a.kind != b.kind or unit_map.get(b.unit, b.unit) != a.unit or names.get(b.where, b.where) != a.where:
            return None
        if (b.params is None) != (a.params is None) or (b.params is not None and
                                                        tuple(names.get(p, p) for p in b.params) != a.params):
            return None
        diffs.add((a.live - b.live, a.grads - b.grads))
    return diffs.pop() if len(diffs) == 1 else None


def _copy(segment: list[Event], names: dict, unit_map: dict, live: int) -> list[Event]:
    out = []
    for e in segment:  # built directly: `dataclasses.replace` was most of a 126-block restore's time
        params = None if e.params is None else tuple(names.get(p, p) for p in e.params)
        out.append(Event(e.kind, unit_map.get(e.unit, e.unit), e.live + live, e.grads, names.get(e.where, e.where),
                         params))
    return out


def restore(events: list[Event], runs: list[Run], units) -> list[Event] | None:
    """The full step's events from the short step's (None: the blocks are not copies; trace in full)."""
    for run in runs:
        u = run.units
        n_out = len(u) - 4
        a, b, c = _index(events, "fwd_pre", u[1]), _index(events, "fwd_pre", u[-2]), _index(events, "fwd_pre", u[-1])
        p, q, s = _index(events, "bwd_pre", u[-2]), _index(events, "bwd_pre", u[1]), _index(events, "bwd_pre", u[0])
        if None in (a, b, c, p, q, s) or not a < b < c <= p < q < s:
            return None

        def renaming(src: int, dst: int) -> tuple[dict, dict]:
            names = {units[src].name: units[dst].name, **dict(zip(units[src].params, units[dst].params))}
            return names, {src: dst}
        fwd, bwd = events[a:b], events[q:s]
        d_fwd = _shift(events[b:c], fwd, *renaming(u[1], u[-2]))
        d_bwd = _shift(events[p:q], bwd, *renaming(u[1], u[-2]))
        if d_fwd is None or d_bwd is None or d_fwd != d_bwd or d_fwd[1] != 0:
            return None
        delta = d_fwd[0]
        extra = n_out * delta
        out = events[:b]
        for k in range(n_out):  # positions 2 .. len-3, each holding k + 1 more blocks' state than the second
            out += _copy(fwd, *renaming(u[1], u[2 + k]), live=(k + 1) * delta)
        out += [Event(e.kind, e.unit, e.live + extra, e.grads, e.where, e.params) for e in events[b:q]]
        for k in reversed(range(n_out)):
            out += _copy(bwd, *renaming(u[1], u[2 + k]), live=(k + 1) * delta)
        out += events[q:]
        events = out
    return events


# ----------------------------------------------------------------- the compute profile
def module_runs(model: nn.Module, aliases: dict, min_run: int = MIN_RUN) -> list[Run]:
    """Runs of identical children (class, parameter and buffer shapes) of the outermost
    ModuleList / ModuleDict containers, for `planc.estimate.flops.step_profile` (no units)."""
    runs: list[Run] = []
    boxes = [p for p, m in model.named_modules() if type(m) in (nn.ModuleList, nn.ModuleDict) and p]
    boxes = [p for p in boxes if not any(p.startswith(q + ".") for q in boxes)]
    tied = {n for a, c in aliases.items() if a != c for n in (a, c)}
    for parent in boxes:
        groups: list[list[tuple[str, tuple | None]]] = [[]]
        for key, mod in model.get_submodule(parent)._modules.items():
            names = [f"{parent}.{key}.{n}" for n, _ in mod.named_parameters()]
            sig = None if mod is None or tied.intersection(names) else (
                type(mod), tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in mod.named_parameters()),
                tuple((n, tuple(b.shape), b.dtype) for n, b in mod.named_buffers()))
            if sig is None or (groups[-1] and groups[-1][-1][1] != sig):
                groups.append([])
            if sig is not None:
                groups[-1].append((key, sig))
        runs += [Run(parent, tuple(k for k, _ in g), ()) for g in groups if len(g) >= min_run]
    return runs


def _renamer(src: str, dst: str):
    def rename(path: str) -> str:
        return dst + path[len(src):] if path == src or path.startswith(src + ".") else path
    return rename


def _stretch(seq: list, start_prefix: str, stop_prefix: str, key=lambda x: x) -> tuple[int, int] | None:
    """[i, j): from the first item under `start_prefix` to the first under `stop_prefix` after it."""
    under = lambda item, p: key(item) == p or key(item).startswith(p + ".")  # noqa: E731
    i = next((k for k, x in enumerate(seq) if under(x, start_prefix)), None)
    if i is None:
        return None
    j = next((k for k in range(i, len(seq)) if under(seq[k], stop_prefix)), None)
    return None if j is None else (i, j)


def restore_profile(prof, runs: list[Run]):
    """The full model's `StepProfile` from the short model's (None: the blocks are not copies)."""
    import dataclasses
    prof = dataclasses.replace(prof)
    tables = ("forward", "recomputed", "recompute_full", "recompute_selective", "backward", "inputs", "outputs",
              "attention")
    for run in runs:
        path = [f"{run.container}.{k}" for k in run.keys]
        c0, c1, c2, c3 = path[0], path[1], path[-2], path[-1]
        n_out = len(path) - 4
        to2 = _renamer(c1, c2)
        under1 = lambda p, c1=c1: p == c1 or p.startswith(c1 + ".")  # noqa: E731
        for name in tables:  # the second, third and last blocks alike (the first may differ)
            t = getattr(prof, name)
            for other in (c2, c3):
                rename = _renamer(c1, other)
                if {rename(k): v for k, v in t.items() if under1(k)} != {k: v for k, v in t.items() if k == other or
                                                                           k.startswith(other + ".")}:
                    return None
        fwd = _stretch(prof.forward_segments, c1, c2, key=lambda s: s[0])
        fwd2 = _stretch(prof.forward_segments, c2, c3, key=lambda s: s[0])
        bwd = _stretch(prof.backward_segments, c1, c0, key=lambda s: s[0])
        bwd2 = _stretch(prof.backward_segments, c2, c1, key=lambda s: s[0])
        order, order2 = _stretch(prof.order, c1, c2), _stretch(prof.order, c2, c3)
        if None in (fwd, fwd2, bwd, bwd2, order, order2):
            return None
        for (a, b), (a2, b2), seq in ((fwd, fwd2, prof.forward_segments), (bwd, bwd2, prof.backward_segments),
                                      (order, order2, prof.order)):
            items = seq[a:b]
            if [(to2(x[0]), x[1]) if isinstance(x, tuple) else to2(x) for x in items] != seq[a2:b2]:
                return None
        span1 = {k: v for k, v in prof.spans.items() if under1(k)}
        shift = {prof.spans[to2(k)][0] - v[0] for k, v in span1.items() if to2(k) in prof.spans}
        shift |= {prof.spans[to2(k)][1] - v[1] for k, v in span1.items() if to2(k) in prof.spans}
        shift |= {prof.stops[to2(k)] - v for k, v in prof.stops.items() if under1(k) and to2(k) in prof.stops}
        if len(shift) != 1 or len(span1) != sum(1 for k in prof.spans if k == c2 or k.startswith(c2 + ".")):
            return None
        step = shift.pop()
        start = prof.spans[c2][0]
        copies = [_renamer(c1, p) for p in path[2:-2]]
        for name in tables:
            t = getattr(prof, name)
            items = [(k, v) for k, v in t.items() if under1(k)]
            setattr(prof, name, {**t, **{r(k): v for r in copies for k, v in items}})
        # what a checkpointed ancestor of the run recomputes: the copies too (its early stop is
        # after the run; within it, the profile is not written out)
        full1 = sum(v for k, v in prof.forward.items() if under1(k))
        sel1 = sum(v for k, v in prof.recomputed.items() if under1(k))
        end2 = prof.spans[c2][1]
        for anc in {k for k in prof.spans if k == "" or c1.startswith(k + ".")}:
            if prof.stops[anc] < end2 and prof.stops[anc] >= start:
                return None
            if prof.stops[anc] >= end2:
                prof.recompute_full = {**prof.recompute_full, anc: prof.recompute_full[anc] + n_out * full1}
                prof.recompute_selective = {**prof.recompute_selective,
                                            anc: prof.recompute_selective[anc] + n_out * sel1}
        spans = {k: (a + n_out * step if a >= start else a, b + n_out * step if b > start else b)
                 for k, (a, b) in prof.spans.items()}
        stops = {k: v + n_out * step if v >= start else v for k, v in prof.stops.items()}
        for n, r in enumerate(copies, start=1):
            spans.update({r(k): (a + n * step, b + n * step) for k, (a, b) in span1.items()})
            stops.update({r(k): v + n * step for k, v in prof.stops.items() if under1(k)})
        prof.spans, prof.stops = spans, stops
        a, b = fwd
        seg = prof.forward_segments[a:b]
        prof.forward_segments = [*prof.forward_segments[:b], *[(r(p), f) for r in copies for p, f in seg],
                                 *prof.forward_segments[b:]]
        a, b = bwd  # the backward segments are unchanged so far
        seg = prof.backward_segments[a:b]
        prof.backward_segments = [*prof.backward_segments[:a], *[(r(p), f) for r in reversed(copies) for p, f in seg],
                                  *prof.backward_segments[a:]]
        a, b = order
        prof.order = [*prof.order[:b], *[r(p) for r in copies for p in prof.order[a:b]], *prof.order[b:]]
    return prof
