"""Benchmark: `planc.apply` time over the equivalent hand-written `fully_shard` loop.

The model is the Llama-3-405B-shaped decoder of `benchmarks/_llama405b.py`, built on the meta
device (sharding on meta allocates nothing), on 2 gloo ranks with a CPU mesh. Both sides get
the same mesh; each repetition builds two fresh models (building is not timed) and times
`planc.apply(model, plan, mesh=mesh)` and torchtitan's `apply_fsdp` written by hand, in
alternating order. The ratio is taken per repetition and the median reported (target <= 1.10).
The ratio of each side's best repetition (`*_best`) is reported too; it rests on one lucky
repetition a side, so on a shared machine it moves more between runs than the median does.

`planc.apply` also compiles the plan against the live model (parse, graph, resolve, validate)
and checks it (already sharded? contiguous?). To show where its time goes, each repetition also
times `planc.compile` alone (`compile_*`) and then `planc.apply` of that compiled plan
(`precompiled_*`): a plan compiled against the same, unchanged model is not compiled again,
so this is the cost of apply's checks plus the `fully_shard` calls.

Each timing is taken twice: wall clock, and the CPU time of the rank's main thread. Sharding
on meta is single-threaded CPU work with no communication, so on a shared machine the CPU-time
ratio (`cpu_ratio_median`) is the robust figure; wall-clock ratios swing with other load.

Usage (from the repository root):

    python benchmarks/apply_bench.py            # 126 layers, 15 repetitions
    python benchmarks/apply_bench.py --quick    # 16 layers, 3 repetitions
    python benchmarks/apply_bench.py --profile  # also cProfile one planc.apply on rank 0

The last line printed is a JSON object with the results.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _llama405b import TORCHTITAN_PLAN, llama405b  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

import planc  # noqa: E402
from tests.distributed import run  # noqa: E402
from tests.proof_workers import torchtitan_fsdp  # noqa: E402


def _build(n_layers: int) -> torch.nn.Module:
    with torch.device("meta"):
        return llama405b(n_layers)


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this thread) taken by `fn()`."""
    gc.collect()
    dist.barrier()  # both ranks start together: fully_shard may talk to the mesh's groups
    # NOTE: no automatic collection inside a timed region, on either side: when one falls
    # depends on allocations since the last, not on the code timed (planc pauses it while
    # compiling; the hand-written loop cannot), and each walks every object on the heap.
    gc.disable()
    try:
        wall, cpu = time.perf_counter(), time.thread_time()
        fn()
        return time.perf_counter() - wall, time.thread_time() - cpu
    finally:
        gc.enable()


def _fsdp_units(model: torch.nn.Module) -> int:
    return len({id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)})


