"""Rank bodies for tests/test_accumulate.py: gradient accumulation through `AppliedPlan.accumulate`.

A rank trains with the plan's `step { accumulate 4, sync = ... }`; the reference, one
unsharded process, accumulates the same microbatches of the whole global batch by hand. The
reduce-scatters FSDP2 really issues are counted on the way (the real collective runs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from training import next_token_loss

import planc
from planc import zoo

STEPS, GLOBAL_BATCH, SEQ, LR, K = 3, 16, 16, 1e-2, 4

PLAN = """model planc.zoo:seed_transformer_tiny
defaults { precision param = fp32, reduce = fp32 }
unit transformer_layers.*
step { accumulate 4, sync = SYNC }
"""


def _model():
    torch.manual_seed(0)
    return zoo.seed_transformer_tiny()


def _batches(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return [(torch.randint(0, vocab, (GLOBAL_BATCH, 1), generator=gen) + torch.arange(SEQ)) % vocab
            for _ in range(STEPS)]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _steps(model, data, rank: int, world: int, microbatches) -> dict:
    """AdamW steps: each rank takes its slice of the global batch and runs `microbatches(local)`
    (an iterator of 1-tuples); the gradients of the last step and the losses come back."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    per_rank = GLOBAL_BATCH // world
    losses, grads = [], {}
    for step, tokens in enumerate(data):
        local = tokens[rank * per_rank:(rank + 1) * per_rank]
        total = torch.zeros(())
        for (mb,) in microbatches(local):
            value = next_token_loss(model, mb) / K
            value.backward()
            total += value.detach()
        if step == len(data) - 1:
            grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
    params = {n: _full(p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def reference() -> dict:
    """One process, no FSDP: the global batch in K microbatches, gradients summed by autograd."""
    model = _model()
    return _steps(model, _batches(model.config.vocab_size), 0, 1, lambda b: ((c,) for c in b.chunk(K)))


def worker(rank: int, world: int, sync: str) -> dict:
    model = _model()
    data = _batches(model.config.vocab_size)
    applied = planc.apply(model, planc.loads(PLAN.replace("SYNC", sync), filename="accumulate.plan"))
    calls = []
    original = dist.reduce_scatter_single

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counted
    try:
        out = _steps(model, data, rank, world, applied.accumulate)
    finally:
        dist.reduce_scatter_single = original
    out["reduce_scatters"] = len(calls)
    out["units"] = len(applied.units)
    out["microbatches"] = applied.microbatches
    return out
