"""`planc explain` of a pipeline job's estimates: per stage its rank's peak and busy/idle time; the binding rank.

A pipeline job (several parts, `planc/lower/job.py`) is explained per pipeline rank: each
stage's modules and parameter count, its state per rank, the peak of the rank that holds it
(`Estimate.roles`, planc/estimate/role_memory.py) and, with a step-time estimate, the rank's
busy and idle time on the simulated timeline (planc/estimate/roles.py). The binding rank is
the one with the largest peak: `expect memory.peak` is checked against it, so it holds for
every rank. Its memory breakdown follows, as `explain` prints a one-part plan's.
"""

from __future__ import annotations

from typing import Any

from planc.analysis.stages import _runs
from planc.estimate.memory import CATEGORIES, Estimate
from planc.lower.pipeline import inside


def report(compiled, est: Estimate, model_ref: str | None = None, step_time=None) -> dict[str, Any]:
    """The pipeline section of `explain`, as JSON-ready data (bytes per rank)."""
    from planc.analysis.explain import time_report

    job = compiled.job
    sched = job.schedule
    roles = est.roles
    binding = est.binding()
    timeline = step_time.pipeline.timeline if step_time is not None and step_time.pipeline is not None else None
    stages = []
    for part in job.parts:
        rank = next(r for r, held in enumerate(sched.stages) if part.stage in held)
        role = roles[rank]
        params = sum(info.numel for name, info in compiled.graph.params.items()
                     if inside(name.rpartition(".")[0], part.modules))
        row = {"stage": part.stage, "rank": rank, "modules": list(part.modules), "params": params,
               "units": [u.name for u in part.program.units],
               "sharded_state_bytes": role.sharded_state, "peak_bytes": role.peak.total, "moment": role.peak.label}
        if timeline is not None:
            rt = timeline.ranks[rank]
            row |= {"busy_s": rt.busy_s, "idle_s": timeline.idle_s(rank), "bubble": timeline.bubble(rank)}
        stages.append(row)
    peak = est.peak
    out: dict[str, Any] = {
        "plan": compiled.plan.file, "model": model_ref or compiled.plan.model_ref, "world_size": est.world,
        "optimizer": est.optimizer, "input_shape": list(est.input_shape) if est.input_shape else None,
        "pipeline": {"schedule": sched.name, "microbatches": sched.microbatches, "ranks": len(sched.stages),
                     "binding_rank": binding, "stages": stages},
        "memory": {"peak_bytes": peak.total, "moment": peak.label, "phase": peak.phase,
                   "breakdown": {k: v for k, v in peak.bytes.items() if v}, "activations_from": est.source,
                   "notes": est.notes},
    }
    if step_time is not None:
        out["time"] = time_report(step_time)
        if timeline is not None:
            pt = step_time.pipeline
            out["pipeline"] |= {"step_s": pt.step_s, "bubble": pt.bubble, "slowest_rank": timeline.binding_rank,
                                "tokens_per_s": pt.tokens_per_s, "mfu": pt.mfu}
    return out


def render_text(data: dict[str, Any], color: bool = False) -> str:
    """The pipeline section as text."""
    from planc.analysis.explain import LABELS, _Style, _table, seconds
    from planc.quantities import show_bytes, show_count

    style = _Style(color)
    pp = data["pipeline"]
    out = [style.bold(f"plan {data['plan']}") + f"  model {data['model'] or '(given)'}  world {data['world_size']}  "
           f"pipeline {pp['ranks']} ranks, {pp['schedule']}, {pp['microbatches']} microbatches  "
           f"optimizer {data['optimizer']}", ""]
    timed = "busy_s" in pp["stages"][0]
    rows = []
    for s in pp["stages"]:
        row = [str(s["stage"]), str(s["rank"]), ", ".join(_runs(tuple(s["modules"]))), show_count(s["params"]),
               show_bytes(s["sharded_state_bytes"]), show_bytes(s["peak_bytes"])]
        if timed:
            row += [seconds(s["busy_s"]), f"{s['bubble']:.1%}"]
        rows.append(row)
    header = ["stage", "rank", "modules", "params", "state/rank", "peak/rank"] + (["busy", "idle"] if timed else [])
    out += _table(rows, header, style)
    mem = data["memory"]
    out += ["", style.bold(f"binding rank {pp['binding_rank']}: peak {show_bytes(mem['peak_bytes'])}") +
            f" at {mem['moment']} (the largest peak of the pipeline ranks)"]
    for key in CATEGORIES:
        v = mem["breakdown"].get(key)
        if v:
            out.append(f"  {LABELS[key]:<22} {show_bytes(v):>12}")
    out.append(style.dim(f"  activations from: {mem['activations_from']}"))
    for note in mem["notes"]:
        out.append(style.dim(f"  note: {note}"))
    if "step_s" in pp:
        extra = "" if pp["tokens_per_s"] is None else \
            f", {pp['tokens_per_s']:.4g} tokens/s, MFU {pp['mfu']:.1%}"
        out += ["", style.bold(f"step time, estimated: {seconds(pp['step_s'])}") +
                f" (slowest rank {pp['slowest_rank']}; bubble {pp['bubble']:.1%}{extra})"]
        for line in data["time"]["assumptions"]:
            out.append(style.dim(f"  assumes: {line}"))
    return "\n".join(out)
