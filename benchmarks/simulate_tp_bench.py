"""Benchmark: compile + the shape-level simulation (`planc check --simulate`) of a 2-D plan for the
405B-shaped model at 512 ranks, tensor parallelism 8 (FSDP 64 x TP 8).

The plan is torchtitan's Llama 3 tensor-parallel recipe without sequence parallelism (q/k/v and
w1/w3 colwise, wo and w2 rowwise, the embedding rowwise, the output colwise with replicated
logits, the norms replicated on the tensor axis), with FSDP units per block. Timed: `planc.compile`
(parse, resolve, validate; graph building included) and `check_step` (the plan applied by
`planc.apply` on a fake 512-rank process group, one forward, backward, `clip_grad_norm_` and
foreach AdamW step on fake tensors, 2 x 16 tokens). Target: under 20 s on this 2-core machine.
Wall clock and this process's CPU time are both reported: on a shared machine the CPU time is
what the check costs, the wall clock what it took beside everything else running.
Prints progress, then one JSON line: the figures.

    python benchmarks/simulate_tp_bench.py            # 126 blocks, world 512, tp 8
    python benchmarks/simulate_tp_bench.py --quick    # 8 blocks
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._llama405b import llama405b  # noqa: E402

PLAN = """\
model benchmarks._llama405b:llama405b
mesh (shard = *, tensor = {tp})
defaults {{
  precision param = bf16, reduce = fp32, cast_inputs = false
}}
unit layers.*
root {{ reshard after_forward = false }}

parallel tok_embeddings rowwise {{ input replicate; output replicate }}
parallel layers.*.attention.{{wq, wk, wv}} colwise
parallel layers.*.attention.wo rowwise
parallel layers.*.feed_forward.{{w1, w3}} colwise
parallel layers.*.feed_forward.w2 rowwise
parallel layers.*.{{attention_norm, ffn_norm}} replicate
parallel norm replicate
parallel output colwise {{ output replicate }}
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 blocks instead of 126")
    p.add_argument("--world-size", type=int, default=512)
    p.add_argument("--tp", type=int, default=8)
    args = p.parse_args(argv)

    import planc
    from planc.analysis.shapecheck import check_step

    layers = 8 if args.quick else 126
    text = PLAN.format(tp=args.tp)

    def build():
        return llama405b(layers)

    t0, c0 = time.perf_counter(), time.process_time()
    with torch.device("meta"):
        model = build()
    compiled = planc.compile(planc.loads(text, filename="tp405b.plan"), model, args.world_size)
    errors = [d.code for d in compiled.errors]
    n_parallel = len(compiled.resolution.parallel)
    t_compile, c_compile = time.perf_counter() - t0, time.process_time() - c0
    print(f"compile (model built on meta included): {len(compiled.units)} units, {n_parallel} parallel modules, "
          f"errors {errors} ({t_compile:.1f} s)",
          file=sys.stderr)
    t1, c1 = time.perf_counter(), time.process_time()
    found = check_step(compiled.plan, build, args.world_size)
    t_simulate, c_simulate = time.perf_counter() - t1, time.process_time() - c1
    print(f"simulate: {[d.code for d in found] or 'clean'} ({t_simulate:.1f} s)", file=sys.stderr)
    for d in found:
        print(f"  {d.code}: {d.message}", file=sys.stderr)
    total, cpu = t_compile + t_simulate, c_compile + c_simulate
    import os
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(json.dumps({
        "benchmark": "simulate_tp", "model": f"llama405b({layers})", "world_size": args.world_size, "tp": args.tp,
        "units": len(compiled.units), "parallel_modules": n_parallel, "compile_errors": errors,
        "simulation_diagnostics": [d.code for d in found],
        "compile_seconds": round(t_compile, 2), "simulate_seconds": round(t_simulate, 2),
        "total_seconds": round(total, 2), "compile_cpu_seconds": round(c_compile, 2),
        "simulate_cpu_seconds": round(c_simulate, 2), "total_cpu_seconds": round(cpu, 2),
        "under_20_s_cpu": cpu < 20, "under_20_s_wall": total < 20, "load_average": load,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
