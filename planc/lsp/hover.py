"""Hover text for the node under the cursor: what a selector matches and the unit it makes,
what an option means, what a memory `expect` currently estimates, what a diagnostic's code means.

Everything is computed by the compiler (`match_modules`, the resolution's settings with their
provenance, `CompiledPlan.memory_at`); this module only chooses what to show, as Markdown.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from planc.analysis.explain import SHOWN_SETTINGS
from planc.analysis.explain import _setting as setting_data
from planc.checks.validate import METRICS
from planc.diagnostics import CODES, Span
from planc.lang import syntax as st
from planc.lsp.analysis import Analysis
from planc.lsp.locate import chain_at
from planc.lsp.positions import contains
from planc.quantities import show_bytes, show_count
from planc.resolve.context import CONTEXT_STYLE
from planc.resolve.experts import EXPERT_STYLE
from planc.resolve.mesh import Role
from planc.resolve.options import DTYPES, OPTIONS, Param
from planc.resolve.pipeline import PIPELINE_OPTIONS
from planc.resolve.selectors import match_modules, match_params
from planc.resolve.step import STEP_OPTIONS
from planc.resolve.styles import STYLES

SHOW_PATHS = 5   # matched module paths listed before "... and N more"
SHOW_UNITS = 3

# Statements whose selectors name modules (the others, ignore and place, name parameters).
_MODULE_STMTS = (st.UnitStmt, st.CheckpointStmt, st.CompileStmt, st.ExpectUnit)

METRIC_MEANING = {
    "units": "the number of FSDP units (fully_shard calls), the root included",
    "memory.peak": "peak device bytes per rank over one training step",
    "memory.sharded": "parameters, gradients and optimizer state held on the device per rank",
    "memory.unsharded_peak": "the most parameter bytes all-gathered at one moment",
    "memory.activations": "peak activation and temporary bytes (needs `input = BxS`)",
}


def hover(analysis: Analysis, line: int, column: int) -> tuple[str, Span | None] | None:
    """Markdown for planc position (line, column), with the span it describes; None: nothing here."""
    parts: list[str] = []
    span: Span | None = None
    chain = chain_at(analysis.plan, analysis.filename, line, column) if analysis.plan else []
    if chain:
        text, span = _node_hover(analysis, chain, line, column)
        if text:
            parts.append(text)
    parts += _diagnostic_hover(analysis, line, column)
    return ("\n\n---\n\n".join(parts), span) if parts else None


def _diagnostic_hover(analysis: Analysis, line: int, column: int) -> list[str]:
    """The explanation of each code diagnosed here: what `planc codes PXXX` prints."""
    out, seen = [], set()
    for d in analysis.diagnostics:
        if d.span and d.span.file == analysis.filename and contains(d.span, line, column) and d.code not in seen:
            seen.add(d.code)
            c = CODES[d.code]
            out.append(f"**{d.code}** ({c.severity}): {c.title}\n\n{c.explanation}\n\n"
                       f"(`planc codes {d.code}`)")
    return out


def _node_hover(analysis: Analysis, chain: list[Any], line: int, column: int) -> tuple[str | None, Span | None]:
    stmt = chain[0]
    for node in reversed(chain):
        if isinstance(node, st.Option):
            return _option_hover(node, line, column)
        if isinstance(node, st.Selector):
            params = isinstance(stmt, (st.IgnoreStmt, st.PlaceStmt)) and node is getattr(stmt, "selector", None)
            return _selector_hover(analysis, node, params), node.span
    if isinstance(stmt, st.ParallelStmt) and contains(stmt.style.span, line, column):
        return _style_hover(analysis, stmt.style.value), stmt.style.span
    if isinstance(stmt, st.ExpectMetric):
        return _expect_hover(analysis, stmt), stmt.span
    if isinstance(stmt, st.ModelStmt):
        return _model_hover(analysis, stmt), stmt.span
    if isinstance(stmt, st.IncludeStmt):
        target = os.path.normpath(os.path.join(analysis.folder, stmt.path))
        there = "" if os.path.isfile(target) else " (not found)"
        return f"includes `{target}`{there}: its statements stand here, and later lines override them", stmt.span
    if isinstance(stmt, st.MeshStmt) and analysis.compiled is not None:
        return f"mesh `{_safe(lambda: str(analysis.compiled.mesh))}`", stmt.span
    if isinstance(stmt, st.StepStmt):
        return _step_hover(analysis), stmt.span
    if isinstance(stmt, (st.PipelineStmt, st.StageStmt)):
        return _pipeline_hover(analysis, stmt), stmt.span
    return None, None


def _pipeline_hover(analysis: Analysis, stmt) -> str:
    """The pipeline as resolved: the schedule and each stage's rank, modules, parameters and units
    (on a `stage` line, that stage's), and the peak of the rank holding each stage when an `expect
    memory...` line gives an input (`_stage_peaks`)."""
    from planc.analysis.stages import pipeline_summary
    compiled = analysis.compiled
    if compiled is None or compiled.graph is None or compiled.resolution.pipeline is None:
        return "**pipeline**: torch's schedule by name, e.g. `pipeline 1F1B { microbatches 8 }`"
    if any(d.is_error for d in analysis.diagnostics):
        return "**pipeline**: the plan has errors: fix them to see the stages"
    summary = _safe(lambda: pipeline_summary(compiled), None)
    if summary is None:
        return "**pipeline**: the stages could not be cut"
    rows = summary["stages"]
    if isinstance(stmt, st.StageStmt):
        rows = [r for r in rows if r["stage"] == stmt.index]
    head = (f"**pipeline {summary['schedule']}**: {summary['pipeline']} ranks x {summary['stages_per_rank']} "
            f"stages per rank ({summary['placement']}), {summary['microbatches']} microbatches")
    peaks, note = _stage_peaks(analysis)
    peak_head, peak_rule = ("| peak/rank ", "|---") if peaks else ("", "")
    lines = [head, "", f"| stage | rank | parameters | units {peak_head}| modules |", f"|---|---|---|---{peak_rule}|---|"]
    lines += [f"| {r['stage']} | {r['pipeline_rank']} | {show_count(r['params'])} | {len(r['units'])} | "
              + (f"{show_bytes(peaks[r['pipeline_rank']])} | " if peaks else "") + f"{', '.join(r['modules'])} |" for r in rows]
    return "\n".join(lines + ["", note])


def _stage_peaks(analysis: Analysis) -> tuple[list[int], str]:
    """Each pipeline rank's estimated peak (`CompiledPlan.memory_at`, the estimate the plan's `expect`
    lines are checked with) at the world and input of the first `expect memory...` line with an
    input, and a line saying so; no peaks (and what to write) without such a line."""
    plan, compiled = analysis.plan, analysis.compiled
    line = next((s for s in plan.statements if isinstance(s, st.ExpectMetric) and s.metric.startswith("memory.")
                 and s.input_shape is not None), None) if plan is not None else None
    if line is None:
        return [], ("memory per stage: write `expect memory.peak <= ... at world = N, input = BxS` to see each "
                    "rank's estimated peak")
    world = line.world or compiled.world_size
    if world is None:
        return [], "memory per stage: no world size: write `at world = N` on the `expect` line"
    from planc.estimate.trace import TraceError
    from planc.lower.job import UnknownKind
    try:
        est = compiled.memory_at(world, line.input_shape)
    except TraceError as err:  # a model that does not run on the input, a stage with no unit (RoleError)
        return [], f"memory per stage: cannot estimate: {err}"
    except UnknownKind as err:  # what the memory per pipeline rank does not model (context, experts)
        return [], f"memory per stage: not estimated: no rule for `{type(err.what).__name__}`"
    r = est.binding()
    shape = "x".join(map(str, line.input_shape))
    return [role.peak.total for role in est.roles], (
        f"peak per rank at world {world}, input {shape} (line {line.span.line}); binding rank {r}: "
        f"{show_bytes(est.roles[r].peak.total)} at {est.roles[r].peak.label}")


def _step_hover(analysis: Analysis) -> str:
    """What one optimizer step runs, as the plan resolved it (the last `step` line counts)."""
    res = getattr(analysis.compiled, "resolution", None) if analysis.compiled is not None else None
    step = getattr(res, "step", None)
    what = step.value.show() if step is not None else "one microbatch per step"
    return (f"**step**: {what}\n\nthe input (`input = BxS`, `--input-shape`) is the step's batch; train with "
            "`for mb in applied.accumulate(tokens, labels): ...`")


def _safe(f, default: str = "?"):
    try:
        return f()
    except Exception:  # a half-typed plan may not resolve; hover shows what it can
        return default


# ===================================================================== options


def values_of(param: Param) -> list[str]:
    """The words a parameter accepts, for hover and completion."""
    from planc.resolve import options as o
    if param.convert is o.dtype:
        return list(DTYPES)
    if param.convert is o.boolean:
        return ["true", "false"]
    if param.convert is o.reshard:
        return ["true", "false", "8"]
    if param.convert is o.prefetch:
        return ["1", "2", "none", "[]"]
    return list(getattr(param.convert, "words", ()))


def _option_hover(opt: st.Option, line: int, column: int) -> tuple[str | None, Span | None]:
    spec = OPTIONS.get(opt.name) or STEP_OPTIONS.get(opt.name) or PIPELINE_OPTIONS.get(opt.name)
    if spec is None:
        return None, opt.name_span
    for arg in opt.args:
        if arg.key_span is not None and contains(arg.key_span, line, column):
            param = spec.param(arg.key)
            if param is None:
                return None, arg.key_span
            return (f"`{opt.name} {param.key} = ...`: accepts " + ", ".join(f"`{v}`" for v in values_of(param))
                    + (f"; sets `{param.setting}`" if param.setting else "")), arg.key_span
        if contains(arg.value.span, line, column) and isinstance(arg.value, st.Name) and arg.value.value in DTYPES:
            dt = DTYPES[arg.value.value]
            return f"`{arg.value.value}`: " + ("no cast (FSDP2's default)" if dt is None else f"`{dt}`"), arg.value.span
    keys = ", ".join(f"`{p.key}`" + (" (positional)" if p.key in spec.positional else "") for p in spec.params)
    text = f"**{opt.name}**: {spec.summary}\n\narguments: {keys}"
    if spec.fsdp1:
        text += f"\n\nFSDP1 spelling; in FSDP2 terms: `{spec.fsdp1}`"
    return text, opt.name_span


# ===================================================================== selectors


def _selector_hover(analysis: Analysis, sel: st.Selector, params: bool) -> str:
    graph = analysis.graph
    if graph is None:
        return f"`{sel}`: no model to match against (add a `model` line)"
    if params:
        m = match_params(graph, sel, optional=True)
        shown = "\n".join(f"- `{p}` {tuple(graph.params[graph.aliases.get(p, p)].shape)}"
                          if graph.aliases.get(p, p) in graph.params else f"- `{p}`" for p in m.paths[:SHOW_PATHS])
        more = f"\n- ... and {len(m.paths) - SHOW_PATHS} more" if len(m.paths) > SHOW_PATHS else ""
        return f"`{sel}` matches **{len(m.paths)}** parameter{'s' * (len(m.paths) != 1)}\n\n{shown}{more}"
    m = match_modules(graph, sel, optional=True)
    classes = Counter(graph.cls(p) for p in m.paths)
    head = f"`{sel}` matches **{len(m.paths)}** module{'s' * (len(m.paths) != 1)}"
    if classes:
        head += " (" + ", ".join(f"{n} x {c}" if n > 1 else c for c, n in classes.most_common()) + ")"
    lines = [f"- `{p or '<root>'}`  {graph.cls(p)}  {show_count(graph.subtree_numel[p])} params" for p in m.paths[:SHOW_PATHS]]
    if len(m.paths) > SHOW_PATHS:
        lines.append(f"- ... and {len(m.paths) - SHOW_PATHS} more")
    text = head + ("\n\n" + "\n".join(lines) if lines else "")
    units = _safe(lambda: _units_of(analysis, m.paths), None)
    if units:
        text += "\n\n" + units
    return text


def _units_of(analysis: Analysis, paths: list[str]) -> str | None:
    """The units the matched modules are in, and the first one's settings with provenance."""
    res, graph = analysis.compiled.resolution, analysis.graph
    units, own = [], []
    for p in paths:
        u = res.units[res.unit_of_module[p]] if p in res.unit_of_module else res.enclosing(p, graph)
        if u is not None and u not in units:
            units.append(u)
            own.append(p in res.unit_of_module)
    if not units:
        return None
    if len(units) == 1:
        head = f"becomes unit `{units[0].name}`" if own[0] else f"is managed by unit `{units[0].name}`"
    else:
        names = ", ".join(f"`{u.name}`" for u in units[:SHOW_UNITS])
        head = f"in {len(units)} units: {names}" + (", ..." if len(units) > SHOW_UNITS else "")
    u = units[0]
    # the unit's lowered policy, in the stage that holds it under a pipeline
    policy = _safe(lambda: next(p.program.unit(u.name) for p in analysis.compiled.job.parts
                                if any(x.name == u.name for x in p.program.units)).policy, None)
    rows = []
    for key in SHOWN_SETTINGS:
        if key in u.settings:  # the effective value (FSDP2's defaults applied), as `planc explain` shows it
            shown = setting_data(u, key, policy)["value"] if policy is not None else u.settings[key].show()
            origin = u.settings[key].origin.replace(analysis.folder + os.sep, "")
            rows.append(f"{key:<22} {shown:<10} {origin}")
    return f"{head}\n\nunit `{u.name}` ({show_count(sum(graph.params[c].numel for c in u.params))} params):\n```\n" \
           + "\n".join(rows) + "\n```"


# ===================================================================== styles


def _style_hover(analysis: Analysis, word: str) -> str | None:
    """What a `parallel` statement's style word does (`vocabulary.STYLES`)."""
    if word == CONTEXT_STYLE:
        axis = _safe(lambda: analysis.compiled.mesh.axis(Role.CONTEXT), None) if analysis.compiled else None
        where = f"the context axis (`{axis}`)" if axis is not None else "the context axis (the mesh has none yet)"
        return ("**context**: context parallelism. The module's causal `F.scaled_dot_product_attention` gathers "
                f"keys and values over {where} and masks by global positions; each batch is cut along the "
                "sequence, head-tail (`applied.shard_batch`). Fits attention whose `forward` takes `positions`.")
    if word == EXPERT_STYLE:
        axis = _safe(lambda: analysis.compiled.mesh.axis(Role.EXPERT), None) if analysis.compiled else None
        where = f"the expert axis (`{axis}`)" if axis is not None else "the expert axis (the mesh has none yet)"
        return ("**expert**: expert parallelism. Each rank of " + where + " keeps experts / expert whole experts; "
                "the rows routed to them travel there and back by all-to-all (uneven splits), the router stays "
                "replicated, and the experts are FSDP-sharded on their own mesh (shard x context x tensor / expert "
                "ranks). Fits an experts container with 3-D weights (`planc.zoo.routed.RoutedExperts`); its memory "
                "is not yet estimated.")
    return f"**{word}**: {STYLES[word].summary}" if word in STYLES else None


# ===================================================================== expect, model


def _expect_hover(analysis: Analysis, s: st.ExpectMetric) -> str:
    meaning = METRIC_MEANING.get(s.metric, "not a metric: " + ", ".join(METRICS))
    text = f"`{s.metric}`: {meaning}; bound `{s.op} {s.value}`"
    compiled = analysis.compiled
    if analysis.graph is None or compiled is None:
        return text + "\n\nno model: add a `model` line to estimate it"
    if any(d.is_error for d in analysis.diagnostics if d.code not in ("P501", "P502", "P504")):
        return text + "\n\nthe plan has errors: fix them to estimate it"
    if s.metric == "units":
        return text + f"\n\ncurrently **{len(compiled.units)}** units"
    if s.metric not in METRICS:
        return text
    world = s.world or compiled.world_size
    if world is None:
        return text + "\n\nno world size: write `at world = N` to estimate it"
    from planc.estimate.trace import TraceError
    from planc.lower.job import UnknownKind
    try:
        est = compiled.memory_at(world, s.input_shape)
    except TraceError as err:
        return text + f"\n\ncannot estimate: {err}"
    except UnknownKind as err:  # the estimators refuse what they do not model (expert parallelism)
        if type(err.what).__name__ == "DispatchExperts":
            return text + "\n\nnot estimated: expert parallelism is not yet estimated"
        return text + f"\n\nnot estimated: {err}"
    value = est.metric(s.metric)
    if value is None:
        return text + "\n\nnot estimated: " + "; ".join(est.notes or ["give `input = BxS`"])
    role = est.roles[est.binding(s.metric)] if est.roles else est
    where = f" at {role.peak.label}" if s.metric == "memory.peak" else ""
    if est.roles:  # a pipeline: the largest of its ranks'
        where = f" on pipeline rank {est.roles.index(role)} of {len(est.roles)}{where}"
    shape = "x".join(map(str, s.input_shape)) if s.input_shape else None
    return (text + f"\n\ncurrent estimate: **{show_bytes(value)}** per rank{where} (world {world}"
            + (f", input {shape}" if shape else ", activations not counted") + ")")


def _model_hover(analysis: Analysis, s: st.ModelStmt) -> str:
    g = analysis.graph
    if g is None or analysis.plan is None or analysis.plan.model_ref != s.ref:
        return f"model `{s.ref}`"
    return f"model `{s.ref}`: {g.cls('')}, {show_count(g.numel)} parameters, {len(g)} modules (built on meta)"
