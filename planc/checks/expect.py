"""`expect` statements: unit expectations (P501) and metric bounds (P501-P504).

`metric_problems` checks a metric line on its own (unknown metric, wrong kind of bound, bad
`at` clause); it needs no model, so it runs for `planc check` without one too.
"""

from __future__ import annotations

from typing import Iterator

from planc.checks.context import Context, err
from planc.checks.context_parallel import sequence_problem
from planc.checks.mesh import too_many_ranks
from planc.checks.pipeline import batch_problem, not_estimated
from planc.diagnostics import Diagnostic, suggestion
from planc.lang import syntax as st
from planc.limits import MAX_RANKS
from planc.quantities import show_bytes, show_shape
from planc.resolve.selectors import match_modules
from planc.resolve.step import MicrobatchError, check_splits

METRICS = ("units", "memory.peak", "memory.sharded", "memory.unsharded_peak", "memory.activations")
_OPS = {"==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<=": lambda a, b: a <= b,
        ">=": lambda a, b: a >= b, "<": lambda a, b: a < b, ">": lambda a, b: a > b}


def check_metric_lines(ctx: Context) -> Iterator[Diagnostic]:
    """P102-P104 on `expect` metric lines, read alone: needs no model."""
    for s in ctx.plan.statements:
        if isinstance(s, st.ExpectMetric):
            yield from metric_problems(s)


def check_expects(ctx: Context) -> Iterator[Diagnostic]:
    """P501: `expect` unit lines and `expect units` bounds must hold."""
    unit_names = {u.name for u in ctx.res.units}
    for s in ctx.plan.statements:
        if isinstance(s, st.ExpectUnit):
            yield from _expect_unit(ctx, s, unit_names)
        elif isinstance(s, st.ExpectMetric) and s.metric == "units" and not metric_problems(s):
            yield from _expect_units(ctx, s)


def check_memory_expects(ctx: Context) -> Iterator[Diagnostic]:
    """P502-P504: `expect memory...` bounds must hold under the memory model (lines with
    problems are left to `check_metric_lines`)."""
    for s in ctx.plan.statements:
        if isinstance(s, st.ExpectMetric) and s.metric != "units" and not metric_problems(s):
            yield from _expect_memory(ctx, s)


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
            yield err("P501", f"expected `{bad[0]}` not to be a unit, but it is", s.span,
                      f"{len(bad)} unexpected unit(s)", (f"drop the rule that makes it a unit{made}, "
                                                        "or this expectation",))
        return
    missing = [w for w in wanted if w not in unit_names]
    if missing:
        where = ctx.res.enclosing(missing[0].strip("[]").split(",")[0], g) if not missing[0].startswith("[") else None
        help_ = (f"`{missing[0]}` is managed by unit `{where.name}`",) if where else ()
        yield err("P501", f"expected `{missing[0]}` to be a unit, but it is not", s.span,
                  f"{len(missing)} of {len(wanted)} not unit(s)", help_)


