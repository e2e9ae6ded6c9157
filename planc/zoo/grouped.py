"""A grouped matrix multiply for routed experts: `planc::grouped_mm`, a torch custom op with autograd.

Routed experts run each expert on its own tokens: the tokens are sorted by expert, and row
group `e` of `x` (rows `offsets[e-1]:offsets[e]`) is multiplied by `w[e]`, as
`torch._grouped_mm(x, w, offs=offsets)` does on a GPU. The op exists because the fake-tensor
kernel of `torch._grouped_mm` takes bf16 only on this torch, and planc traces steps on fake
tensors in the plan's precision, fp32 included. Its CPU kernel is a loop over the groups
(dense per group, so it is exact in fp32); its fake kernel only says the output's shape, which
does not depend on how many tokens each expert got, so a step with routing traces on meta and
fake tensors. Its backward is the same op on the transposed weights plus a weight-gradient
op. FLOPs: 2 x rows x in x out for each of the three (`planc.estimate.flops` counts them).
"""

from __future__ import annotations

import torch

__all__ = ["grouped_mm"]


def _groups(offsets: torch.Tensor):
    start = 0
    for e, end in enumerate(offsets.tolist()):
        yield e, start, end
        start = end


@torch.library.custom_op("planc::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows `offsets[e-1]:offsets[e]` of `x` ([rows, in]) times `w[e]` ([E, in, out]) -> [rows, out].

    `offsets` (int, length E) are the cumulative ends of the row groups, the last one `rows`.
    """
    out = x.new_zeros(x.shape[0], w.shape[2])
    for e, start, end in _groups(offsets):
        if end > start:
            out[start:end] = x[start:end] @ w[e]
    return out


@grouped_mm.register_fake
def _(x, w, offsets):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("planc::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The gradient of `grouped_mm`'s weight: `x[group e].T @ grad[group e]` for each e -> [E, in, out]."""
    out = x.new_zeros(offsets.shape[0], x.shape[1], grad.shape[1])
    for e, start, end in _groups(offsets):
        if end > start:
            out[e] = x[start:end].transpose(0, 1) @ grad[start:end]
    return out


@grouped_mm_weight_grad.register_fake
def _(x, grad, offsets):
    return x.new_empty(offsets.shape[0], x.shape[1], grad.shape[1])


def _setup(ctx, inputs, output):
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, grad):
    x, w, offsets = ctx.saved_tensors
    grad_x = grouped_mm(grad, w.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
    grad_w = grouped_mm_weight_grad(x, grad, offsets) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


grouped_mm.register_autograd(_backward, setup_context=_setup)


def flop_formulas() -> dict:
    """FlopCounterMode formulas for the two ops (op packet -> fn(*shapes, out_shape) -> FLOPs)."""
    def forward(x_shape, w_shape, offsets_shape, *args, **kwargs) -> int:
        return 2 * x_shape[0] * x_shape[1] * w_shape[2]

    def weight_grad(x_shape, grad_shape, offsets_shape, *args, **kwargs) -> int:
        return 2 * x_shape[0] * x_shape[1] * grad_shape[1]

    return {torch.ops.planc.grouped_mm: forward, torch.ops.planc.grouped_mm_weight_grad: weight_grad}
