"""What the experts' token dispatch computes, shared by the runtime (`planc/backends/experts.py`)
and the estimate's trace of one expert rank (`planc/estimate/expert_local.py`), so both allocate alike.

`ScaleGrad`: the identity forward (a view), the gradient scaled on its way back (the dispatch scales
the experts' gradients, FSDP's divide factor cannot on gloo). `expert_major`: the order that
regroups the rows an expert rank received source-rank-major into expert-major.
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
