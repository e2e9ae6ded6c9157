"""Validation: checks over a resolved plan, each a plain function returning diagnostics.

`CHECKS` lists them once, in the order their findings are reported (the sqlglot
`RULES` pattern). Each check reads a `Context` and never mutates it, so each can be tested
alone. Checks that need the world size skip themselves when it is unknown.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from planc.diagnostics import Diagnostic, suggestion
from planc.lang import syntax as st
from planc.model.graph import ModelGraph
from planc.resolve.ir import Resolution, Unit
from planc.resolve.options import DTYPE_NAMES
from planc.resolve.selectors import match_modules


@dataclass(frozen=True)
class Context:
    plan: st.Plan
    graph: ModelGraph
    res: Resolution
    world_size: int | None
    # memory metrics, if any: (metric, world, input shape) -> bytes; raises `TraceError` when
    # the model cannot run on that input
    metrics: Callable[[str, int | None, tuple[int, ...] | None], float | None] | None = None

    @property
    def mesh_sizes(self) -> tuple[int, int] | None:
        return self.res.mesh.dp_sizes(self.world_size)

    def inner_units(self) -> Iterator[Unit]:
        return (u for u in self.res.units if not u.is_root)


def _err(code, message, span, label="", help_=(), related=(), severity="error") -> Diagnostic:
    return Diagnostic(code=code, severity=severity, message=message, span=span, label=label,
                      help=tuple(help_), related=tuple(related))


# ===================================================================== checks


def check_containers(ctx: Context) -> Iterator[Diagnostic]:
    """P204: ModuleList/ModuleDict have no forward; FSDP2 refuses them."""
    for u in ctx.inner_units():
        for m in u.modules:
            if not ctx.graph.has_forward(m):
                yield _err("P204", f"unit `{m}` is a `{ctx.graph.cls(m)}`, which has no `forward`", u.span,
                           "FSDP2 cannot shard a container",
                           (f"make each child a unit: `unit {m}.*`",))


def check_never_called(ctx: Context) -> Iterator[Diagnostic]:
    """P307: a unit inside a module that reads its children's weights without calling them."""
    from planc.resolve.selectors import FORCE_LEAF_MODULES
    g = ctx.graph
    by_rule: dict = {}
    for u in ctx.inner_units():
        for m in u.modules:
            parent = next((a for a in g.ancestors(m) if g.qualname(a) in FORCE_LEAF_MODULES), None)
            if parent is not None:
                by_rule.setdefault(u.span, []).append((m, parent))
    for span, hits in by_rule.items():
        m, parent = hits[0]
        more = f" (and {len(hits) - 1} more)" if len(hits) > 1 else ""
        yield _err("P307", f"unit `{m}`{more} is never called: its parent `{parent}` (`{g.cls(parent)}`) "
                   "reads its weights directly", span, "FSDP2 would never gather this unit",
                   (f"make the parent the unit instead: `unit {parent}`",))


def check_group_root(ctx: Context) -> Iterator[Diagnostic]:
    """P205: with `root none`, an outermost group unit would act as an FSDP root."""
    if not ctx.res.root_disabled:
        return
    for u in ctx.inner_units():
        if u.is_group and not any(ctx.res.enclosing(a, ctx.graph) for m in u.modules
                                  for a in ctx.graph.ancestors(m)):
            yield _err("P205", f"group unit `{u.name}` would be an FSDP root", u.span,
                       "a list of modules cannot be the root",
                       ("keep the root a unit (remove `root none`), or split the group",))


