"""Rank bodies for tests/test_context_dist.py (module level, so spawned ranks can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from planc.backends import context


def reference(q, k, v):
    """Plain causal attention over the whole sequence in one process: the oracle."""
    seq = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


def attention_worker(rank: int, world: int, seq: int) -> dict:
    """Head-tail sharded attention on `world` context ranks vs the unsharded oracle: output and dq/dk/dv."""
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, 2, seq, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    weight = torch.randn(1, 2, seq, 8, generator=g, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_(True) for t in full]
    ref = reference(*ref_in)
    (ref * weight).sum().backward()

    positions = context.shard_positions(seq, world, rank)
    local = [context.shard(t, 2, world, rank).requires_grad_(True) for t in full]
    out = context.attention(*local, positions)
    (out * context.shard(weight, 2, world, rank)).sum().backward()
    gathered = context.unshard(out, 2)
    dist.barrier()
    return {
        "out": (out - ref.detach().index_select(2, positions)).abs().max().item(),
        "unsharded": (gathered - ref.detach()).abs().max().item(),
        "grads": [(t.grad - r.grad.index_select(2, positions)).abs().max().item() for t, r in zip(local, ref_in)],
        "grad_norm": min(t.grad.abs().max().item() for t in local),
    }
