"""Context parallelism at run time: head-tail sequence shards, and causal attention that gathers K/V over the context axis.

The pattern is the one `/work/shared/docs/pp-ep-cp-facts.md` probed on gloo (torch's ring
attention has no CPU kernel): each context rank holds `2` of the `2 * cp` sequence chunks
(chunk `r` and chunk `2 * cp - 1 - r`, "head-tail", so causal work is balanced), gathers every
rank's K and V in forward into the whole sequence in order, sums their gradients in backward
(an all-reduce; each rank keeps its chunks), and runs each query chunk's causal SDPA over the
prefix of keys up to its end (lower-right aligned: `causal_lower_right`'s flash kernels on GPU,
an explicit mask on CPU), so no score matrix is built where SDPA has a fused kernel. A plan
reaches it through `parallel SELECTOR context` (`AttendOverContext` ops, run by `planc.apply`)
and the `ShardBatch` step op (`AppliedPlan.shard_batch` -> `shard_batch` here).
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


def _in_order(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Every rank's head-tail shard (`parts[r]`: chunks `r` and `2cp - 1 - r`) as the whole sequence, in order."""
    cp = len(parts)
    chunk = parts[0].shape[dim] // 2
    return torch.cat([parts[j].narrow(dim, 0, chunk) if j < cp else parts[2 * cp - 1 - j].narrow(dim, chunk, chunk)
                      for j in range(2 * cp)], dim)


def _my_chunks(t: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """Chunks `rank` and `2cp - 1 - rank` of the whole sequence `t` (this rank's head-tail shard), a new tensor."""
    chunk = t.shape[dim] // (2 * cp)
    return torch.cat([t.narrow(dim, rank * chunk, chunk), t.narrow(dim, (2 * cp - 1 - rank) * chunk, chunk)], dim)


class _GatherSequence(torch.autograd.Function):
    """Every rank's head-tail shard gathered into the whole sequence, in order, in forward; in
    backward the gradient summed over ranks and this rank's two chunks kept."""

    @staticmethod
    def forward(ctx, t, dim, group):
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return _in_order(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        # NOTE: all_reduce then this rank's chunks: gloo has no reduce-scatter of a list along
        # a middle dim; the values are the same (a reduce-scatter would move half the bytes)
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return _my_chunks(grad, ctx.dim, dist.get_world_size(ctx.group), dist.get_rank(ctx.group)), None, None


def unshard(t: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """The full sequence from every context rank's head-tail shard of `t` along `dim` (no gradient)."""
    cp = dist.get_world_size(group)
    full = _gather_plain(t.detach(), dim, group)
    seq = full.shape[dim]
    order = torch.cat([shard_positions(seq, cp, r) for r in range(cp)]).to(t.device)
    return full.index_select(dim, torch.argsort(order))


def causal_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA of `q` (the last `L` positions of a prefix) over the prefix's `k, v` (`S >= L`), causal
    aligned lower-right: query `i` sees keys up to `S - L + i`.

    On GPU torch's `causal_lower_right` runs the flash / memory-efficient kernels (no mask, no
    score matrix). Elsewhere (CPU, fake tensors) SDPA gets the L x S boolean mask, which its CPU
    kernel keeps for backward (`planc/estimate/context_local.py` models the GPU path).
    """
    length, total = q.shape[-2], k.shape[-2]
    if length == total:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if q.device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(length, total))
    mask = torch.ones(length, total, dtype=torch.bool, device=q.device).tril(total - length)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None,
              group=None) -> torch.Tensor:
    """Causal attention of this rank's queries over every rank's keys; `q, k, v` are `(..., seq, head_dim)`,
    this rank's head-tail shard (chunks `r` and `2cp - 1 - r` of `2cp`, `shard_positions`: the
    `positions` the loop passes, which say no more than that).

    Keys and values are gathered into the whole sequence in order; each of the two query chunks
    attends to the prefix of keys up to its own end, causal within its diagonal block (SDPA,
    `causal_prefix`): no score matrix is built where SDPA has a fused kernel.
    """
    seq_dim = q.dim() - 2
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    keys = _GatherSequence.apply(k, seq_dim, group)
    values = _GatherSequence.apply(v, seq_dim, group)
    chunk = q.shape[seq_dim] // 2
    ends = ((rank + 1) * chunk, (2 * cp - rank) * chunk)  # the end of the head chunk, of the tail chunk
    outs = [causal_prefix(q.narrow(seq_dim, i * chunk, chunk), keys.narrow(seq_dim, 0, end),
                          values.narrow(seq_dim, 0, end)) for i, end in enumerate(ends)]
    return torch.cat(outs, seq_dim)


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
