"""Pipeline parallelism, statically (P451, P465-P476, P479): the stages, the units, the schedule, the batch.

The `pipeline` and `stage` lines themselves are resolved in `planc/resolve/pipeline.py`
(P460-P464, P470, P477, P478); here the stages are checked against the model and the rest
of the plan. What torch accepts but trains wrong or fails deep in its runtime is refused, each
backed by a facts test of what torch really does (tests/test_pipeline_facts_dist.py): FSDP
resharding after forward under a split-backward schedule (wrong gradients, P465) and a batch
that does not divide into the microbatches (P466). Every module with parameters lies in one
stage (P467, P468), the stages run in forward order (P469), the embedding first and the head
last (P471); a unit (P472), a tied weight (P473) or a module a rule applies to (P479) does not
cross stages; fewer microbatches than stages is a warning with the bubble (P474); a `step`
accumulation beside a pipeline is refused (P475); microbatches torch refuses to build the
schedule with (DualPipeV with fewer than stages, the interleaved schedules off a multiple of
their rounds) are P463, with torch's reason; what is not estimated for a pipeline plan (the
fake-process-group step of `check --simulate`, a stage the memory per role cannot cut) is P476
(`not_estimated`).
"""

from __future__ import annotations

from typing import Iterator

from planc.checks.context import Context, by_key, err, listed
from planc.diagnostics import Diagnostic
from planc.lang import syntax as st
from planc.resolve.pipeline import SINGLE_STAGE, SPLIT_BACKWARD, Pipeline
from planc.resolve.step import MicrobatchError, check_splits

FACTS = "tests/test_pipeline_facts_dist.py"


def _cut(ctx: Context) -> Pipeline | None:
    """The pipeline, when its stages are cut (every stage there)."""
    pp = ctx.res.pipeline
    if pp is None or not pp.stages or len(pp.stages) != pp.stage_count:
        return None
    return pp


def _param_modules(ctx: Context) -> list[str]:
    """Modules with parameters of their own, in forward (registration) order."""
    g = ctx.graph
    return [m for m in g.modules if g.own_params(m)]


def check_pipeline_stages(ctx: Context) -> Iterator[Diagnostic]:
    """P467 / P468 / P471 / P469: every module with parameters in exactly one stage, the
    embedding in the first and the head in the last, the stages in forward order."""
    pp = _cut(ctx)
    if pp is None:
        return
    mods = _param_modules(ctx)
    where = {m: pp.stage_of(m) for m in mods}
    lost = [m for m in mods if not where[m]]
    if lost:
        root = [m for m in lost if m == ""]
        yield err("P467", f"{listed(['<root>' if m == '' else m for m in lost])} "
                  f"{'is' if len(lost) == 1 else 'are'} in no pipeline stage", pp.stage_spans[-1],
                  f"{len(lost)} module(s) with parameters left out",
                  ("the model's root holds parameters of its own, which no stage can keep: move them into a submodule"
                   if root else f"add {listed(lost)} to the `stage` line that runs {'it' if len(lost) == 1 else 'them'}",))
    twice = [m for m in mods if len(where[m]) > 1]
    if twice:
        a, b = where[twice[0]][:2]
        both = _overlap(pp.stages[a], pp.stages[b])
        yield err("P468", f"{listed(both)} {'is' if len(both) == 1 else 'are'} in stages {a} and {b}",
                  pp.stage_spans[b], f"also in stage {a}", (f"keep {listed(both)} in one stage",),
                  related=((pp.stage_spans[a], f"stage {a}"),))
    if lost or twice:
        return
    last = len(pp.stages) - 1
    embedding = next((m for m in mods if ctx.graph.cls(m).endswith("Embedding")), None)
    head = mods[-1]
    ends_ok = True
    if embedding is not None and where[embedding][0] != 0:
        ends_ok = False
        s = where[embedding][0]
        yield err("P471", f"the input embedding `{embedding}` is in stage {s}, not the first", pp.stage_spans[s],
                  "the first stage takes the token ids", (f"move `{embedding}` to stage 0",),
                  related=((pp.stage_spans[0], "stage 0"),))
    if where[head][0] != last:
        ends_ok = False
        s = where[head][0]
        yield err("P471", f"the output head `{head}` is in stage {s}, not the last", pp.stage_spans[s],
                  "the last stage computes the loss", (f"move `{head}` to stage {last}",),
                  related=((pp.stage_spans[last], f"stage {last}"),))
    if not ends_ok:
        return
    prev, prev_mod = 0, _top(pp, mods[0])
    for leaf in mods:
        s, m = where[leaf][0], _top(pp, leaf)
        if s < prev:
            yield err("P469", f"stage {prev} holds `{prev_mod}`, which runs before `{m}` of stage {s}: the stages "
                      "are out of forward order", pp.stage_spans[s], f"runs after stage {prev}'s modules",
                      ("each stage holds the modules that run after the previous stage's: stage 0 the first "
                       f"ones; move `{m}` to stage {prev} or later, or `{prev_mod}` to stage {s} or earlier",),
                      related=((pp.stage_spans[prev], f"stage {prev}"),))
            return
        prev, prev_mod = s, m


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def _overlap(a: tuple[str, ...], b: tuple[str, ...]) -> list[str]:
    """The subtrees two stages both hold: the deeper path of each nested pair."""
    return [n if _inside(n, m) else m for m in a for n in b if _inside(n, m) or _inside(m, n)]


