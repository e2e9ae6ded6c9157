"""A routed mixture-of-experts decoder: a top-k router, and experts that run only on their tokens.

The MoE transformer of `planc/zoo/moe.py` runs every expert on every token; this one routes,
as DeepSeek-V3, Qwen3-MoE, Mixtral and torchtitan's MoE do: the router scores each token,
keeps its `top_k` experts (softmax, renormalised over the kept ones), the tokens are sorted
by expert, each expert runs on its own group (`planc::grouped_mm`, `planc/zoo/grouped.py`),
and the outputs go back to their tokens weighted by the router. Groups are uneven and change
with the data: the case expert parallelism's all-to-all must handle.

Module tree (torchtitan's names and layout): `tok_embeddings` -> `layers[i]` (`attention_norm`,
`attention`, `ffn_norm`, `moe`: `router.gate` [E, dim], `experts.w1`/`w3` [E, hidden, dim],
`experts.w2` [E, dim, hidden]) -> `norm` -> `output`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from planc.zoo.grouped import grouped_mm
from planc.zoo.moe import MoEBlock, MoEConfig, MoETransformer


class Router(nn.Module):
    """Top-k token choice: each token's `top_k` experts and their weights (softmax, renormalised)."""

    def __init__(self, dim: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [T, dim] -> (expert ids [T, top_k], weights [T, top_k])."""
        probs = self.gate(tokens).softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)


class RoutedExperts(nn.Module):
    """SwiGLU experts as 3-D weights, each run only on the rows routed to it.

    Expert `e` computes `(silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T` on its group of rows.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert like a bias-free `nn.Linear` (U(-1/sqrt(fan_in), +)); fan_in is the last dimension."""
        for weight in (self.w1, self.w2, self.w3):
            bound = 1.0 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert [rows, dim] and each group's cumulative end [E] -> [rows, dim]."""
        hidden = F.silu(grouped_mm(x, self.w1.transpose(1, 2), offsets)) * grouped_mm(x, self.w3.transpose(1, 2), offsets)
        return grouped_mm(hidden, self.w2.transpose(1, 2), offsets)


class RoutedMoE(nn.Module):
    """Route, sort the (token, expert) pairs by expert, run the experts, combine weighted."""

    def __init__(self, dim: int, num_experts: int, hidden_dim: int, top_k: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.router = Router(dim, num_experts, top_k)
        self.experts = RoutedExperts(num_experts, dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # [T, dim]
        ids, weights = self.router(tokens)  # [T, k]
        flat = ids.reshape(-1)  # pair p = (token p // k, its (p % k)-th expert)
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        rows = tokens.index_select(0, order // ids.shape[1])
        out = self.experts(rows, counts.cumsum(0))
        pairs = torch.empty_like(out).index_copy(0, order, out)  # back to pair order
        mixed = (pairs.view(*ids.shape, -1) * weights.unsqueeze(-1).to(pairs.dtype)).sum(dim=1)
        return mixed.view_as(x)


class RoutedMoEBlock(MoEBlock):
    """Pre-norm block: `h = x + attention(attention_norm(x))`, then `h + moe(ffn_norm(h))`, routed."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config, moe=RoutedMoE)


class RoutedMoETransformer(MoETransformer):
    """Decoder of `RoutedMoEBlock`s (see the module docstring for its tree)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config, block=RoutedMoEBlock)


# DeepSeek-V2-Lite-like routing at a size one node trains: 64 experts, 6 per token.
ROUTED_MOE_CONFIG = MoEConfig(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, num_experts=64,
                              hidden_dim=1408, top_k=6)
ROUTED_MOE_TINY_CONFIG = MoEConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, num_experts=4, hidden_dim=64,
                                   top_k=2)


def routed_moe(config: MoEConfig | None = None) -> RoutedMoETransformer:
    """Builds a :class:`RoutedMoETransformer` (default: 64 experts, top-6, 16 layers, about 9.3B parameters)."""
    return RoutedMoETransformer(config if config is not None else ROUTED_MOE_CONFIG)


def routed_moe_tiny() -> RoutedMoETransformer:
    """Builds a :class:`RoutedMoETransformer` with :data:`ROUTED_MOE_TINY_CONFIG` (4 experts, top-2)."""
    return RoutedMoETransformer(ROUTED_MOE_TINY_CONFIG)