def check_tied(ctx: Context) -> Iterator[Diagnostic]:
    """P301: one parameter held by modules in two different units."""
    g, res = ctx.graph, ctx.res
    for name, owners in g.tied.items():
        if name in res.ignored:
            continue
        units = {}
        for o in owners:
            u = res.enclosing(o, g)
            units.setdefault(u.name if u else None, (o, u))
        if len(units) < 2:
            continue
        (m1, u1), (m2, u2) = list(units.values())[:2]
        span = (u2.span if u2 and u2.span else u1.span if u1 else None)
        related = [(u.span, f"`{m}` is in unit `{u.name}`") for m, u in ((m1, u1), (m2, u2)) if u and u.span]
        yield _err("P301", f"tied parameter `{name}` is split across units `{u1.name if u1 else 'none'}` "
                   f"and `{u2.name if u2 else 'none'}`", span,
                   f"`{m1}` and `{m2}` share one weight", (
                       f"put both in one unit: `unit [{m1}, {m2}]`",
                       f"or leave both to an enclosing unit (drop the rule that makes `{m1}` or `{m2}` a unit)"),
                   related[:1] if span is not None else related)


def check_unowned(ctx: Context) -> Iterator[Diagnostic]:
    """P302: with `root none`, parameters no unit manages stay replicated and unsynchronised."""
    if not ctx.res.root_disabled:
        return
    owned = set(ctx.res.ignored).union(*(u.params for u in ctx.res.units))
    left = [n for n in ctx.graph.params if n not in owned]
    if left:
        stmt = next(s for s in ctx.plan.statements if isinstance(s, st.RootStmt) and s.disabled)
        shown = ", ".join(f"`{n}`" for n in left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        yield _err("P302", f"{len(left)} parameter(s) belong to no unit: {shown}", stmt.span,
                   "the root is not a unit", (
                       "remove `root none` so the root unit manages them",
                       "or `ignore` them if something else synchronises their gradients"))


def _names(names: list[str], limit: int = 3) -> str:
    """`a`, `a` and `b`, or `a`, `b`, `c` and 4 more: a list of names for one message."""
    shown = [f"`{n}`" for n in names[:limit]]
    if len(names) > limit:
        return ", ".join(shown) + f" and {len(names) - limit} more"
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]


def _by_key(findings) -> dict:
    """Group (key, item) pairs by key, keeping first-seen order: one diagnostic per rule, not
    per parameter or unit a wildcard matched."""
    groups: dict = {}
    for key, item in findings:
        groups.setdefault(key, []).append(item)
    return groups


def check_scalar(ctx: Context) -> Iterator[Diagnostic]:
    """P303: FSDP2 cannot shard 0-dim parameters."""
    found = [(u.span, (name, u.name)) for u in ctx.res.units for name in u.params
             if not ctx.graph.params[name].shape]
    for span, items in _by_key(found).items():
        names = [n for n, _ in items]
        units = list(dict.fromkeys(u for _, u in items))
        locals_ = {n.rpartition(".")[2] for n in names}
        fix = f"ignore **.{next(iter(locals_))}" if len(names) > 1 and len(locals_) == 1 else f"ignore {names[0]}"
        yield _err("P303", f"scalar parameter{'s' * (len(names) > 1)} {_names(names)} in "
                   f"unit{'s' * (len(units) > 1)} {_names(units)}", span,
                   "FSDP2 raises ValueError on 0-dim parameters", (f"add `{fix}`",))


def _dtype(u: Unit, model_dtype: torch.dtype) -> torch.dtype:
    return u["param_dtype"] or model_dtype


