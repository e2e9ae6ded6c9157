"""The pipeline's stages as people read them: rank, modules, parameters, units (explain and hover).

One row per stage of the lowered job (`Job.parts`): the pipeline rank that holds it (the
schedule's placement, loop or V), its modules as the `stage` lines or the automatic split
named them (runs of blocks shortened to `layers[0:4]`), its parameter count and its FSDP
units. `planc explain` prints the table for a pipeline plan (before the estimates per pipeline
rank, planc/analysis/role_report.py) and the language server's hover on a `pipeline` or `stage`
line shows the same rows (with each rank's estimated peak when an `expect` line gives an input).
"""

from __future__ import annotations

import re
from typing import Any

from planc.quantities import show_count
from planc.resolve.pipeline import SINGLE_STAGE


def _runs(modules: tuple[str, ...]) -> list[str]:
    """`layers.0, layers.1, layers.2` -> `layers[0:3]`: consecutive children of one container joined."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None  # container, first, last index
    for m in modules + ("",):
        found = re.fullmatch(r"(.*)\.(\d+)", m)
        if run is not None and found and found.group(1) == run[0] and int(found.group(2)) == run[2] + 1:
            run = (run[0], run[1], run[2] + 1)
            continue
        if run is not None:
            out.append(f"{run[0]}.{run[1]}" if run[1] == run[2] else f"{run[0]}[{run[1]}:{run[2] + 1}]")
            run = None
        if found:
            run = (found.group(1), int(found.group(2)), int(found.group(2)))
        elif m:
            out.append(m)
    return out


def stage_rows(compiled) -> list[dict[str, Any]]:
    """One row per stage of a pipeline plan without errors (empty without a pipeline)."""
    pp = compiled.resolution.pipeline
    if pp is None or not pp.stages:
        return []
    job = compiled.job
    g = compiled.graph
    rank_of = {s: r for r, held in enumerate(job.schedule.stages) for s in held}
    rows = []
    for part in job.parts:
        params = set().union(*(g.subtree_params(m) for m in part.modules)) if part.modules else set()
        rows.append({
            "stage": part.stage, "pipeline_rank": rank_of.get(part.stage), "modules": _runs(part.modules),
            "params": sum(g.params[p].numel for p in params),
            "units": [u.name for u in part.program.units if not u.is_root],
        })
    return rows


def pipeline_summary(compiled) -> dict[str, Any]:
    """The schedule, its microbatches and placement, and the stage rows, JSON-ready."""
    pp = compiled.resolution.pipeline
    placement = "one stage per rank" if pp.schedule in SINGLE_STAGE else (
        "V" if pp.schedule in ("ZBVZeroBubble", "DualPipeV") else "loop")
    return {"schedule": pp.schedule, "pipeline": pp.pp, "microbatches": pp.microbatch_count,
            "stages_per_rank": pp.stages_per_rank, "placement": placement, "split": pp.split,
            "line": f"{pp.span.file}:{pp.span.line}", "stages": stage_rows(compiled)}




def render_stages(summary: dict[str, Any]) -> str:
    """The table `planc explain` prints for a pipeline plan."""
    placed = "" if summary["stages_per_rank"] == 1 else f" ({summary['placement']} placement)"
    head = (f"pipeline {summary['schedule']}: {summary['pipeline']} ranks x {summary['stages_per_rank']} "
            f"stage{'s' * (summary['stages_per_rank'] != 1)} per rank{placed}, "
            f"{summary['microbatches']} microbatches, split {summary['split']} ({summary['line']})")
    rows = [("stage", "rank", "params", "units", "modules")]
    for r in summary["stages"]:
        rows.append((str(r["stage"]), str(r["pipeline_rank"]), show_count(r["params"]), str(len(r["units"])),
                     ", ".join(r["modules"])))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [head, ""]
    for row in rows:
        lines.append("  ".join(c.rjust(w) if i in (0, 1, 2, 3) else c for i, (c, w) in
                               enumerate(zip(row, widths + [0]))).rstrip())
    return "\n".join(lines)
