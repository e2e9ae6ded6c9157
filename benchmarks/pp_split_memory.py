"""Memory per pipeline rank of the split-backward schedules: planc's estimate vs a live-bytes count of real runs.

The set-up of tests/test_roles_memory_dist.py (llama_tiny cut into 4 stages, 2 per rank, loop
or V placement, FSDP with no reshard after forward, 4 microbatches of 8 x 16, AdamW): one gloo
launch of 2 processes runs every schedule (tests/pp_memory_workers.py `looped_peaks`), each
rank's second step measured by `LiveBytes` (every schedule) and FSDPMemTracker (the schedules
it can run); planc's `estimate_pipeline_memory` per rank beside them.

Usage: `python benchmarks/pp_split_memory.py [--json out.json]` (run it under the gloo lock).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

LOOPED = ("Interleaved1F1B", "LoopedBFS")
SPLIT = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def main() -> None:
    from distributed import run
    from pp_memory_workers import looped_peaks
    from test_roles_memory_dist import BATCH, FOUR, MICRO, PLAN, SEQ

    import planc
    from planc.estimate.role_memory import estimate_pipeline_memory
    from planc.lower.pipeline import pipeline_job
    from planc.lower.schedules import schedule
    from planc.zoo import llama_tiny

    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    measured = run(looped_peaks, 2, LOOPED + SPLIT, MICRO, BATCH, SEQ, LOOPED)
    compiled = planc.compile(planc.loads(PLAN, filename="pp.plan"), llama_tiny(), 2)
    rows = []
    print("| schedule | rank | estimate | live bytes | FSDPMemTracker | estimate / live - 1 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in LOOPED + SPLIT:
        job = pipeline_job(compiled.job, FOUR, schedule(name, 2, MICRO, 2))
        for rank, est in enumerate(estimate_pipeline_memory(job, 2, graph=compiled.graph, input_shape=(BATCH, SEQ))):
            real = next(r[name] for r in measured if r[name]["rank"] == rank)
            live = real["live"]["peak"]
            row = {"schedule": name, "rank": rank, "estimate": est.peak.total, "live": live,
                   "tracker": real.get("peak"), "error": est.peak.total / live - 1}
            rows.append(row)
            tracker = f"{row['tracker']:,}" if row["tracker"] else "cannot run"
            print(f"| {name} | {rank} | {row['estimate']:,} | {live:,} | {tracker} | {row['error']:+.2%} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"benchmark": "pp_split_memory", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