def check_precision(ctx: Context) -> Iterator[Diagnostic]:
    """P304: an inner unit computing in another dtype than the unit around it, unbridged."""
    g = ctx.graph
    model_dtype = next(iter(g.params.values())).dtype if g.params else torch.float32
    found = []
    for u in ctx.inner_units():
        outer = _outer(ctx, u)
        if outer is None:
            continue
        du, do = _dtype(u, model_dtype), _dtype(outer, model_dtype)
        if du == do:
            continue
        gaps = []
        if not (u["cast_inputs"] and u["param_dtype"] is not None):
            gaps.append(f"its inputs arrive in {DTYPE_NAMES[do]} but it computes in {DTYPE_NAMES[du]}")
        if u["output_dtype"] != do:
            gaps.append(f"its outputs return in {DTYPE_NAMES[u['output_dtype'] or du]} to {{outer}} "
                        f"({DTYPE_NAMES[do]})")
        if gaps:
            setting = u.settings["param_dtype"]
            found.append(((setting.span or u.span, du, do, tuple(gaps)), (u.name, outer.name)))
    for (span, du, do, gaps), pairs in _by_key(found).items():
        inner, outer = [i for i, _ in pairs], list(dict.fromkeys(o for _, o in pairs))
        where = f"`{outer[0]}`" if len(outer) == 1 else f"the unit{'s' * (len(inner) > 1)} around them"
        gaps = tuple(g.format(outer=where) for g in gaps)
        yield _err("P304", f"unit{'s' * (len(inner) > 1)} {_names(inner)} run{'s' * (len(inner) == 1)} in "
                   f"{DTYPE_NAMES[du]} inside {where} ({DTYPE_NAMES[do]})",
                   span, "; ".join(gaps), (
                       f"on {_names(inner, 1) if len(inner) == 1 else 'these units'} set `precision param = "
                       f"{DTYPE_NAMES[du]}, output = {DTYPE_NAMES[do]}, cast_inputs = true`",
                       "or give both units the same param dtype"))

    yield from _sibling_precision(ctx, model_dtype)


def _outer(ctx: Context, u: Unit) -> Unit | None:
    """The unit around `u`: the one that manages the parent of its first module."""
    parent = next(ctx.graph.ancestors(u.modules[0]), None)
    return None if parent is None else ctx.res.enclosing(parent, ctx.graph)


def _sibling_precision(ctx: Context, model_dtype: torch.dtype) -> Iterator[Diagnostic]:
    """P304 between neighbours: a unit's outputs feed the next unit in model order."""
    g = ctx.graph
    inner = sorted(ctx.inner_units(), key=lambda u: g.pre(u.modules[0]))
    found = []
    for a, b in zip(inner, inner[1:]):
        if _outer(ctx, a) is not _outer(ctx, b) or any(g.is_within(m, n) for m in b.modules for n in a.modules):
            continue  # not neighbours at one level: nesting is checked above
        sent = a["output_dtype"] or _dtype(a, model_dtype)
        computes = _dtype(b, model_dtype)
        if sent != computes and not (b["cast_inputs"] and b["param_dtype"] is not None):
            setting = b.settings["cast_inputs"] if b.settings["cast_inputs"].span else b.settings["param_dtype"]
            found.append(((setting.span or b.span, DTYPE_NAMES[sent], DTYPE_NAMES[computes]), (a.name, b.name)))
    for (span, sent, computes), pairs in _by_key(found).items():
        a, b = pairs[0]
        more = f" (and {len(pairs) - 1} more pair{'s' * (len(pairs) > 2)})" if len(pairs) > 1 else ""
        yield _err("P304", f"unit `{b}` receives {sent} outputs from `{a}` but computes in {computes}{more}",
                   span, "inputs are not cast", (
                       f"set `precision cast_inputs = true` on `{b}`, or `precision output = {computes}` on `{a}`",))


def check_mesh(ctx: Context) -> Iterator[Diagnostic]:
    """P401: the mesh must multiply to the world size."""
    mesh, world = ctx.res.mesh, ctx.world_size
    if world is None or mesh.span is None:
        return
    r, s = mesh.replicate, mesh.shard
    if r is not None and s is not None and r * s != world:
        yield _err("P401", f"mesh {mesh} has {r * s} ranks, but the world size is {world}", mesh.span,
                   f"{r} x {s} != {world}", ("use `*` for one dimension to fill the world",))
    elif (r is None and s and world % s) or (s is None and r and world % r):
        fixed = s if r is None else r
        yield _err("P401", f"mesh {mesh} cannot fill a world of {world} ranks", mesh.span,
                   f"{world} is not a multiple of {fixed}", (f"pick a size that divides {world}",))