def _top(pp: Pipeline, path: str) -> str:
    """The module of a stage's list that holds `path` (as the `stage` line names it)."""
    return next(m for mods in pp.stages for m in mods if _inside(path, m))


def check_pipeline_units(ctx: Context) -> Iterator[Diagnostic]:
    """P472: an FSDP unit's modules lie in two stages."""
    pp = _cut(ctx)
    if pp is None:
        return
    for u in ctx.res.units:
        if u.is_root:
            continue
        # a module in two stages is P468's; a unit across stages is about modules in one each
        stages = sorted({found[0] for found in map(pp.stage_of, u.modules) if len(found) == 1})
        if len(stages) > 1:
            yield err("P472", f"unit {u.name} spans stages {stages[0]} and {stages[1]}", u.span,
                      "one FSDP group, two ranks",
                      (f"split the unit so that each part lies in one stage, or move the boundary between stages "
                       f"{stages[0]} and {stages[1]}",), related=((pp.stage_spans[stages[1]], f"stage {stages[1]}"),))


def check_pipeline_rules(ctx: Context) -> Iterator[Diagnostic]:
    """P479: a `checkpoint`, `compile` or `parallel` rule on a module the stages cut apart (an
    ancestor of modules in two stages): no stage holds the module, so the rule would do nothing."""
    pp = _cut(ctx)
    if pp is None:
        return
    res = ctx.res
    found = []
    for table in (res.checkpoint, res.compile, res.parallel, res.context):
        for path, setting in table.items():
            if pp.stage_of(path):
                continue
            inner = sorted({i for i, mods in enumerate(pp.stages) for m in mods if _inside(m, path)})
            if len(inner) > 1:
                found.append(((setting.span, setting.rule, inner[0], inner[-1]), path))
    for (span, rule, first, last), paths in by_key(found).items():
        yield err("P479", f"`{rule}` applies to {listed(paths)}, which the pipeline cuts into stages {first} to {last}",
                  span, "no stage holds the whole module",
                  ("apply it to the modules inside the stages instead (e.g. the blocks: `layers.*`), or move the "
                   "stage boundaries outside the module",))


