"""The `pipeline` and `stage` statements: the schedule, its microbatches and the stages, resolved.

    mesh (pipeline = 2, shard = *)
    pipeline 1F1B { microbatches 8 }
    stage 0: tok_embeddings, layers[0:4]
    stage 1: layers[4:], norm, output

`pipeline NAME` names torch's schedule class (`Schedule` + NAME: `SCHEDULES`). Its block
takes `microbatches N` (per optimizer step; default: the number of stages), `stages_per_rank
= N` (default 1 for the single-stage schedules, 2 for the others; exactly 2 for the V
schedules) and `split = parameters | compute` (how the automatic split weighs a block:
`planc/resolve/split.py`), e.g. `pipeline Interleaved1F1B { microbatches 8, stages_per_rank =
2 }`. Without `stage` lines the model is cut automatically into pipeline x stages_per_rank
stages; with them, stage N holds the modules its selectors match. Which rank holds which stage
(loop or V) follows from the schedule (`planc/lower/schedules.py::placement`). What the stages
must satisfy (every module in one stage, forward order, tied weights, units) is checked in
`planc/checks/pipeline.py`; this module reports what is wrong with the lines themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.diagnostics import Diagnostic, Span, suggestion
from planc.lang import syntax as st
from planc.model.graph import ModelGraph
from planc.resolve.mesh import Mesh, Role
from planc.resolve.options import OptionSpec, Param, bind_block, enum, positive_int, replaced
from planc.resolve.selectors import match_modules
from planc.resolve.split import SplitError, auto_split

# torch.distributed.pipelining's schedule classes (torch 2.13), without the `Schedule` prefix.
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
             "DualPipeV")
SINGLE_STAGE = ("GPipe", "1F1B")                 # one stage per rank
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")     # exactly two stages per rank, placed as a V
# Schedules that split the backward into input and weight gradients: with FSDP resharding after
# forward they train with wrong gradients on torch 2.13 (planc/checks/pipeline.py, P465).
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
SPLITS = ("parameters", "compute")               # what the automatic split balances


def default_stages_per_rank(schedule: str) -> int:
    """torchtitan's default: 1 for a single-stage schedule, 2 otherwise."""
    return 1 if schedule in SINGLE_STAGE else 2


def stages_per_rank_problem(schedule: str, n: int) -> str | None:
    """Why `n` stages per rank does not fit `schedule` (None when it does)."""
    if schedule in V_SCHEDULES and n != 2:
        return f"{schedule} places exactly 2 stages per rank (a V), not {n}"
    if schedule in SINGLE_STAGE and n != 1:
        return f"{schedule} runs one stage per rank, not {n}"
    if schedule not in SINGLE_STAGE and n < 2:
        return f"{schedule} runs several stages per rank (at least 2), not {n}"
    return None


@dataclass(frozen=True)
class Pipeline:
    """The resolved `pipeline` line and the stages.

    Attributes:
        schedule: torch's schedule name (`SCHEDULES`).
        pp: the pipeline axis size (None when the mesh has none or it is `*`).
        microbatches: microbatches per optimizer step (None: one per stage, filled in `count`).
        stages_per_rank: virtual stages per pipeline rank.
        split: `explicit` (from `stage` lines), or what the automatic split balanced (`SPLITS`).
        stages: stage index -> its module subtrees, in model order (empty when not cut).
        stage_spans: each stage's `stage` line (the `pipeline` line for an automatic split).
        span: the `pipeline` line; `options`: the option spans by name.
    """

    schedule: str
    pp: int | None
    microbatches: int | None
    stages_per_rank: int
    split: str
    stages: tuple[tuple[str, ...], ...]
    stage_spans: tuple[Span, ...]
    span: Span
    options: tuple[tuple[str, Span], ...] = ()

    @property
    def stage_count(self) -> int | None:
        return None if self.pp is None else self.pp * self.stages_per_rank

    @property
    def microbatch_count(self) -> int | None:
        """The microbatches per step: as written, or one per stage."""
        return self.microbatches if self.microbatches is not None else self.stage_count

    def option_span(self, name: str) -> Span:
        return dict(self.options).get(name, self.span)

    def stage_of(self, path: str) -> list[int]:
        """The stages whose subtrees hold module `path`."""
        return [i for i, mods in enumerate(self.stages)
                if any(path == m or path.startswith(m + ".") for m in mods)]