def check_reshard_size(ctx: Context) -> Iterator[Diagnostic]:
    """P402: `reshard after_forward = N` needs N to divide the shard size."""
    sizes = ctx.mesh_sizes
    if sizes is None or sizes[1] is None:
        return
    shard = sizes[1]
    found = []
    for u in ctx.res.units:
        value = u["reshard_after_forward"]
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if value > shard or shard % value:
            setting = u.settings["reshard_after_forward"]
            found.append(((setting.span or u.span, value), u.name))
    divisors = [d for d in range(1, shard + 1) if shard % d == 0]
    yield from _degenerate_reshard(ctx, shard)
    for (span, value), units in _by_key(found).items():
        yield _err("P402", f"unit{'s' * (len(units) > 1)} {_names(units)} reshard{'s' * (len(units) == 1)} to "
                   f"groups of {value}, which does not divide the shard size {shard}", span,
                   f"{value} does not divide {shard}", ("choose one of " + ", ".join(map(str, divisors[:12])),))


def _degenerate_reshard(ctx: Context, shard: int) -> Iterator[Diagnostic]:
    """P406: an int reshard size of 1 or of the whole shard group is really a boolean."""
    seen = set()
    for u in ctx.res.units:
        value = u["reshard_after_forward"]
        if isinstance(value, bool) or not isinstance(value, int) or value not in (1, shard):
            continue
        span = u.settings["reshard_after_forward"].span or u.span
        if span in seen:
            continue
        seen.add(span)
        same = "false" if value == 1 else "true"
        yield _err("P406", f"`reshard after_forward = {value}` on a shard group of {shard} is the same as "
                   f"`{same}`", span, f"means {same}", (f"write `reshard after_forward = {same}`",),
                   severity="warning")


def check_ignored_precision(ctx: Context) -> Iterator[Diagnostic]:
    """P308: an ignored parameter stays in its own dtype inside a unit that casts the others."""
    g, res = ctx.graph, ctx.res
    by_span: dict = {}
    for name, span in res.ignored.items():
        owner = res.enclosing(g.owners(name)[0], g)
        if owner is None or owner["param_dtype"] is None or owner["param_dtype"] == g.params[name].dtype:
            continue
        by_span.setdefault(span, []).append((name, owner))
    for span, hits in by_span.items():
        name, owner = hits[0]
        more = f" (and {len(hits) - 1} more)" if len(hits) > 1 else ""
        yield _err("P308", f"ignored parameter `{name}`{more} stays {DTYPE_NAMES.get(g.params[name].dtype, '?')} "
                   f"in unit `{owner.name}`, which computes in {DTYPE_NAMES[owner['param_dtype']]}", span,
                   "FSDP2 does not cast ignored parameters",
                   ("cast it in the model's forward, or do not ignore it",), severity="warning")


def check_placements(ctx: Context) -> Iterator[Diagnostic]:
    """P403/P404: `Shard(d)` must name an existing dim, divisible by the shard size when d != 0."""
    sizes = ctx.mesh_sizes
    missing, uneven = [], []
    for name, (dim, span) in ctx.res.placements.items():
        shape = ctx.graph.params[name].shape
        if dim >= len(shape):
            missing.append(((span, dim, len(shape)), name))
        elif dim and sizes is not None and sizes[1] and shape[dim] % sizes[1]:
            uneven.append(((span, dim, shape[dim], sizes[1]), name))
    for (span, dim, ndim), names in _by_key(missing).items():
        yield _err("P403", f"`Shard({dim})` on {_names(names)}, which ha{'ve' if len(names) > 1 else 's'} "
                   f"only {ndim} dim(s)", span, "no such dimension",
                   (f"use a dim below {ndim}" if ndim else "a 0-dim parameter cannot be sharded; `ignore` it",))
    for (span, dim, size, shard), names in _by_key(uneven).items():
        yield _err("P404", f"`Shard({dim})` on {_names(names)}: dim {dim} has size {size}, not divisible by "
                   f"the shard size {shard}", span, f"{size} % {shard} != 0",
                   ("use `Shard(0)` (padded automatically) or a shard size that divides it",))


