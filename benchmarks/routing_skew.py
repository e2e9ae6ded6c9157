"""The memory and all-to-all estimate of a Qwen3-MoE-shaped plan under balanced routing and under a
2x-skewed routing histogram (one expert rank of 8 receives twice the mean rows in every layer).

    python benchmarks/routing_skew.py [--world-size 16] [--input-shape 1x4096]

The histogram is synthetic (written here, one dense rank: every rank routes alike): experts 0-15
(expert rank 0's) take 2/8 of each rank's rows, the other 112 share the rest. The estimate scales
it to each rank's rows and traces expert rank 0 (planc/estimate/routing.py).
"""

from __future__ import annotations

import argparse
import pathlib
import time

import torch

import planc
from planc.estimate import memory
from planc.estimate import time as step_time
from planc.estimate.routing import Layer, Routing
from planc.model.build import build_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLAN = ROOT / "plans" / "qwen3-moe-ep-tp.plan"


def skewed(model, rows: int = 32768, hot: int = 16, experts: int = 128) -> Routing:
    counts = tuple([2 * rows // 8 // hot] * hot + [6 * rows // 8 // (experts - hot)] * (experts - hot))
    names = [p.rpartition(".")[0] for p, _ in model.named_parameters() if p.endswith("experts.w1")]
    return Routing(tuple(Layer(n, (counts,)) for n in names), (1, rows // 8), 1, "synthetic 2x skew")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=16)
    ap.add_argument("--input-shape", default="1x4096")
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.input_shape.split("x"))
    with torch.device("meta"):
        model = build_model("planc.zoo:moe_llama", device="meta")
    plan = planc.load(PLAN)
    for name, routing in (("balanced", None), ("2x skew", skewed(model))):
        start = time.perf_counter()
        compiled = planc.compile(plan, model, args.world_size, routing=routing)
        est = memory.estimate(compiled, args.world_size, input_shape=shape)
        step = step_time.estimate_step_time(compiled, world=args.world_size, input_shape=shape, hardware="h100")
        a2a = sum(c.bytes * c.times for u in step.per_unit for c in u.collectives if c.kind == "all_to_all")
        print(f"{name:9s} peak {est.peak.total / 2**30:7.2f} GiB at {est.peak.label}; activations "
              f"{est.peak.bytes.get('activations', 0) / 2**30:6.2f} GiB; all-to-all {a2a / 2**20:8.1f} MiB per rank "
              f"per step; step {step.total_s * 1e3:7.1f} ms ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