def check_pipeline_tied(ctx: Context) -> Iterator[Diagnostic]:
    """P473: a parameter shared by modules in two stages (torchtitan refuses weight tying with PP)."""
    pp = _cut(ctx)
    if pp is None:
        return
    for name, owners in ctx.graph.tied.items():
        stages = sorted({s for o in owners for s in pp.stage_of(o)})
        if len(stages) > 1:
            yield err("P473", f"`{name}` is tied between {listed(owners)}, in stages {stages[0]} and {stages[1]}",
                      pp.stage_spans[stages[1]], "a tied weight across stages",
                      ("the two copies would train apart on two ranks (torchtitan refuses weight tying under a "
                       "pipeline too): untie them in the model, or train without a pipeline",),
                      related=((pp.stage_spans[stages[0]], f"stage {stages[0]}"),))


def check_pipeline_reshard(ctx: Context) -> Iterator[Diagnostic]:
    """P465: `reshard after_forward` set to reshard on a unit under a split-backward schedule."""
    pp = ctx.res.pipeline
    if pp is None or pp.schedule not in SPLIT_BACKWARD:
        return
    found = []
    for u in ctx.res.units:
        value = u["reshard_after_forward"]
        if value is not None and value is not False:
            found.append((u.settings["reshard_after_forward"].span or u.span, u.name))
    for span, units in by_key(found).items():
        yield err("P465", f"unit{'s' * (len(units) > 1)} {listed(units)} reshard{'s' * (len(units) == 1)} after "
                  f"forward under {pp.schedule}: wrong gradients on torch 2.13", span, "resharded after forward",
                  ("remove `reshard after_forward` (under a pipeline planc, like torchtitan, keeps each unit "
                   f"unsharded between forward and backward), or use a schedule without a split backward; {FACTS} "
                   "shows the wrong gradients",), related=((pp.span, f"{pp.schedule} splits the backward"),))


def check_pipeline_checkpoint(ctx: Context) -> Iterator[Diagnostic]:
    """P451: activation checkpointing under a split-backward schedule: torch 2.13's composable
    `checkpoint` (what `planc.apply` runs) fails in the weight backward (`W`) there."""
    pp = ctx.res.pipeline
    if pp is None or pp.schedule not in SPLIT_BACKWARD:
        return
    found = [((setting.span, setting.rule), path) for path, setting in ctx.res.checkpoint.items()
             if setting.value not in (None, "none")]
    for (span, rule), paths in by_key(found).items():
        yield err("P451", f"`{rule}` checkpoints {listed(paths)} under {pp.schedule}: torch 2.13's checkpoint fails "
                  "in its weight backward", span, "checkpointing under a split backward",
                  (f"remove the `checkpoint` line, or use a schedule without a split backward (1F1B, Interleaved1F1B); "
                   f"{FACTS} shows the failure (AttributeError in `backward_weight_one_chunk`)",),
                  related=((pp.span, f"{pp.schedule} splits the backward"),))


def bubble(pp: Pipeline) -> float:
    """The idle fraction of a step: (p - 1) / (m + p - 1), or (p - 1) / (v m + p - 1) interleaved."""
    p, m = pp.pp or 1, pp.microbatch_count or 1
    v = 1 if pp.schedule in SINGLE_STAGE else pp.stages_per_rank
    return (p - 1) / (v * m + p - 1)