def check_root_reshard(ctx: Context) -> Iterator[Diagnostic]:
    """P902 (note): the root inherits `reshard after_forward = true` from `defaults`."""
    root = next((u for u in ctx.res.units if u.is_root), None)
    if root is None:
        return
    setting = root.settings["reshard_after_forward"]
    if setting.rule == "defaults" and setting.value is True:
        yield _err("P902", "the root unit reshards after forward: it inherits this from `defaults`",
                   setting.span, "applies to the root too",
                   ("add `root { reshard after_forward = false }` (FSDP2's default for the root): "
                    "backward needs the root's parameters first",), severity="note")


def check_shadowed(ctx: Context) -> Iterator[Diagnostic]:
    """P207 (warning): a rule whose every unit and option is set again later.

    Not for rules already reported (a bad option, a P203 conflict: the warning would only
    echo the error), nor for rules of an included plan: overriding a base plan is what
    `include` is for. The warning points at a later rule that overrides this one.
    """
    res = ctx.res
    for i, s in enumerate(ctx.plan.statements):
        if isinstance(s, (st.UnitStmt, st.CheckpointStmt, st.CompileStmt)) and not res.rule_effects.get(i) \
                and i not in res.conflicted and i not in res.broken and s.span.file == ctx.plan.file:
            matched = _matched_modules(ctx, s)
            if matched:
                later = _overriding_span(ctx, s, i, matched)
                yield _err("P207", "this rule has no effect: later rules set everything it sets", s.span,
                           "overridden", ("remove it, or move it after the rules that override it",),
                           related=((later, "overridden here"),) if later else (), severity="warning")


def _matched_modules(ctx: Context, s) -> list[str]:
    sels = ([s.target] if isinstance(s, st.UnitStmt) and isinstance(s.target, st.Selector) else
            list(s.target.selectors) if isinstance(s, st.UnitStmt) else [s.selector])
    return [p for sel in sels for p in match_modules(ctx.graph, sel, optional=True).paths]


def _overriding_span(ctx: Context, s, i: int, modules: list[str]):
    """The span of a later rule that sets what statement `i` set, on its first module."""
    res, m = ctx.res, modules[0]
    if isinstance(s, st.CheckpointStmt):
        setting = res.checkpoint.get(m)
    elif isinstance(s, st.CompileStmt):
        setting = res.compile.get(m)
    else:
        k = res.unit_of_module.get(m)
        if k is None:
            return None
        unit = res.units[k]
        later = [v for v in unit.settings.values() if v.order > i and v.span is not None]
        if unit.span is not None and unit.span != s.span:
            return unit.span
        return min(later, key=lambda v: v.order).span if later else None
    return setting.span if setting is not None and setting.order > i else None


METRICS = ("units", "memory.peak", "memory.sharded", "memory.unsharded_peak", "memory.activations")
_OPS = {"==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<=": lambda a, b: a <= b,
        ">=": lambda a, b: a >= b, "<": lambda a, b: a < b, ">": lambda a, b: a > b}


