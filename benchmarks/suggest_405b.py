"""`planc suggest --pipeline` on the Llama 3.1 405B shape (`planc.zoo:llama3_405b`) at 512 ranks: a 3-D search.

Pipeline degrees 2, 4, 8, 16 x tensor degrees 1, 2, 4, 8 (the `parallel` rules of
plans/llama3-405b-pp.plan, torchtitan's) x FSDP over the rest, the schedules 1F1B,
Interleaved1F1B and ZBVZeroBubble (the default set), every microbatch count dividing the
data-parallel rank's batch and covering the stages, and no, selective or full checkpointing;
torchtitan's global batch (a local batch of 32 on 8 data-parallel ranks: 256 sequences of
8192 tokens), 80GiB per rank, h100. Degree 1 (no pipeline) is not searched: 256 sequences do
not divide among 512 ranks.

The whole `suggest_pipeline` call is timed, wall clock and CPU time (target: 30 s of CPU):
the profiles per tensor degree, the enumeration on the analytic model, and the winner's
verification by the full role estimators (what `planc explain` runs; `--no-verify` leaves it
out); loading the model graph is timed apart. torchtitan's recipe (FSDP 8 x TP 8 x PP 8,
Interleaved1F1B, 2 stages per rank, 32 microbatches, full checkpointing) is costed by the
same analytic model for comparison (`planc explain plans/llama3-405b-pp.plan --world-size 512
--input-shape 32x8192` gives the role estimators' figures for it).

    python benchmarks/suggest_405b.py [--no-verify] [--quick] [-o PLAN]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-verify", action="store_true", help="leave out the role estimators' verification of the winner")
    ap.add_argument("--quick", action="store_true", help="tensor degree 8 only")
    ap.add_argument("-o", "--output", help="write the suggested plan here")
    ap.add_argument("--tensor", default="1,2,4,8")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    wall0, cpu0 = time.perf_counter(), time.process_time()
    from planc.cli.common import ModelCache
    from planc.estimate.hardware import hardware
    from planc.suggest import pipeline as pp
    from planc.suggest.space import parallel_rules
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "plans", "llama3-405b-pp.plan"), encoding="utf-8") as f:
        rules, _ = parallel_rules(f.read(), "plans/llama3-405b-pp.plan")
    ref = "planc.zoo:llama3_405b"
    graph = ModelCache().graph(ref)
    load = time.perf_counter() - wall0, time.process_time() - cpu0
    world, seq, gb, budget = 512, 8192, 256, 80 * 2**30
    tensors = (8,) if args.quick else tuple(int(t) for t in args.tensor.split(","))
    verify = not args.no_verify
    wall, cpu = time.perf_counter(), time.process_time()
    result = pp.suggest_pipeline(graph, ref, world, budget, seq, gb, hardware="h100", budget_text="80GiB",
                                 parallel=rules, tensors=tensors, pipelines=(2, 4, 8, 16), verify=verify)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    s = result.stats
    recipe = pp.PipeChoice(8, 8, "Interleaved1F1B", 2, 32, "full", 32)
    model = pp.Model(pp.profile(graph, ref, world, seq, "adamw", 8, rules), graph, world, hardware("h100"), "adamw")
    r_peak, r_rank = model.peak(recipe)
    r_s, r_bubble = model.seconds(recipe)
    best = result.best
    out = {
        "benchmark": "suggest_405b", "model": ref, "world_size": world, "global_batch": gb, "sequence": seq,
        "budget": "80GiB", "hardware": "h100", "tensor_degrees": list(tensors), "pipeline_degrees": [2, 4, 8, 16],
        "schedules": list(pp.DEFAULT_SCHEDULES),
        "model_load_seconds": round(load[0], 2), "model_load_cpu_seconds": round(load[1], 2),
        "profile_seconds": round(s["profile_s"], 2), "profile_cpu_seconds": round(s["profile_cpu_s"], 2),
        "search_seconds": round(s["search_s"], 2), "search_cpu_seconds": round(s["search_cpu_s"], 2),
        "total_seconds": round(wall, 2), "total_cpu_seconds": round(cpu, 2),
        "choices_simulated": result.searched, "choices_pruned": result.pruned, "verified": verify,
        "choice": best.choice.describe() if best else None,
        "peak_bytes": best.peak if best else None, "step_seconds": round(best.seconds, 3) if best else None,
        "bubble": round(best.bubble, 4) if best else None,
        "alternatives": [f"{o.seconds:.3f} s, ~{o.peak / 2**30:.2f} GiB: {o.choice.describe()}" for o in result.alternatives],
        "recipe": recipe.describe(), "recipe_peak_bytes": r_peak, "recipe_binding_rank": r_rank,
        "recipe_step_seconds": round(r_s, 3), "recipe_bubble": round(r_bubble, 4),
        "notes": result.notes, "load_average": os.getloadavg()[0],
    }
    if args.output and result.text:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(result.text)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
