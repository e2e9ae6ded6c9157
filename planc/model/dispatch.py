"""What the experts' token dispatch computes, shared by the runtime (`planc/backends/experts.py`)
and the estimate's trace of one expert rank (`planc/estimate/expert_local.py`), so both allocate alike.

`ScaleGrad`: the identity forward (a view), the gradient scaled on its way back (the dispatch scales
the experts' gradients, FSDP's divide factor cannot on gloo). `expert_major`: the order that
regroups the rows an expert rank received source-rank-major into expert-major. `sorted_rows` and
`token_choice`: each experts layout's dispatched forward around an `exchange(rows, counts, run)`
(the runtime's all-to-alls, or the estimate's one-rank stand-ins). `TakeRows` and `GatherRows`: a
replicated input's cut over the tensor group and the outputs' gather (`split_over_tensor`), around
a `gather(parts, tensor)` (`dist.all_gather` on the tensor group, or nothing on one rank).
"""

from __future__ import annotations

import torch


class ScaleGrad(torch.autograd.Function):
    """The identity forward (a view); the gradient scaled by `scale` (a new tensor)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def expert_major(received: torch.Tensor, rows: int) -> torch.Tensor:
    """Indices that reorder the `rows` rows received source-rank-major ([ranks, local experts]
    counts) to expert-major, each expert's rows from rank 0 first."""
    flat = received.reshape(-1)
    starts = flat.cumsum(0) - flat
    blocks = torch.arange(flat.numel(), device=flat.device).view(received.shape).t().reshape(-1)
    counts = flat[blocks]
    base = torch.repeat_interleave(starts[blocks], counts, output_size=rows)
    within = torch.arange(rows, device=flat.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts,
                                                                              output_size=rows)
    return base + within


def sorted_rows(forward, exchange):
    """The sorted layout's dispatched forward (`forward(rows, offsets)`, `planc.zoo.routed.RoutedExperts`):
    the counts per expert from the offsets, the container's forward on the rows it receives."""

    def dispatched(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        return exchange(rows, counts, lambda x, c: forward(x, c.cumsum(0)))

    return dispatched


def token_choice(forward, exchange, experts: int, local: int):
    """The token-choice layout's dispatched forward (`forward(hidden, top_k_index, top_k_weights)`,
    Hugging Face's fused 3-D experts: Qwen3-MoE, Mixtral): each (token, expert) pair sorted by expert,
    exchanged, run with weight 1 on its local expert (of `local`, `experts` in all), and combined
    here with the router's weights."""

    def dispatched(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.zeros(experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))

        def run(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            ids = torch.repeat_interleave(torch.arange(local, device=x.device), c, output_size=x.shape[0]).unsqueeze(1)
            return forward(x, ids, torch.ones(ids.shape, dtype=top_k_weights.dtype, device=x.device))

        pairs = exchange(hidden.index_select(0, order // k), counts, run)
        pairs = torch.empty_like(pairs).index_copy(0, order, pairs)
        return (pairs.view(-1, k, pairs.shape[-1]) * top_k_weights.unsqueeze(-1).to(pairs.dtype)).sum(1)

    return dispatched


class TakeRows(torch.autograd.Function):
    """This tensor rank's part of rows replicated over the tensor group (dim 0 cut in `size`
    equal parts: a view); the backward gathers the parts' gradients (`gather(parts, grad)`), so
    every rank's replicated input gets the whole gradient (each rank computed only its part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gather, rank: int, size: int) -> torch.Tensor:
        ctx.gather, ctx.size = gather, size
        return x.chunk(size)[rank]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = [torch.empty_like(grad) for _ in range(ctx.size)]
        ctx.gather(parts, grad.contiguous())
        return torch.cat(parts), None, None, None


class GatherRows(torch.autograd.Function):
    """Each tensor rank's rows (dim 0) gathered in rank order (`gather(parts, x)`); the backward keeps
    this rank's rows of the gradient (the computation after it is replicated over the tensor group,
    so each rank's gradient of the gathered rows is already the whole one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gather, rank: int, size: int) -> torch.Tensor:
        ctx.rank, ctx.size = rank, size
        parts = [torch.empty_like(x) for _ in range(size)]
        gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.size)[ctx.rank].contiguous(), None, None, None
