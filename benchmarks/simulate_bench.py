"""Benchmark: `--simulate` of the brief's 24-layer transformer (plans/seed.plan) at 64 ranks.

One training step of rank 0 of 64 in a fake process group (fake tensors, FSDPMemTracker),
timed, next to the analytic estimate. The target: under a minute on a 2-core machine.
Prints progress, then one JSON line: the figures.

    python benchmarks/simulate_bench.py            # seed_transformer (1.41B), 64 ranks, 2 x 512
    python benchmarks/simulate_bench.py --quick    # seed_transformer_tiny, 2 x 16 (seconds)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, tiny input")
    p.add_argument("--world-size", type=int, default=64)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--plan", default=str(ROOT / "plans" / "seed.plan"))
    args = p.parse_args(argv)

    import planc
    from planc import zoo
    from planc.analysis.simulate import simulate, zoo_inputs
    from planc.estimate import memory

    builder = zoo.seed_transformer_tiny if args.quick else zoo.seed_transformer
    shape = (2, 16) if args.quick else (2, 512)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = builder()
    compiled = planc.compile(args.plan, model, args.world_size)
    est = memory.estimate(compiled, args.world_size, input_shape=shape)
    t_estimate = time.perf_counter() - t0
    print(f"estimate: {est.peak.total / 2**30:.3f} GiB at {est.peak.label} ({t_estimate:.1f} s)", file=sys.stderr)
    t1 = time.perf_counter()
    sim = simulate(compiled.plan, builder, args.world_size, rank=args.rank, inputs=zoo_inputs(shape))
    t_simulate = time.perf_counter() - t1
    print(f"simulate: {sim.peak / 2**30:.3f} GiB at {sim.moment} ({t_simulate:.1f} s)", file=sys.stderr)
    print(json.dumps({
        "benchmark": "simulate", "model": builder.__name__, "plan": pathlib.Path(args.plan).name,
        "world_size": args.world_size, "rank": args.rank, "input_shape": list(shape),
        "simulate_seconds": round(t_simulate, 2), "estimate_seconds": round(t_estimate, 2),
        "simulated_peak_bytes": sim.peak, "estimated_peak_bytes": est.peak.total,
        "estimate_over_simulated": round(est.peak.total / sim.peak, 4),
        "simulated_moment": sim.moment, "estimated_moment": est.peak.label,
        "under_a_minute": t_simulate < 60,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
