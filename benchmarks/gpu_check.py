"""planc's per-rank estimates against one real training step on a GPU (where one is lent; CI has none).

One process on one GPU (NCCL, world 1). For each case the plan is applied for real by
`planc.apply` to the full-size model built on meta, materialised on the GPU by
`planc.materialize`, and trained with foreach AdamW: forward, cross-entropy over fp32 logits,
backward, `clip_grad_norm_`, the optimizer step, the step every planc estimate models.

Measured, on the last of a few steps: `torch.cuda.max_memory_allocated` (the caching
allocator's live bytes, not what it reserves; cuBLAS' workspace included) and
torch's `FSDPMemTracker` (planc's usual oracle, `planc.analysis.simulate.measure_real`) on the
same step; the median step time over timed steps (CUDA events). Estimated:
`planc.estimate.memory.estimate` and `planc.estimate.time.estimate_step_time` on the `h200`
profile. World 1 means no collective crosses a link, so this checks the memory model and the
compute side of the time model (FLOPs / (peak x efficiency)), not the network.

    python benchmarks/gpu_check.py            # prints one line per case, then one JSON line
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parent.parent

ZOO_LLAMA_1D = """model planc.zoo:llama
mesh (replicate = 1, shard = *)
defaults {
  precision param = bf16, reduce = fp32, cast_inputs = false
  reshard after_forward = true
}
unit tok_embeddings
unit layers.*
unit [norm, output] { reshard after_forward = false }
root { reshard after_forward = false }
"""

# (label, plan text, model reference, input shape)
CASES = [
    ("seed transformer 1.41B (zoo)", (ROOT / "plans" / "seed.plan").read_text(), "planc.zoo:seed_transformer", (4, 1024)),
    ("Llama 3.2 1B-shaped 1.50B (zoo)", ZOO_LLAMA_1D, "planc.zoo:llama", (4, 1024)),
    ("GPT-2 124M (HF, tied)", (ROOT / "plans" / "gpt2.plan").read_text(), "hf:gpt2", (8, 1024)),
]
TIMED_STEPS = 5


def _step(model, applied, example, loss_fn, opt):
    pred = model(*example.args, **example.kwargs)
    with applied.loss_parallel():
        value = loss_fn(pred, example)
        del pred
        value.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return value.detach()


def one(label: str, text: str, ref: str, shape: tuple[int, int]) -> dict:
    import planc
    from planc.analysis.simulate import _optimizer, measure_real, zoo_inputs
    from planc.estimate import memory
    from planc.estimate.time import estimate_step_time
    from planc.estimate.trace import Example, default_loss
    from planc.model.build import build_model

    model = build_model(ref, device="meta")
    compiled = planc.compile(planc.loads(text, filename=f"{label}.plan"), model, 1)
    est = memory.estimate(compiled, 1, optimizer="adamw", input_shape=shape)
    st = estimate_step_time(compiled, world=1, hardware="h200", input_shape=shape, optimizer="adamw")
    applied = planc.apply(model, compiled)
    planc.materialize(model, "cuda")
    torch.manual_seed(0)
    example = Example.of(tuple(t.cuda() for t in zoo_inputs(shape)(model)))
    loss_fn, opt = default_loss(model), _optimizer(model, "adamw")
    for _ in range(2):  # optimizer state allocated, kernels chosen
        _step(model, applied, example, loss_fn, opt)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _step(model, applied, example, loss_fn, opt)
    torch.cuda.synchronize()
    allocator_peak = torch.cuda.max_memory_allocated()
    times = []
    for _ in range(TIMED_STEPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = _step(model, applied, example, loss_fn, opt)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del opt
    torch.cuda.empty_cache()
    try:  # planc's tracker wraps torch 2.13's FSDP internals; on another torch it may not apply
        tracked, tracker_error = measure_real(model, example.args, optimizer="adamw", steps=2).peak, None
    except AttributeError as err:
        tracked, tracker_error = None, f"{type(err).__name__}: {err}"
    measured_s = statistics.median(times)
    row = {"model": label, "input_shape": list(shape), "estimated_peak_bytes": est.peak.total,
           "allocator_peak_bytes": allocator_peak, "tracker_peak_bytes": tracked,
           "estimate_over_allocator": round(est.peak.total / allocator_peak, 4),
           "estimate_over_tracker": round(est.peak.total / tracked, 4) if tracked else None,
           "tracker_error": tracker_error,
           "estimated_step_s": round(st.total_s, 5), "estimated_compute_s": round(st.compute_s, 5),
           "measured_step_s": round(measured_s, 5), "estimate_over_measured_time": round(st.total_s / measured_s, 3),
           "efficiency_assumed": st.efficiency,
           "efficiency_measured": round(st.efficiency * st.compute_s / measured_s, 3) if measured_s else None,
           "loss": float(loss)}
    print(f"{label:<34} memory est/alloc {row['estimate_over_allocator']:.4f} est/tracker "
          f"{row['estimate_over_tracker']}  time est {st.total_s * 1e3:.1f} ms measured {measured_s * 1e3:.1f} ms",
          file=sys.stderr, flush=True)
    return row


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no GPU here; nothing measured", file=sys.stderr)
        return 0
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    rows, failed = [], []
    for label, text, ref, shape in CASES:
        try:
            rows.append(one(label, text, ref, shape))
        except Exception as err:  # a case that cannot run is reported, not hidden
            failed.append({"model": label, "error": f"{type(err).__name__}: {err}"[:400]})
            print(f"{label:<34} FAILED {failed[-1]['error']}", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
    print(json.dumps({"benchmark": "gpu_check", "device": torch.cuda.get_device_name(0),
                      "torch": torch.__version__, "cases": rows, "failed": failed}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