PIPELINE_OPTIONS: dict[str, OptionSpec] = {
    "microbatches": OptionSpec(
        params=(Param("microbatches", positive_int, None), Param("stages_per_rank", positive_int, None),
                Param("split", enum(*SPLITS), None)),
        positional=("microbatches",),
        summary="microbatches per optimizer step (default: one per stage); `stages_per_rank = N` virtual stages "
                "per pipeline rank; `split = parameters | compute` what the automatic split balances"),
    "stages_per_rank": OptionSpec(
        params=(Param("stages_per_rank", positive_int, None),), positional=("stages_per_rank",),
        summary="virtual stages per pipeline rank: 1 for GPipe and 1F1B, 2 (the default) or more for the "
                "looped schedules, exactly 2 for ZBVZeroBubble and DualPipeV"),
    "split": OptionSpec(
        params=(Param("split", enum(*SPLITS), None),), positional=("split",),
        summary="what the automatic split balances: `parameters` (the default) or `compute` (per-block FLOPs); "
                "the embedding and the head each weigh one block, as in torchtitan"),
}


def _err(code: str, message: str, span: Span, label: str, help_: tuple[str, ...], severity: str = "error",
         related: tuple = ()) -> Diagnostic:
    return Diagnostic(code=code, severity=severity, message=message, span=span, label=label, help=help_,
                      related=related)


def _options(stmt: st.PipelineStmt, diags: list[Diagnostic]) -> tuple[dict, dict[str, Span]]:
    assigned = bind_block(stmt.block, PIPELINE_OPTIONS, "pipeline",
                          "pipeline Interleaved1F1B { microbatches 8, stages_per_rank = 2 }", diags)
    return {a.key: a.value for a in assigned}, {a.key: a.span for a in assigned}


def resolve_pipeline(stmts: tuple, file: str, mesh: Mesh, graph: ModelGraph | None,
                     diags: list[Diagnostic]) -> Pipeline | None:
    """The plan's pipeline (None without a `pipeline` line), its stages cut when the model is known.

    Diagnoses: options (P101, P103, P207), the schedule name (P460), stages per rank (P461),
    `pipeline`/`stage` lines without a pipeline axis and the reverse (P462), a `*` pipeline
    size (P464), stage numbering (P470), an automatic split that cannot be made (P477)
    and `split` beside `stage` lines (P478, warning).
    """
    lines = [s for s in stmts if isinstance(s, st.PipelineStmt)]
    stage_lines = [s for s in stmts if isinstance(s, st.StageStmt)]
    axis = mesh.axis(Role.PIPELINE)
    if not lines:
        if axis is not None:
            diags.append(_err("P462", f"the mesh has a pipeline axis (`{axis}`) but the plan has no `pipeline` line",
                              mesh.span or Span.point(file), "no schedule for this axis",
                              ("name torch's schedule and the microbatches: `pipeline 1F1B { microbatches 8 }`"
                               + (" (the `stage` lines need it too)" if stage_lines else ""),)))
        elif stage_lines:
            diags.append(_err("P462", "`stage` lines without a pipeline", stage_lines[0].span, "no pipeline",
                              ("add a pipeline axis to the mesh and a schedule: `mesh (pipeline = 2, shard = *)` and "
                               "`pipeline 1F1B { microbatches 8 }`, or remove the `stage` lines",)))
        return None
    for stale in lines[:-1]:
        diags += replaced(stale, lines[-1], "pipeline", file)
    stmt = lines[-1]
    values, spans = _options(stmt, diags)
    name = stmt.schedule.value
    if name not in SCHEDULES:
        fixed = next((s for s in SCHEDULES if s.lower() == name.lower().removeprefix("schedule")), None)
        diags.append(_err("P460", f"`{name}` is not one of torch's pipeline schedules", stmt.schedule.span,
                          "unknown schedule", ((f"did you mean `{fixed}`?",) if fixed else suggestion(name, SCHEDULES))
                          + ("torch's schedules: " + ", ".join(f"`{s}`" for s in SCHEDULES),)))
        return None
    spr = values.get("stages_per_rank", default_stages_per_rank(name))
    problem = stages_per_rank_problem(name, spr)
    if problem is not None:
        diags.append(_err("P461", problem, spans.get("stages_per_rank", stmt.schedule.span),
                          "stages per rank", (f"write `stages_per_rank = {default_stages_per_rank(name)}`"
                                              + (" (a V: stages r and 2 x pipeline - 1 - r on rank r)"
                                                 if name in V_SCHEDULES else "")
                                              + ", or pick a schedule for that many stages per rank",)))
        return None
    if axis is None:
        diags.append(_err("P462", f"`pipeline {name}` without a pipeline axis on the mesh", stmt.span,
                          "no pipeline axis", ("add it as the outermost axis: `mesh (pipeline = 2, shard = *)`",)))
        return None
    if axis.size is None:
        diags.append(_err("P464", f"the pipeline axis (`{axis}`) has no fixed size", mesh.span or stmt.span,
                          "the stages are cut for a known number of ranks",
                          (f"fix it, e.g. `{axis.name} = 4`, and let a data-parallel axis take the rest (`shard = *`)",)))
        return None
    split = values.get("split", "parameters")
    if stage_lines and "split" in values:
        diags.append(_err("P478", "`split` has no effect: the `stage` lines cut the model", spans["split"],
                          "no automatic split", ("remove `split`, or the `stage` lines to cut automatically",),
                          "warning"))
    base = dict(schedule=name, pp=axis.size, microbatches=values.get("microbatches"), stages_per_rank=spr,
                span=stmt.span, options=tuple(spans.items()))
    count = axis.size * spr
    if graph is None:
        return Pipeline(split="explicit" if stage_lines else split, stages=(), stage_spans=(), **base)
    if stage_lines:
        stages = _explicit(stage_lines, count, graph, diags)
        return Pipeline(split="explicit", stages=tuple(s for s, _ in stages),
                        stage_spans=tuple(sp for _, sp in stages), **base)
    try:
        cut = auto_split(graph, count)
    except SplitError as exc:
        diags.append(_err("P477", f"the model cannot be cut into {count} stages: {exc}", stmt.span,
                          f"{axis.size} ranks x {spr} stages per rank",
                          ("use fewer pipeline ranks or stages per rank, or write the stages, one `stage N:` "
                           "line each (`stage 0: tok_embeddings, layers[0:4]`)",)))
        return Pipeline(split=split, stages=(), stage_spans=(), **base)
    return Pipeline(split=split, stages=tuple(cut), stage_spans=(stmt.span,) * count, **base)