def metric_problems(s: st.ExpectMetric) -> list[Diagnostic]:
    """What is wrong with an `expect` metric line without looking at the model: an unknown
    metric, a bound in the wrong kind of unit (a unit count in bytes, memory without), a
    world size below 1, or an input that is not a batch x sequence of at least one token."""
    if s.metric not in METRICS:
        return [err("P102", f"unknown metric `{s.metric}`", s.metric_span, "not a metric",
                    suggestion(s.metric, METRICS) or ("metrics are " + ", ".join(f"`{m}`" for m in METRICS),))]
    is_memory = s.metric.startswith("memory.")
    if is_memory and not s.value.is_bytes:
        return [err("P103", f"`{s.metric}` is in bytes; `{s.value}` has no byte unit", s.value.span,
                    "no unit", (f"write a size such as `{s.value}GiB` or `{s.value}MB`",))]
    if not is_memory and s.value.is_bytes:
        return [err("P103", f"`{s.metric}` is a count, not a size in bytes", s.value.span, "a byte size",
                    ("write a plain number such as `27`",))]
    if not is_memory and s.world is not None:
        return [err("P104", f"`at world = {s.world}` on `expect {s.metric}`: the units do not depend on the "
                    "world size", s.span, "no effect here",
                    ("remove `at world = ...`; it belongs on `expect memory...` lines",))]
    if s.world is not None and s.world < 1:
        return [err("P103", f"`at world = {s.world}`: a world has at least 1 rank", s.span, "no ranks",
                    ("write the number of ranks the plan runs on, such as `at world = 8`",))]
    if s.world is not None and s.world > MAX_RANKS:
        return [too_many_ranks(s.world, s.span, "`at world =`")]
    if s.input_shape is None:
        return []
    shape, span = s.input_shape, s.input_span or s.span
    if not is_memory:
        return [err("P104", f"`input = {show_shape(shape)}` on `expect {s.metric}`: the input only changes "
                    "memory", span, "no effect here",
                    ("remove it; `input = BxS` belongs on `expect memory...` lines",))]
    if len(shape) != 2:
        return [err("P103", f"`input = {show_shape(shape)}` has {len(shape)} size{'s' * (len(shape) != 1)}; "
                    "the input is batch x sequence", span, "expected two sizes",
                    ("write the batch size and the sequence length in tokens, such as `input = "
                     + (show_shape(shape[:2]) if len(shape) > 2 else "2x512") + "`",))]
    if 0 in shape:
        which = "the batch size" if shape[0] == 0 else "the sequence length"
        return [err("P103", f"`input = {show_shape(shape)}`: {which} is 0", span, "an empty input",
                    ("sizes are at least 1: batch x sequence of token ids, such as `input = 2x512`",))]
    return []


def _expect_units(ctx: Context, s: st.ExpectMetric) -> Iterator[Diagnostic]:
    actual = float(len(ctx.res.units))
    if not _OPS[s.op](actual, s.value.value):
        yield err("P501", f"expected units {s.op} {s.value}, but the plan has {int(actual)}", s.span,
                 f"{int(actual)} units", ("run `planc explain` to list them",))