def check_pipeline_microbatches(ctx: Context) -> Iterator[Diagnostic]:
    """P463: microbatches torch's schedule refuses; P474 (warning): fewer microbatches than stages;
    P475: a `step` accumulation beside the pipeline."""
    pp = ctx.res.pipeline
    if pp is None or pp.stage_count is None:
        return
    m = pp.microbatch_count
    refused = schedule_refused(pp)
    if refused is not None:
        yield err("P463", f"torch refuses to build {pp.schedule} with {m} microbatch{'es' * (m != 1)} on "
                  f"{pp.pp} ranks x {pp.stages_per_rank} stages: {refused}", pp.option_span("microbatches"),
                  "torch's schedule refuses these numbers",
                  (f"use {_fitting(pp)} microbatches" if _fitting(pp) else "use more microbatches",))
    elif m < pp.stage_count:
        yield err("P474", f"{m} microbatch{'es' * (m != 1)} for {pp.stage_count} stages: the pipeline idles "
                  f"{bubble(pp):.0%} of the step", pp.option_span("microbatches"), "fewer microbatches than stages",
                  (f"use at least {pp.stage_count} microbatches (the bubble is (p - 1) / "
                   + ("(m + p - 1)" if pp.schedule in SINGLE_STAGE else "(v m + p - 1)")
                   + " of a step on p pipeline ranks" + ("" if pp.schedule in SINGLE_STAGE else
                                                         " with v stages per rank") + ")",), severity="warning")
    step = ctx.res.step
    if step is not None and step.value.microbatches > 1:
        yield err("P475", "`step { accumulate }` beside a pipeline: the pipeline's microbatches are the accumulation",
                  step.span, "a second accumulation",
                  (f"remove the `step` line and write `microbatches {step.value.microbatches * m}` in the "
                   "`pipeline` block",), related=((pp.span, "the pipeline"),))


def schedule_refused(pp: Pipeline, microbatches: int | None = None) -> str | None:
    """torch's own reason for refusing to build the schedule with these numbers (None: it builds):
    DualPipeV needs a microbatch per stage, the interleaved schedules a multiple of their rounds."""
    from planc.lower.schedules import schedule
    try:
        schedule(pp.schedule, pp.pp, microbatches or pp.microbatch_count, pp.stages_per_rank)
    except ValueError as exc:
        return str(exc).split(". ")[0].rstrip(".")
    return None


def _fitting(pp: Pipeline) -> str:
    """The nearest microbatch counts above the plan's that torch builds (for the help)."""
    m = pp.microbatch_count
    found = [k for k in range(m + 1, m + 4 * (pp.stage_count or 1) + 1) if schedule_refused(pp, k) is None][:2]
    return " or ".join(map(str, found))


def check_pipeline_batch(ctx: Context) -> Iterator[Diagnostic]:
    """P466: an `expect` line's batch (each data-parallel rank's) does not divide into the microbatches."""
    pp = ctx.res.pipeline
    if pp is None or pp.microbatch_count is None:
        return
    for s in ctx.plan.statements:
        if isinstance(s, st.ExpectMetric) and s.input_shape:
            found = batch_problem(pp, s.input_shape, s.input_span or s.span)
            if found is not None:
                yield found


def batch_problem(pp: Pipeline, shape: tuple[int, ...], span) -> Diagnostic | None:
    """P466 when the batch of `shape` (one data-parallel rank's) does not cut into the microbatches."""
    m = pp.microbatch_count
    if m is None:
        return None
    try:
        check_splits(shape, m)  # the one rule for cutting a batch into microbatches
        return None
    except MicrobatchError:
        pass
    return err("P466", f"a batch of {shape[0]} does not divide into the pipeline's {m} microbatches", span,
               f"{shape[0]} rows do not split in {m}",
               (f"give each data-parallel rank a batch that is a multiple of {m}, or use a number of microbatches "
                f"that divides {shape[0]} (torch fails deep in its runtime on uneven microbatches: {FACTS})",),
               related=((pp.option_span("microbatches"), f"{m} microbatches"),) if span != pp.option_span("microbatches")
               else ())


NO_UNIT_FIX = ("give each stage's modules a `unit` of their own (`unit layers.*`, `unit tok_embeddings`): the "
              "trace names each op's innermost unit, so a stage without one cannot be told from the root")


def not_estimated(pp: Pipeline, span, what: str, why: str, fix: str = NO_UNIT_FIX) -> Diagnostic:
    """P476 (warning): `what` (`... was not checked`) was not done for this pipeline plan, because `why`
    (by default a stage with no unit of its own: `planc.estimate.role_memory.RoleError`)."""
    return err("P476", f"{what}: {why}", span, "not estimated", (fix,),
               related=((pp.span, "the pipeline"),) if span != pp.span else (), severity="warning")
