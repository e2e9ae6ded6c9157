"""Context parallelism at run time: head-tail sequence shards, and causal attention that gathers K/V over the context axis.

The pattern is the one `/work/shared/docs/pp-ep-cp-facts.md` probed on gloo (torch's ring
attention has no CPU kernel): each context rank holds `2` of the `2 * cp` sequence chunks
(chunk `r` and chunk `2 * cp - 1 - r`, "head-tail", so causal work is balanced), gathers every
rank's K and V in forward into the whole sequence in order (before a grouped-query repeat of
their heads, which then runs locally), reduce-scatters their gradients in backward (each rank
receives the sum of its own chunks), and runs each query chunk's causal SDPA over the prefix of
keys up to its end (lower-right aligned: `causal_lower_right`'s flash kernels on GPU, an
explicit mask on CPU), so no score matrix is built where SDPA has a fused kernel. The
arithmetic is `planc/model/context_attention.py` (shared with the estimate's trace); this
module gives it the process group's collectives (`Collectives`). A plan reaches it through
`parallel SELECTOR context` (`AttendOverContext` ops, run by `planc.apply`) and the
`ShardBatch` step op (`AppliedPlan.shard_batch` -> `shard_batch` here).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from planc.model.context_attention import route


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


class Collectives:
    """The context axis's collectives on a process group (`planc.model.context_attention.Comm`).

    The gather is one `all_gather_single` into a `(cp, ...)` buffer. The gradient's
    reduce-scatter is `reduce_scatter_single` on one `(cp, ...)` buffer, except on gloo, which
    gets the same buffer as a list of its rows (`dist.reduce_scatter`): gloo's
    `reduce_scatter_single` works on a buffer of its own (a `copy_` into the output after the
    collective; tests/test_context_dist.py::test_fact_gloo_reduce_scatters_and_its_single_tensor_form_copies),
    the list form does not. The values are the same; NCCL's list form would copy the rows into a
    flat buffer instead.
    """

    def __init__(self, group=None) -> None:
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.gloo = dist.get_backend(group) == "gloo"

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> None:
        dist.all_gather_single(out.view(-1, *t.shape[1:]), t, group=self.group)

    def reduce_scatter(self, out: torch.Tensor, buf: torch.Tensor) -> None:
        if self.gloo:
            dist.reduce_scatter(out, list(buf.unbind(0)), group=self.group)
        else:
            dist.reduce_scatter_single(out, buf.view(-1, *out.shape[1:]), group=self.group)


def unshard(t: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """The full sequence from every context rank's head-tail shard of `t` along `dim` (no gradient)."""
    cp = dist.get_world_size(group)
    full = _gather_plain(t.detach(), dim, group)
    seq = full.shape[dim]
    order = torch.cat([shard_positions(seq, cp, r) for r in range(cp)]).to(t.device)
    return full.index_select(dim, torch.argsort(order))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None,
              group=None) -> torch.Tensor:
    """Causal attention of this rank's queries over every rank's keys; `q, k, v` are `(..., seq, head_dim)`,
    this rank's head-tail shard (chunks `r` and `2cp - 1 - r` of `2cp`, `shard_positions`: the
    `positions` the loop passes, which say no more than that).

    Keys and values are gathered into the whole sequence in order (their gradients
    reduce-scattered); each of the two query chunks attends to the prefix of keys up to its own
    end, causal within its diagonal block (SDPA, `causal_prefix`): no score matrix is built where
    SDPA has a fused kernel.
    """
    with route(Collectives(group)):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attend_over_context(module: torch.nn.Module, group=None) -> None:
    """Make `module`'s causal SDPA gather K/V over `group`; its forward must get `positions=` (global, per shard)."""

    comm: list[Collectives] = []  # made at the first forward (the group's backend is known by then)

    def enter(_module, args, kwargs):
        if kwargs.get("positions") is None:
            raise RuntimeError("context parallelism: this attention was called without `positions=`; cut each "
                               "batch with `applied.shard_batch(tokens, labels)` and call the model as "
                               "`model(batch.tokens, positions=batch.positions)`")
        comm[:] = comm or [Collectives(group)]
        mode = route(comm[0])
        module._planc_context_mode = mode  # noqa: SLF001 - paired with leave()
        mode.__enter__()

    def leave(_module, args, kwargs, output):
        mode = module.__dict__.pop("_planc_context_mode", None)  # none when `enter` refused the call
        if mode is not None:
            mode.__exit__(None, None, None)

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, with_kwargs=True, always_call=True)  # the mode ends even if forward raises