def _explicit(lines: list[st.StageStmt], count: int, graph: ModelGraph,
              diags: list[Diagnostic]) -> list[tuple[tuple[str, ...], Span]]:
    """The stages of `stage` lines (stage index -> modules, line); P470 unless they number 0..count-1
    once each; a selector that matches nothing is the selectors' own P201."""
    by_index: dict[int, st.StageStmt] = {}
    for line in lines:
        if line.index in by_index:
            diags.append(_err("P470", f"stage {line.index} is written twice", line.index_span, "again",
                              ("give each stage one `stage` line; list all its modules there",),
                              related=((by_index[line.index].span, "first here"),)))
            continue
        by_index[line.index] = line
    wrong = sorted(set(by_index) - set(range(count)))
    missing = sorted(set(range(count)) - set(by_index))
    if wrong or missing:
        where = by_index[wrong[0]].index_span if wrong else lines[-1].span
        what = ((f"stage {wrong[0]} is past the last stage" if wrong[0] >= count else
                 f"stage {wrong[0]} is not a stage number") if wrong else
                "stage" + "s" * (len(missing) > 1) + " " + ", ".join(map(str, missing[:6])) + " missing")
        diags.append(_err("P470", f"the pipeline has {count} stages (0 to {count - 1}): {what}", where,
                          f"{count} stages", ("write one `stage N:` line for each N from 0 to "
                                              f"{count - 1} (pipeline ranks x stages per rank)",)))
    out = []
    for index in sorted(i for i in by_index if i < count):
        line = by_index[index]
        mods: list[str] = []
        for sel in line.selectors:
            found = match_modules(graph, sel)
            diags.extend(found.diagnostics)
            mods += [p for p in found.paths if p not in mods]
        top = tuple(sorted((m for m in mods if not any(m.startswith(o + ".") for o in mods)), key=graph.pre))
        out.append((top, line.span))
    return out
