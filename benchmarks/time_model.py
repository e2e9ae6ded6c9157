"""Step-time model vs published torchtitan throughput: estimate / published tokens per second per GPU.

Each case is a published torchtitan run (its repository's docs/performance.md and
benchmarks/llama3_h100_202412_torchtitan.md): a Llama 3 model, sharded as torchtitan's
`apply_fsdp` shards it (one unit per block, `[norm, lm_head]` kept gathered, bf16 params,
fp32 reduce), the local batch and sequence length it used, its activation checkpointing.
planc's model is torchtitan's own (`planc.model.torchtitan`, built on meta), traced once per
input on fake CPU tensors, then `estimate_step_time` on the named built-in hardware profile with
its default efficiency (0.6 of peak): nothing is fitted to any case. Prints a markdown table, then
one JSON line (for run_all.py).

    python benchmarks/time_model.py [--quick]
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from _llama405b import llama405b  # noqa: E402

import planc  # noqa: E402
from planc.estimate.flops import step_profile  # noqa: E402
from planc.estimate.time import estimate_step_time  # noqa: E402
from planc.model.torchtitan import llama3  # noqa: E402

PERF = "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"
H100 = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"

# (name, flavor, GPUs, hardware, local batch, seq, checkpoint, published TPS/GPU, source, note)
CASES = [
    ("Llama 3 8B, FSDP, 64 A100", "8B", 64, "a100", 1, 8192, "selective", 2973, PERF,
     "selective op AC; published MFU 58.2%"),
    ("Llama 3 70B, FSDP, 64 A100", "70B", 64, "a100", 1, 8192, "full", 331, PERF,
     "full AC; published MFU 51.7%"),
    ("Llama 3.1 8B, FSDP, 8 H100", "8B", 8, "h100", 2, 8192, "selective", 5762, H100,
     "selective AC, no compile; 500 W HBM2e H100s (below the SXM peak the profile assumes)"),
    ("Llama 3.1 8B, FSDP, 128 H100", "8B", 128, "h100", 2, 8192, "selective", 5605, H100,
     "selective AC, no compile; 500 W HBM2e H100s"),
    ("Llama 3.1 405B, FSDP 16 x TP 8 (SP), 128 H100", "405B", 128, "h100", 2, 8192, "full", 109, PERF,
     "full AC, loss parallel, no Float8/async TP; published MFU 29.0%"),
]

# torchtitan's `parallelize_llama` tensor plan (sequence parallel, loss parallel), planc's words
TENSOR_PLAN = """parallel tok_embeddings rowwise {
  input replicate
  output shard(1)
}
parallel norm sequence
parallel output colwise {
  input shard(1)
  loss_parallel
}
parallel layers.*.{attention_norm,ffn_norm} sequence
parallel layers.*.{attention,feed_forward} prepare_input {
  input shard(1)
  desired_input replicate
}
parallel layers.*.attention.{wq,wk,wv} colwise
parallel layers.*.attention.wo rowwise { output shard(1) }
parallel layers.*.feed_forward.{w1,w3} colwise
parallel layers.*.feed_forward.w2 rowwise { output shard(1) }
"""


def plan_text(checkpoint: str, tensor: int = 1) -> str:
    mesh = "mesh (replicate = 1, shard = *)\n" if tensor == 1 else f"mesh (shard = *, tensor = {tensor})\n"
    tail = "" if tensor == 1 else TENSOR_PLAN
    return (mesh +
            "defaults {\n  precision param = bf16, reduce = fp32, cast_inputs = false\n"
            "  reshard after_forward = true\n}\n"
            "unit tok_embeddings\nunit layers.*\nunit [norm, HEAD] { reshard after_forward = false }\n"
            "root { reshard after_forward = false }\n"
            f"checkpoint layers.* {checkpoint}\n" + tail).replace("HEAD", "lm_head" if tensor == 1 else "output")


def run(quick: bool) -> dict:
    rows, cases = [], []
    models: dict[tuple[str, int], object] = {}
    for name, flavor, gpus, hw, batch, seq, ckpt, published, source, note in CASES:
        if quick and flavor != "8B":
            continue
        key = (flavor, seq)
        tensor = 8 if flavor == "405B" else 1
        if key not in models:
            with torch.device("meta"):
                # the 405B case: benchmarks/_llama405b.py (torchtitan's module names, separate
                # wq/wk/wv as in the torchtitan release the published run used)
                models[key] = llama405b() if flavor == "405B" else llama3(flavor, max_seq_len=seq)
        model = models[key]
        compiled = planc.compile(planc.loads(plan_text(ckpt, tensor), filename=f"{flavor}.plan"), model, gpus)
        start = time.perf_counter()
        profile = step_profile(compiled.graph, input_shape=(batch, seq), dtype=torch.bfloat16)
        traced = time.perf_counter() - start
        start = time.perf_counter()
        st = estimate_step_time(compiled, world=gpus, hardware=hw, profile=profile)
        timed = time.perf_counter() - start
        per_gpu = st.tokens_per_s / gpus  # tokens over the job: batch x seq x data-parallel ranks
        cases.append({"case": name, "hardware": hw, "gpus": gpus, "local_batch": batch, "seq": seq,
                      "checkpoint": ckpt, "estimated_tps_per_gpu": round(per_gpu, 1), "published_tps_per_gpu": published,
                      "estimate_over_published": round(per_gpu / published, 3), "estimated_mfu": round(st.mfu, 4),
                      "step_s": st.total_s, "compute_s": st.compute_s, "exposed_comm_s": st.exposed_comm_s,
                      "trace_s": round(traced, 1), "estimate_ms": round(timed * 1e3, 2), "source": source,
                      "note": note})
        rows.append(f"| {name} | {hw} | {batch}x{seq} | {ckpt} | {per_gpu:,.0f} | {published:,} | "
                    f"{per_gpu / published:.2f} | {st.mfu:.1%} | {st.total_s:.2f} / {st.exposed_comm_s:.2f} | "
                    f"[torchtitan]({source}); {note} |")
    table = ["| case | profile | local batch x seq | AC | estimated TPS/GPU | published TPS/GPU | estimate / published "
             "| estimated MFU | step / exposed comm (s) | source |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- |", *rows]
    ratios = [c["estimate_over_published"] for c in cases]
    return {"benchmark": "time_model", "cases": cases, "markdown": "\n".join(table),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "estimate_ms_max": max(c["estimate_ms"] for c in cases)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 8B cases only")
    args = parser.parse_args(argv)
    data = run(args.quick)
    print(data["markdown"])
    print(json.dumps({k: v for k, v in data.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
