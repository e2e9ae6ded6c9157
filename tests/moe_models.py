"""Tiny MoE models for tests, importable as `tests.moe_models:NAME` (`planc suggest --model`).

`unnamed_top_k`: the zoo's routed MoE tiny with each router's top-k stored as `k`, not `top_k`: the
`expert` style fits its experts (the sorted layout), but the step-time model cannot read its routing
(P961, tests/test_suggest_ep.py).
"""

from __future__ import annotations

import torch
from torch import nn


class KRouter(nn.Module):
    """The zoo's `Router` (same gate, same arithmetic) with its top-k named `k`."""

    def __init__(self, gate: nn.Linear, k: int) -> None:
        super().__init__()
        self.gate, self.k = gate, k

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = self.gate(tokens).softmax(dim=-1)
        weights, ids = probs.topk(self.k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)


def unnamed_top_k() -> nn.Module:
    from planc.zoo import routed_moe_tiny

    model = routed_moe_tiny()
    for layer in model.layers:
        layer.moe.router = KRouter(layer.moe.router.gate, layer.moe.router.top_k)
    return model
