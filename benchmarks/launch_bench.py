"""Benchmark: what one `planc.analysis.launch` costs before the ranks do any work.

In a fresh process: `launch` of a one-element all-reduce on 2 and on 4 gloo ranks, three times each,
wall time per launch. The first launch of a process starts the fork server (it imports torch and
planc once); the later ones fork ready ranks from it. Every multi-process test and `planc check
--verify` pays this per launch. Prints one line per launch, then one JSON line.

    python benchmarks/launch_bench.py
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from planc.analysis.launch import launch


def _all_reduce(rank: int, world: int) -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def main() -> int:
    rows = []
    for world in (2, 4, 2, 4, 2, 4):
        t0 = time.perf_counter()
        assert launch(_all_reduce, world, timeout=600) == [float(world)] * world
        rows.append({"world": world, "wall_s": round(time.perf_counter() - t0, 2)})
        print(f"launch on {world} ranks: {rows[-1]['wall_s']} s (load {os.getloadavg()[0]:.1f})", flush=True)
    later = [r["wall_s"] for r in rows[2:]]
    print(json.dumps({"first_launch_s": rows[0]["wall_s"], "later_launch_max_s": max(later), "launches": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
