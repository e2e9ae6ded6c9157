"""`ScaleGrad`: the identity forward (a view), the gradient scaled on its way back.

Expert parallelism scales the experts' gradients by 1/expert in the dispatch (FSDP's divide factor
cannot on gloo): the runtime (`planc/backends/experts.py`) applies it and the estimate's trace of
one expert rank (`planc/estimate/expert_local.py`) allocates what it allocates, from this one class.
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