def _show_bytes(n: float) -> str:
    """`70.00 GiB`, `12.5 KiB`: the unit that keeps the number readable."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def check_expects(ctx: Context) -> Iterator[Diagnostic]:
    """P501/P502: `expect` statements must hold."""
    unit_names = {u.name for u in ctx.res.units}
    for s in ctx.plan.statements:
        if isinstance(s, st.ExpectUnit):
            yield from _expect_unit(ctx, s, unit_names)
        elif isinstance(s, st.ExpectMetric):
            yield from _expect_metric(ctx, s)


def _expect_unit(ctx: Context, s: st.ExpectUnit, unit_names: set[str]) -> Iterator[Diagnostic]:
    g = ctx.graph
    if isinstance(s.target, st.Group):
        members = []
        for sel in s.target.selectors:
            members += match_modules(g, sel, optional=True).paths
        wanted = ["[" + ", ".join(sorted(members, key=g.pre)) + "]"]
    else:
        m = match_modules(g, s.target, optional=s.negated)
        if not m.ok:
            yield from m.diagnostics
            return
        wanted = m.paths
    if s.negated:
        bad = [w for w in wanted if w in unit_names]
        if bad:
            unit = ctx.res.unit(bad[0])
            made = f" (made by `{unit.rule}` on line {unit.span.line})" if unit.span else ""
            yield _err("P501", f"expected `{bad[0]}` not to be a unit, but it is", s.span,
                       f"{len(bad)} unexpected unit(s)", (f"drop the rule that makes it a unit{made}, "
                                                         "or this expectation",))
        return
    missing = [w for w in wanted if w not in unit_names]
    if missing:
        where = ctx.res.enclosing(missing[0].strip("[]").split(",")[0], g) if not missing[0].startswith("[") else None
        help_ = (f"`{missing[0]}` is managed by unit `{where.name}`",) if where else ()
        yield _err("P501", f"expected `{missing[0]}` to be a unit, but it is not", s.span,
                   f"{len(missing)} of {len(wanted)} not unit(s)", help_)


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def metric_problems(s: st.ExpectMetric) -> list[Diagnostic]:
    """What is wrong with an `expect` metric line without looking at the model: an unknown
    metric, a bound in the wrong kind of unit (a unit count in bytes, memory without), a
    world size below 1, or an input that is not a batch x sequence of at least one token."""
    if s.metric not in METRICS:
        return [_err("P102", f"unknown metric `{s.metric}`", s.metric_span, "not a metric",
                     suggestion(s.metric, METRICS) or ("metrics are " + ", ".join(f"`{m}`" for m in METRICS),))]
    is_memory = s.metric.startswith("memory.")
    if is_memory and not s.value.is_bytes:
        return [_err("P103", f"`{s.metric}` is in bytes; `{s.value}` has no byte unit", s.value.span,
                     "no unit", (f"write a size such as `{s.value}GiB` or `{s.value}MB`",))]
    if not is_memory and s.value.is_bytes:
        return [_err("P103", f"`{s.metric}` is a count, not a size in bytes", s.value.span, "a byte size",
                     ("write a plain number such as `27`",))]
    if not is_memory and s.world is not None:
        return [_err("P104", f"`at world = {s.world}` on `expect {s.metric}`: the units do not depend on the "
                     "world size", s.span, "no effect here",
                     ("remove `at world = ...`; it belongs on `expect memory...` lines",))]
    if s.world is not None and s.world < 1:
        return [_err("P103", f"`at world = {s.world}`: a world has at least 1 rank", s.span, "no ranks",
                     ("write the number of ranks the plan runs on, such as `at world = 8`",))]
    if s.input_shape is None:
        return []
    shape, span = s.input_shape, s.input_span or s.span
    if not is_memory:
        return [_err("P104", f"`input = {_shape(shape)}` on `expect {s.metric}`: the input only changes "
                     "memory", span, "no effect here",
                     ("remove it; `input = BxS` belongs on `expect memory...` lines",))]
    if len(shape) != 2:
        return [_err("P103", f"`input = {_shape(shape)}` has {len(shape)} size{'s' * (len(shape) != 1)}; "
                     "the input is batch x sequence", span, "expected two sizes",
                     ("write the batch size and the sequence length in tokens, such as `input = "
                      + (_shape(shape[:2]) if len(shape) > 2 else "2x512") + "`",))]
    if 0 in shape:
        which = "the batch size" if shape[0] == 0 else "the sequence length"
        return [_err("P103", f"`input = {_shape(shape)}`: {which} is 0", span, "an empty input",
                     ("sizes are at least 1: batch x sequence of token ids, such as `input = 2x512`",))]
    return []


def _expect_metric(ctx: Context, s: st.ExpectMetric) -> Iterator[Diagnostic]:
    problems = metric_problems(s)
    if problems:
        yield from problems
        return
    if s.metric == "units":
        actual = float(len(ctx.res.units))
        if not _OPS[s.op](actual, s.value.value):
            yield _err("P501", f"expected units {s.op} {s.value}, but the plan has {int(actual)}", s.span,
                       f"{int(actual)} units", ("run `planc explain` to list them",))
        return
    world = s.world or ctx.world_size
    if ctx.metrics is None:
        return
    if world is None:
        yield _err("P503", f"`expect {s.metric}` was not checked: no world size", s.span,
                   "memory depends on the number of ranks",
                   ("add `at world = N` to the line, or pass `--world-size N`",), severity="warning")
        return
    shape = s.input_shape
    if shape is None and s.metric == "memory.activations":
        yield _err("P503", f"`expect {s.metric}` was not checked: no input shape", s.span,
                   "activations depend on the input",
                   (f"add the input to the line: `at {_at_clause(s, world, 'BxS')}`, with B the batch size "
                    "and S the sequence length in tokens (e.g. `2x512`)",), severity="warning")
        return
    from planc.estimate.trace import TraceError
    try:
        actual = ctx.metrics(s.metric, world, shape)
    except TraceError as err:
        cause = err.__cause__
        why = f"{type(cause).__name__}: {_first_line(cause)}" if cause is not None else str(err)
        yield _err("P504", f"the model did not run on `input = {_shape(shape)}`: {why}",
                   s.input_span or s.span, "cannot count activations for this input", (
                       "`input = BxS` runs one forward and backward of the model on token ids of batch B and "
                       "sequence length S; check that the model takes token ids and that S fits it, or remove "
                       "`input =` to check the bound without activations",))
        return
    if actual is None:
        return
    if _OPS[s.op](actual, s.value.value):
        return
    if shape is not None:
        included = ", activations included," if s.metric == "memory.peak" else ""
        yield _err("P502", f"expected {s.metric} {s.op} {s.value} at world = {world}, input = {_shape(shape)}, "
                   f"but the estimate{included} is {_show_bytes(actual)}", s.span, "bound does not hold",
                   (f"run `planc explain --world-size {world} --input-shape {_shape(shape)} ...` for the "
                    "breakdown of this estimate",))
        return
    help_ = [f"run `planc explain --world-size {world} ...` for the breakdown"]
    if s.metric == "memory.peak":
        help_.append(f"activations are not counted without an input shape: write `at {_at_clause(s, world, 'BxS')}` "
                     "with B the batch size and S the sequence length (e.g. `2x512`) to count them")
    yield _err("P502", f"expected {s.metric} {s.op} {s.value} at world = {world}, but the estimate is "
               f"{_show_bytes(actual)}", s.span, "bound does not hold", help_)


def _first_line(err: BaseException, limit: int = 160) -> str:
    text = (str(err).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _at_clause(s: st.ExpectMetric, world: int, shape: str) -> str:
    """The line's `at` clause with an input added: `world = 8, input = BxS`, or `input = BxS`
    when the world size comes from the command line."""
    return (f"world = {world}, " if s.world is not None else "") + f"input = {shape}"


CHECKS: tuple[Callable[[Context], Iterator[Diagnostic]], ...] = (
    check_containers,
    check_never_called,
    check_group_root,
    check_tied,
    check_unowned,
    check_scalar,
    check_ignored_precision,
    check_precision,
    check_mesh,
    check_reshard_size,
    check_placements,
    check_root_reshard,
    check_shadowed,
    check_expects,
)


def validate(ctx: Context) -> list[Diagnostic]:
    """Run every check in order and collect all findings."""
    out: list[Diagnostic] = []
    for check in CHECKS:
        if ctx.metrics is not None and any(d.is_error for d in out):
            # NOTE: memory estimates of a plan with errors are meaningless (and the memory
            # model may assume a valid plan, e.g. placements on existing dims): skip them.
            ctx = dataclasses.replace(ctx, metrics=None)
        out.extend(check(ctx))
    return out
