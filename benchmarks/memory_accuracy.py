"""Benchmark: planc's analytic per-rank peak against an independent measurement of the real step.

For each model and world size: `planc.estimate.memory.estimate` (the analytic replay of
FSDP2 over a fake-tensor trace) next to `planc.analysis.simulate` (the plan applied for real
by `planc.apply` in a fake process group, `FSDPMemTracker` measuring two steps of the
faithful training step: forward, cross-entropy over fp32 logits, backward,
`clip_grad_norm_`, the optimizer step; the second step reported). Target: the ratio
within 3% of 1.00 everywhere. Prints one line per case, then one JSON line.

    python benchmarks/memory_accuracy.py           # 8B-class models at 8 and 64 ranks (minutes)
    python benchmarks/memory_accuracy.py --quick   # tiny configs, 8 ranks (seconds)
    python benchmarks/memory_accuracy.py --tp      # 2-D (FSDP x TP) plans of two HF architectures, 4 ranks
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (label, plan, model reference for `build_model`, input shape, optimizer)
FULL = [
    ("Llama 3 8B (torchtitan)", "torchtitan_llama3.plan", "planc.model.torchtitan:llama3_8b", (8, 2048), "adamw_fused"),
    ("Llama 3 8B (Hugging Face)", "llama.plan", "hf:llama-3-8b", (8, 2048), "adamw"),
    ("Mixtral 8x7B-shaped MoE (HF)", "mixtral.plan", "hf:mixtral-8x7b", (2, 2048), "adamw"),
    ("GPT-2 (HF)", "gpt2.plan", "hf:gpt2", (8, 1024), "adamw"),
]
QUICK = [
    ("Llama 3 debug (torchtitan)", "torchtitan_llama3.plan", "planc.model.torchtitan:llama3_debugmodel", (2, 64),
     "adamw_fused"),
    ("Llama tiny (HF)", "llama.plan", "hf:llama-tiny", (2, 32), "adamw"),
    ("Mixtral tiny (HF)", "mixtral.plan", "hf:mixtral-tiny", (2, 32), "adamw"),
    ("GPT-2 tiny (HF)", "gpt2.plan", "hf:gpt2-tiny", (2, 32), "adamw"),
]
# 2-D plans (shard x tensor = 2 x 2) of Hugging Face architectures planc ships no plan for (issue 20's
# newcomer fixtures), each at a tiny and a larger input.
TP = [(f"{name} (HF, 2-D)", f"tests/fixtures/tp/{name}.plan", f"hf:{name}", shape, "adamw")
      for name in ("olmo2-tiny", "gpt-neox-tiny") for shape in ((2, 16), (4, 128))]


def one(label: str, plan: str, ref: str, shape: tuple[int, int], optimizer: str, world: int) -> dict:
    import planc
    from planc.analysis.simulate import simulate, zoo_inputs
    from planc.estimate import memory
    from planc.model.build import build_model

    build = lambda: build_model(ref, device="meta")  # noqa: E731
    text = (ROOT / (plan if "/" in plan else f"plans/{plan}")).read_text()
    t0 = time.perf_counter()
    model = build()
    compiled = planc.compile(planc.loads(text, filename=plan), model, world)
    est = memory.estimate(compiled, world, optimizer=optimizer, input_shape=shape)
    t1 = time.perf_counter()
    sim = simulate(compiled.plan, build, world, inputs=zoo_inputs(shape), optimizer=optimizer)
    t2 = time.perf_counter()
    row = {"model": label, "plan": plan, "world_size": world, "input_shape": list(shape), "optimizer": optimizer,
           "estimated_peak_bytes": est.peak.total, "measured_peak_bytes": sim.peak,
           "ratio": round(est.peak.total / sim.peak, 4), "lower_bound_bytes": est.lower_bound,
           "estimated_moment": est.peak.label, "measured_moment": sim.moment,
           "estimate_seconds": round(t1 - t0, 1), "measure_seconds": round(t2 - t1, 1)}
    print(f"{label:<30} N={world:<3} est {est.peak.total / 2**30:8.2f} GiB  measured {sim.peak / 2**30:8.2f} GiB  "
          f"ratio {row['ratio']:.4f}  ({row['estimate_seconds']} s + {row['measure_seconds']} s)",
          file=sys.stderr, flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny configs at 8 ranks")
    p.add_argument("--tp", action="store_true", help="2-D plans of Hugging Face models at 4 ranks")
    p.add_argument("--only", help="run only cases whose label contains this")
    args = p.parse_args(argv)
    cases = QUICK if args.quick else TP if args.tp else FULL
    worlds = (8,) if args.quick else (4,) if args.tp else (8, 64)
    rows, failed = [], []
    for label, plan, ref, shape, optimizer in cases:
        if args.only and args.only not in label:
            continue
        for world in worlds:
            try:
                rows.append(one(label, plan, ref, shape, optimizer, world))
            except Exception as err:  # a case that cannot run is reported, not hidden
                failed.append({"model": label, "world_size": world, "error": f"{type(err).__name__}: {err}"[:300]})
                print(f"{label:<30} N={world:<3} FAILED {failed[-1]['error']}", file=sys.stderr, flush=True)
    ratios = [r["ratio"] for r in rows]
    print(json.dumps({
        "benchmark": "memory_accuracy", "cases": rows, "failed": failed,
        "worst_ratio_error": round(max((abs(r - 1) for r in ratios), default=0.0), 4),
        "within_3_percent": bool(ratios) and all(abs(r - 1) <= 0.03 for r in ratios) and not failed,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
