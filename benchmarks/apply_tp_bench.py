"""Benchmark: `planc.apply` of a 2-D plan (FSDP x tensor parallel) over the same calls written by hand.

`apply_bench.py`'s measurement for a 2-D plan. The model is the Llama-3-405B-shaped decoder
of `benchmarks/_llama405b.py` (torchtitan's module names) built on the meta device, on 4 gloo
ranks with a 2 x 2 CPU mesh (`shard` x `tensor`). The plan is plans/zoo-llama-tp.plan as
shipped (torchtitan's Llama 3 TP plan with sequence and loss parallel, FSDP units per block,
`[norm, output]` and the root); the hand-written side is torchtitan's `apply_tp` + `apply_fsdp`
as tests/test_tp_zoo_dist.py writes them (`torchtitan_style`: one `parallelize_module` per
block, `fully_shard` per unit). Each repetition builds fresh models (not timed) and times both
sides in alternating order; the ratio is taken per repetition and the median reported
(target <= 1.05). As in apply_bench.py, each timing is wall clock and the CPU time of the
rank's main thread (sharding on meta is single-threaded CPU work with no communication: on a
shared machine the CPU-time ratio is the robust figure), a repetition is as slow as its
slowest rank, and `planc.apply` of a plan compiled beforehand (`precompiled_*`) shows the
part of the time that is not compiling.

Usage (from the repository root):

    python benchmarks/apply_tp_bench.py            # 126 layers, 15 repetitions, 4 gloo ranks
    python benchmarks/apply_tp_bench.py --quick    # 16 layers, 3 repetitions
    python benchmarks/apply_tp_bench.py --fake     # one process, a fake process group of 4 ranks

`--fake` runs rank 0's work alone (torch's fake process group, world size 4): sharding on meta
sends nothing, so the calls and their CPU work are the same, without three other ranks
competing for the cores (on 2 shared cores, 4 real ranks make even CPU-time figures noisy).

The last line printed is a JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "tests")]

import torch  # noqa: E402
from _llama405b import llama405b  # noqa: E402
from apply_bench import _fsdp_units, _timed  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import planc  # noqa: E402
from tests.distributed import run  # noqa: E402

PLAN_PATH = os.path.join(ROOT, "plans", "zoo-llama-tp.plan")
DP, TP = 2, 2


def _plan():
    with open(PLAN_PATH, encoding="utf-8") as f:
        text = f.read()
    return planc.loads(text.replace("\nmodel planc.zoo:llama\n", "\nmodel benchmarks._llama405b:llama405b\n"),
                       filename=PLAN_PATH)


def _build(n_layers: int) -> torch.nn.Module:
    with torch.device("meta"):
        return llama405b(n_layers)


def fake_run(n_layers: int, reps: int) -> list[dict]:
    """`bench_worker` as rank 0 of a fake 4-rank process group, in this process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=DP * TP)
    try:
        return [bench_worker(0, DP * TP, n_layers, reps)]
    finally:
        dist.destroy_process_group()


