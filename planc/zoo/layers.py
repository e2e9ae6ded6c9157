"""Layers shared by the zoo's seed, GPT and MoE transformers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _check_heads(dim: int, n_heads: int) -> None:
    """Raises ``ValueError`` unless ``dim`` splits evenly into ``n_heads`` attention heads."""
    if dim % n_heads != 0:
        raise ValueError(f"dim ({dim}) must be divisible by n_heads ({n_heads})")


class MLP(nn.Module):
    """Two-layer GELU feed-forward network: ``w_out(gelu(w_in(x)))``.

    Args:
        dim: Input and output width.
        hidden_dim: Width of the hidden layer.
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.w_out = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the MLP to the last dimension of ``x``."""
        return self.w_out(self.act(self.w_in(x)))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused query/key/value projection.

    Uses ``F.scaled_dot_product_attention(is_causal=True)``, which has CPU forward and
    backward kernels (FlexAttention has no CPU backward), so no mask tensor is ever built.

    Args:
        dim: Model width.
        n_heads: Number of heads; must divide ``dim``.
        bias: Whether the ``qkv`` and ``proj`` linear layers have biases.
    """

    def __init__(self, dim: int, n_heads: int, bias: bool = True) -> None:
        super().__init__()
        _check_heads(dim, n_heads)
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attends each position of ``x`` ([batch, seq, dim]) to itself and earlier ones."""
        batch, seq, dim = x.shape
        # [B, S, 3D] -> three [B, H, S, D/H] tensors.
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, dim // self.n_heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, dim))
