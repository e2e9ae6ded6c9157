"""Context parallelism at run time: head-tail sequence shards, and causal attention that gathers K/V over the context axis.

The pattern is the one `/work/shared/docs/pp-ep-cp-facts.md` probed on gloo (torch's ring
attention has no CPU kernel): each context rank holds `2` of the `2 * cp` sequence chunks
(chunk `r` and chunk `2 * cp - 1 - r`, "head-tail", so causal work is balanced), gathers every
rank's K and V in forward, reduce-scatters their gradients in backward, and masks by *global*
positions. Not wired to plans yet: the `context` mesh role is still refused (P408).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def shard_positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions rank `rank` of `cp` holds: chunks `rank` and `2 * cp - 1 - rank` of `2 * cp`."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not in a context axis of size {cp}")
    if seq % (2 * cp):
        raise ValueError(f"sequence length {seq} does not divide into 2 x context = {2 * cp} chunks")
    chunk = seq // (2 * cp)
    head, tail = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(head, head + chunk), torch.arange(tail, tail + chunk)])


def shard(t: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's head-tail shard of `t` along `dim` (the sequence dimension)."""
    return t.index_select(dim, shard_positions(t.shape[dim], cp, rank).to(t.device))


def _gather_plain(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim` in forward; in backward, sum the gradient over ranks and keep this rank's part."""

    @staticmethod
    def forward(ctx, t, dim, group):
        ctx.dim, ctx.group, ctx.length = dim, group, t.shape[dim]
        return _gather_plain(t, dim, group)

    @staticmethod
    def backward(ctx, grad):
        # NOTE: gloo has no reduce_scatter; all_reduce then narrow sums the same values.
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad.narrow(ctx.dim, rank * ctx.length, ctx.length), None, None


def unshard(t: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """The full sequence from every context rank's head-tail shard of `t` along `dim` (no gradient)."""
    cp = dist.get_world_size(group)
    full = _gather_plain(t.detach(), dim, group)
    seq = full.shape[dim]
    order = torch.cat([shard_positions(seq, cp, r) for r in range(cp)]).to(t.device)
    return full.index_select(dim, torch.argsort(order))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, group=None) -> torch.Tensor:
    """Causal attention of this rank's queries over every rank's keys; `q, k, v` are `(..., seq, head_dim)`.

    `positions` are the global positions of this rank's sequence shard (`shard_positions`).
    """
    seq_dim = q.dim() - 2
    keys = _GatherSequence.apply(k, seq_dim, group)
    values = _GatherSequence.apply(v, seq_dim, group)
    key_positions = _gather_plain(positions, 0, group)
    scores = (q @ keys.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(positions[:, None] < key_positions[None, :], float("-inf"))
    return scores.softmax(-1) @ values