def _expect_memory(ctx: Context, s: st.ExpectMetric) -> Iterator[Diagnostic]:
    pp = ctx.res.pipeline
    if pp is not None and s.input_shape is not None and batch_problem(pp, s.input_shape, s.span) is not None:
        return  # the batch does not cut into the microbatches: P466 says so (`check_pipeline_batch`)
    world = s.world or ctx.world_size
    if world is None:
        yield err("P503", f"`expect {s.metric}` was not checked: no world size", s.span,
                  "memory depends on the number of ranks",
                  ("add `at world = N` to the line, or pass `--world-size N`",), severity="warning")
        return
    shape = s.input_shape
    if shape is not None and sequence_problem(ctx.res.mesh, world, shape, None) is not None:
        return  # the context axis cannot cut this sequence: P495 says so (`check_context_sequence`)
    if shape is None and s.metric == "memory.activations":
        yield err("P503", f"`expect {s.metric}` was not checked: no input shape", s.span,
                  "activations depend on the input",
                  (f"add the input to the line: `at {_at_clause(s, world, 'BxS')}`, with B the batch size "
                   "and S the sequence length in tokens (e.g. `2x512`)",), severity="warning")
        return
    step = ctx.res.step
    if shape is not None and step is not None and not _splits(shape, step.value.microbatches):
        k = step.value.microbatches
        yield err("P160", f"a batch of {shape[0]} does not divide into the {k} microbatches of a step",
                  s.input_span or s.span, f"{shape[0]} rows do not split in {k}",
                  (f"give a batch that is a multiple of {k} (e.g. `input = {show_shape((k, *shape[1:]))}`), or "
                   "accumulate fewer microbatches",), related=((step.span, f"{k} microbatches per step"),))
        return
    from planc.estimate.role_memory import RoleError
    from planc.estimate.trace import TraceError
    from planc.lower.job import UnknownKind
    try:
        actual = ctx.metrics(s.metric, world, shape)
    except RoleError as exc:  # a pipeline the memory per role cannot cut (a stage with no unit of its own)
        yield not_estimated(pp, s.span, f"`expect {s.metric}` was not checked", str(exc))
        return
    except UnknownKind as exc:  # what the memory per pipeline rank has no rule for (context, experts)
        if pp is None:
            raise
        kind = type(exc.what).__name__
        yield not_estimated(pp, s.span, f"`expect {s.metric}` was not checked", "the memory per pipeline rank does "
                            f"not model {_NOT_PER_RANK.get(kind, f'`{kind}`')} yet",
                            "check it on a real run; `planc check --verify` trains the plan's twin on local ranks")
        return
    except TraceError as exc:
        cause = exc.__cause__
        why = f"{type(cause).__name__}: {_first_line(cause)}" if cause is not None else str(exc)
        ran = f"on `input = {show_shape(shape)}`" if shape is not None else "for this estimate"
        yield err("P504", f"the model did not run {ran}: {why}",
                  s.input_span or s.span, "cannot count activations for this input", (
                      "`input = BxS` runs one forward and backward of the model on token ids of batch B and "
                      "sequence length S; check that the model takes token ids and that S fits it, or remove "
                      "`input =` to check the bound without activations",))
        return
    if actual is None:
        return
    if _OPS[s.op](actual, s.value.value):
        return
    rank = _binding_rank(ctx, s.metric, world, shape) if pp is not None else ""
    if shape is not None:
        included = ", activations included," if s.metric == "memory.peak" else ""
        yield err("P502", f"expected {s.metric} {s.op} {s.value} at world = {world}, input = {show_shape(shape)}, "
                  f"but the estimate{included} is {show_bytes(actual)}{rank}", s.span, "bound does not hold",
                  (f"run `planc explain --world-size {world} --input-shape {show_shape(shape)} ...` for the "
                   "breakdown of this estimate" + (", per pipeline rank" if pp is not None else ""),))
        return
    help_ = [f"run `planc explain --world-size {world} ...` for the breakdown"]
    if s.metric == "memory.peak":
        help_.append(f"activations are not counted without an input shape: write `at {_at_clause(s, world, 'BxS')}` "
                     "with B the batch size and S the sequence length (e.g. `2x512`) to count them")
    yield err("P502", f"expected {s.metric} {s.op} {s.value} at world = {world}, but the estimate is "
              f"{show_bytes(actual)}{rank}", s.span, "bound does not hold", help_)


# what the memory per pipeline rank has no rule for yet, in the plan's words (its READER: planc/estimate/roles.py)
_NOT_PER_RANK = {"AttendOverContext": "context parallelism (`parallel ... context`)",
                 "DispatchExperts": "expert parallelism (`parallel ... expert`)"}


def _binding_rank(ctx: Context, metric: str, world: int, shape) -> str:
    """`, on pipeline rank R (stages ...) at <moment>`: where a pipeline plan's bound fails (the rank
    with the largest value, `Estimate.binding`; its peak's moment for `memory.peak`)."""
    est = ctx.memory(world, shape) if ctx.memory is not None else None
    if est is None or not est.roles:
        return ""
    r = est.binding(metric)
    held = est.roles[r].stages
    stages = f"stage {held[0]}" if len(held) == 1 else "stages " + " and ".join(map(str, held))
    moment = est.roles[r].peak.label if metric == "memory.peak" else ""
    return f", on pipeline rank {r} ({stages})" + (f" at {moment}" if moment else "")


def _first_line(exc: BaseException, limit: int = 160) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _at_clause(s: st.ExpectMetric, world: int, shape: str) -> str:
    """The line's `at` clause with an input added: `world = 8, input = BxS`, or `input = BxS`
    when the world size comes from the command line."""
    return (f"world = {world}, " if s.world is not None else "") + f"input = {shape}"


def _splits(shape: tuple[int, ...], microbatches: int) -> bool:
    """Whether a batch of `shape` splits into the step's microbatches (`resolve.step.check_splits`)."""
    try:
        check_splits(shape, microbatches)
    except MicrobatchError:
        return False
    return True