def bench_worker(rank: int, world_size: int, n_layers: int, reps: int) -> dict:
    """Per rank: `reps` interleaved timings of planc.apply and the hand-written calls."""
    from test_tp_zoo_dist import torchtitan_style

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("shard", "tensor"))
    plan = _plan()
    planc.apply(_build(2), plan, mesh=mesh)  # warm-up, not timed
    torchtitan_style(_build(2), mesh)

    planc_s, by_hand_s, compile_s, loop_s, units, placements = [], [], [], [], set(), {}
    for rep in range(reps):
        order = ("planc", "by_hand") if rep % 2 == 0 else ("by_hand", "planc")
        for side in order:
            model = _build(n_layers)
            if side == "planc":
                planc_s.append(_timed(lambda: planc.apply(model, plan, mesh=mesh)))
            else:
                by_hand_s.append(_timed(lambda: torchtitan_style(model, mesh)))
            units.add((side, _fsdp_units(model)))
            if rep == 0:  # both sides really build the same 2-D sharding
                placements[side] = {n: str(tuple(p.placements)) for n, p in model.named_parameters()}
        model = _build(n_layers)
        compiled = []
        compile_s.append(_timed(lambda: compiled.append(planc.compile(plan, model, world_size))))
        loop_s.append(_timed(lambda: planc.apply(model, compiled[0], mesh=mesh)))
        compiled.clear()
    return {"planc_s": planc_s, "by_hand_s": by_hand_s, "compile_s": compile_s, "loop_s": loop_s,
            "units": sorted(units), "same_placements": placements["planc"] == placements["by_hand"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 layers, 3 repetitions")
    parser.add_argument("--layers", type=int, default=None, help="blocks in the model (default 126)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 15)")
    parser.add_argument("--fake", action="store_true", help="one process, a fake process group of 4 ranks")
    args = parser.parse_args(argv)
    n_layers = args.layers or (16 if args.quick else 126)
    reps = args.reps or (3 if args.quick else 15)
    world = DP * TP

    wall = time.perf_counter()
    ranks = fake_run(n_layers, reps) if args.fake else run(bench_worker, world, n_layers, reps, timeout=3600)
    wall = time.perf_counter() - wall

    def slowest(key: str, kind: int) -> list[float]:
        return [max(r[key][k][kind] for r in ranks) for k in range(reps)]

    planc_s, by_hand_s = slowest("planc_s", 0), slowest("by_hand_s", 0)
    planc_cpu, by_hand_cpu, compile_cpu, loop_cpu = (slowest(k, 1) for k in ("planc_s", "by_hand_s", "compile_s", "loop_s"))
    ratios = [p / h for p, h in zip(planc_s, by_hand_s)]
    cpu_ratios = [p / h for p, h in zip(planc_cpu, by_hand_cpu)]
    for k in range(reps):
        print(f"rep {k}: wall: planc.apply {planc_s[k] * 1e3:7.1f} ms, by hand {by_hand_s[k] * 1e3:7.1f} ms, "
              f"ratio {ratios[k]:.3f} | CPU: {planc_cpu[k] * 1e3:7.1f} ms / {by_hand_cpu[k] * 1e3:7.1f} ms, "
              f"ratio {cpu_ratios[k]:.3f} | CPU: compile alone {compile_cpu[k] * 1e3:.1f} ms, "
              f"apply of the precompiled plan {loop_cpu[k] * 1e3:.1f} ms")
    result = {
        "benchmark": "apply_tp", "model": f"llama405b(n_layers={n_layers}) on meta",
        "plan": "plans/zoo-llama-tp.plan", "mesh": {"shard": DP, "tensor": TP}, "world_size": world,
        "backend": "fake (rank 0 of 4, one process)" if args.fake else "gloo", "reps": reps, "quick": args.quick,
        "modules": sum(1 for _ in _build(n_layers).modules()),
        "units": sorted({u for r in ranks for u in r["units"]}),
        "same_placements": all(r["same_placements"] for r in ranks),
        "planc_apply_ms_median": round(statistics.median(planc_s) * 1e3, 2),
        "hand_written_ms_median": round(statistics.median(by_hand_s) * 1e3, 2),
        "ratio_median": round(statistics.median(ratios), 4),
        "planc_apply_cpu_ms_median": round(statistics.median(planc_cpu) * 1e3, 2),
        "hand_written_cpu_ms_median": round(statistics.median(by_hand_cpu) * 1e3, 2),
        "compile_cpu_ms_median": round(statistics.median(compile_cpu) * 1e3, 2),
        "cpu_ratio_median": round(statistics.median(cpu_ratios), 4),
        "cpu_ratio_min": round(min(cpu_ratios), 4), "cpu_ratio_max": round(max(cpu_ratios), 4),
        "cpu_ratio_best": round(min(planc_cpu) / min(by_hand_cpu), 4),
        "precompiled_apply_cpu_ms_median": round(statistics.median(loop_cpu) * 1e3, 2),
        "precompiled_cpu_ratio_median": round(statistics.median([p / h for p, h in zip(loop_cpu, by_hand_cpu)]), 4),
        "target": "<= 1.05", "wall_s": round(wall, 1), "torch": torch.__version__,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