def bench_worker(rank: int, world_size: int, n_layers: int, reps: int, profile: bool) -> dict:
    """Per rank: `reps` interleaved timings of planc.apply and the hand-written loop."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    plan = planc.loads(TORCHTITAN_PLAN, filename="llama405b.plan")

    # Warm-up (imports, first-call caches) on a small model, not timed.
    planc.apply(_build(2), plan, mesh=mesh)
    torchtitan_fsdp(_build(2), mesh, embedding="tok_embeddings", layers="layers")

    planc_s, by_hand_s, compile_s, loop_s, units = [], [], [], [], set()
    for rep in range(reps):
        order = ("planc", "by_hand") if rep % 2 == 0 else ("by_hand", "planc")
        for side in order:
            model = _build(n_layers)
            if side == "planc":
                planc_s.append(_timed(lambda: planc.apply(model, plan, mesh=mesh)))
            else:
                by_hand_s.append(_timed(lambda: torchtitan_fsdp(model, mesh, embedding="tok_embeddings",
                                                                 layers="layers")))
            units.add((side, _fsdp_units(model)))
            del model
        # Split planc.apply in two: compiling alone, then only the fully_shard calls with the
        # arguments planc computed (what apply does after its checks).
        model = _build(n_layers)
        compiled = []
        compile_s.append(_timed(lambda: compiled.append(planc.compile(plan, model, world_size))))
        loop_s.append(_timed(lambda: planc.apply(model, compiled[0], mesh=mesh)))
        units.add(("planc_precompiled", _fsdp_units(model)))
        compiled.clear()
        del model

    profile_text = None
    if profile and rank == 0:
        model = _build(n_layers)
        profiler = cProfile.Profile()
        profiler.enable()
        planc.apply(model, plan, mesh=mesh)
        profiler.disable()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).sort_stats("cumulative")
        stats.print_stats(25)
        stats.print_stats(r"planc[/\\]", 25)  # planc's own share of the time
        profile_text = out.getvalue()
    elif profile:
        planc.apply(_build(n_layers), plan, mesh=mesh)  # rank 1 keeps step with rank 0
    return {"planc_s": planc_s, "by_hand_s": by_hand_s, "compile_s": compile_s, "loop_s": loop_s,
            "units": sorted(units), "profile": profile_text}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 layers, 3 repetitions")
    parser.add_argument("--layers", type=int, default=None, help="blocks in the model (default 126)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 15)")
    parser.add_argument("--profile", action="store_true", help="cProfile one planc.apply on rank 0")
    args = parser.parse_args(argv)
    n_layers = args.layers or (16 if args.quick else 126)
    reps = args.reps or (3 if args.quick else 15)
    world = 2

    wall = time.perf_counter()
    ranks = run(bench_worker, world, n_layers, reps, args.profile, timeout=3600)
    wall = time.perf_counter() - wall

    # A repetition is as slow as its slower rank. Index 0: wall time, 1: CPU time.
    def slowest(key: str, kind: int) -> list[float]:
        return [max(r[key][k][kind] for r in ranks) for k in range(reps)]

    planc_s, by_hand_s, compile_s = slowest("planc_s", 0), slowest("by_hand_s", 0), slowest("compile_s", 0)
    planc_cpu, by_hand_cpu, compile_cpu = slowest("planc_s", 1), slowest("by_hand_s", 1), slowest("compile_s", 1)
    loop_cpu = slowest("loop_s", 1)
    ratios = [p / h for p, h in zip(planc_s, by_hand_s)]
    cpu_ratios = [p / h for p, h in zip(planc_cpu, by_hand_cpu)]
    modules = sum(1 for _ in _build(n_layers).modules())
    units = sorted({u for r in ranks for u in r["units"]})
    if ranks[0]["profile"]:
        print(ranks[0]["profile"])
    for k in range(reps):
        print(f"rep {k}: wall: planc.apply {planc_s[k] * 1e3:7.1f} ms, by hand {by_hand_s[k] * 1e3:7.1f} ms, "
              f"ratio {ratios[k]:.3f} | CPU: {planc_cpu[k] * 1e3:7.1f} ms / {by_hand_cpu[k] * 1e3:7.1f} ms, "
              f"ratio {cpu_ratios[k]:.3f} | CPU: compile alone {compile_cpu[k] * 1e3:.1f} ms, "
              f"apply of the precompiled plan {loop_cpu[k] * 1e3:.1f} ms")
    result = {
        "benchmark": "apply", "model": f"llama405b(n_layers={n_layers}) on meta", "modules": modules,
        "world_size": world, "backend": "gloo", "reps": reps, "quick": args.quick,
        "units": units,
        "planc_apply_ms_median": round(statistics.median(planc_s) * 1e3, 2),
        "hand_written_ms_median": round(statistics.median(by_hand_s) * 1e3, 2),
        "compile_ms_median": round(statistics.median(compile_s) * 1e3, 2),
        "ratio_median": round(statistics.median(ratios), 4),
        "ratio_min": round(min(ratios), 4), "ratio_max": round(max(ratios), 4),
        "planc_apply_cpu_ms_median": round(statistics.median(planc_cpu) * 1e3, 2),
        "hand_written_cpu_ms_median": round(statistics.median(by_hand_cpu) * 1e3, 2),
        "compile_cpu_ms_median": round(statistics.median(compile_cpu) * 1e3, 2),
        "cpu_ratio_median": round(statistics.median(cpu_ratios), 4),
        "cpu_ratio_min": round(min(cpu_ratios), 4), "cpu_ratio_max": round(max(cpu_ratios), 4),
        # each side's best repetition: the least disturbed by other load on the machine
        "cpu_ratio_best": round(min(planc_cpu) / min(by_hand_cpu), 4),
        "precompiled_cpu_ratio_best": round(min(loop_cpu) / min(by_hand_cpu), 4),
        # `planc.apply(model, planc.compile(plan, model, world))`: the compile is reused
        "precompiled_apply_cpu_ms_median": round(statistics.median(loop_cpu) * 1e3, 2),
        "precompiled_cpu_ratio_median": round(statistics.median(
            [p / h for p, h in zip(loop_cpu, by_hand_cpu)]), 4),
        # apply's own work besides fully_shard: compile plus its checks on the live model.
        "apply_overhead_cpu_ms_median": round(statistics.median(
            [p - h for p, h in zip(planc_cpu, by_hand_cpu)]) * 1e3, 2),
        "target": "<= 1.10", "wall_s": round(wall, 1),
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
