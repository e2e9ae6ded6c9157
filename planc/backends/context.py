"""Context parallelism at run time: head-tail sequence shards, and causal attention that gathers K/V over the context axis.

The pattern is the one `/work/shared/docs/pp-ep-cp-facts.md` probed on gloo (torch's ring
attention has no CPU kernel): each context rank holds `2` of the `2 * cp` sequence chunks
(chunk `r` and chunk `2 * cp - 1 - r`, "head-tail", so causal work is balanced), gathers every
rank's K and V in forward, reduce-scatters their gradients in backward, and masks by *global*
positions. A plan reaches it through `parallel SELECTOR context` (`AttendOverContext` ops, run by
`planc.apply`) and the `ShardBatch` step op (`AppliedPlan.shard_batch` -> `shard_batch` here).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


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


class Batch(NamedTuple):
    """One rank's share of a batch: its tokens and labels, and their global positions (None: the whole sequence)."""

    tokens: torch.Tensor
    labels: torch.Tensor | None
    positions: torch.Tensor | None


def shard_batch(op, mesh, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> Batch:
    """The `ShardBatch` step op `op` on this rank: `tokens` and `labels` (`(batch, seq)`) cut along
    the sequence for this rank of the context axis `mesh` (1-D), and their global positions."""
    if op.balance != "head-tail":
        raise ValueError(f"unknown sequence balance {op.balance!r}")
    dims = dict(op.tensors)
    cp, rank = mesh.size(), mesh.get_local_rank()
    positions = shard_positions(tokens.shape[dims["tokens"]], cp, rank).to(tokens.device)
    return Batch(shard(tokens, dims["tokens"], cp, rank),
                 None if labels is None else shard(labels, dims["labels"], cp, rank), positions)


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


class _ContextSDPA(TorchFunctionMode):
    """Routes causal `F.scaled_dot_product_attention` calls to `attention` with this shard's positions."""

    def __init__(self, positions: torch.Tensor, group) -> None:
        super().__init__()
        self.positions, self.group = positions, group

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            if not kwargs.get("is_causal") or kwargs.get("attn_mask") is not None or len(args) > 3:
                raise NotImplementedError("context parallelism supports causal attention without a mask only")
            return attention(*args, self.positions, self.group)
        return func(*args, **kwargs)


def attend_over_context(module: torch.nn.Module, group=None) -> None:
    """Make `module`'s causal SDPA gather K/V over `group`; its forward must get `positions=` (global, per shard)."""

    def enter(_module, args, kwargs):
        if kwargs.get("positions") is None:
            raise RuntimeError("context parallelism: this attention was called without `positions=`; cut each "
                               "batch with `applied.shard_batch(tokens, labels)` and call the model as "
                               "`model(batch.tokens, positions=batch.positions)`")
        mode = _ContextSDPA(kwargs["positions"], group)
        module._planc_context_mode = mode  # noqa: SLF001 - paired with leave()
        mode.__enter__()

    def leave(_module, args, kwargs, output):
        mode = module.__dict__.pop("_planc_context_mode", None)  # none when `enter` refused the call
        if mode is not None:
            mode.__exit__(None, None, None)

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, with_kwargs=True, always_call=True)  # the mode ends even if forward raises
