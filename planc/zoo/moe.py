"""A decoder whose feed-forward layers are mixtures of experts with 3-D expert weights."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from planc.zoo.layers import CausalSelfAttention, _check_heads


@dataclass(frozen=True)
class MoEConfig:
    """Shape of a :class:`MoETransformer`.

    Attributes:
        vocab_size: Number of token ids.
        dim: Model (residual stream) width.
        n_layers: Number of transformer blocks.
        n_heads: Attention heads per block; must divide ``dim``.
        num_experts: Experts per mixture-of-experts layer.
        hidden_dim: Hidden width of each SwiGLU expert.
        top_k: Experts each token is routed to; at most ``num_experts``.
    """

    vocab_size: int = 32000
    dim: int = 1024
    n_layers: int = 8
    n_heads: int = 16
    num_experts: int = 8
    hidden_dim: int = 2816
    top_k: int = 2

    def __post_init__(self) -> None:
        _check_heads(self.dim, self.n_heads)
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and num_experts ({self.num_experts})")


# Tiny shapes for fast (multi-process) tests: every size, including derived ones such as the
# MLP width and the fused qkv width, is divisible by 2 and 4, so any parameter dimension can be
# sharded over 2 or 4 ranks.
MOE_TINY_CONFIG = MoEConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, num_experts=4, hidden_dim=64, top_k=2)


class GroupedExperts(nn.Module):
    """A bank of SwiGLU experts stored as 3-D weights with a leading expert dimension.

    Expert ``e`` computes ``(silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]``. Every expert runs on
    every token (one batched matmul per weight), which is wasteful but dense, deterministic
    and gives every parameter a gradient -- the properties the tests need.

    Args:
        num_experts: Number of experts ``E``.
        dim: Input and output width.
        hidden_dim: Hidden width of each expert.

    Attributes:
        w1: Gate projection, shape ``[E, dim, hidden_dim]``.
        w2: Down projection, shape ``[E, hidden_dim, dim]``.
        w3: Up projection, shape ``[E, dim, hidden_dim]``.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialises each expert like a bias-free ``nn.Linear``: U(-1/sqrt(fan_in), +)."""
        for weight in (self.w1, self.w2, self.w3):
            bound = 1.0 / math.sqrt(weight.shape[1])  # fan_in is the middle dimension
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs every expert on every token.

        Args:
            x: Tokens, shape ``[tokens, dim]``.

        Returns:
            Per-expert outputs, shape ``[E, tokens, dim]``.
        """
        x = x.unsqueeze(0).expand(self.w1.shape[0], -1, -1)  # [E, T, dim]
        hidden = F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3)  # [E, T, hidden]
        return torch.bmm(hidden, self.w2)


class MoE(nn.Module):
    """Top-k routed mixture of :class:`GroupedExperts`, computed densely.

    The router's softmax probabilities are cut to each token's ``top_k`` largest, renormalised
    to sum to one, and used to weight the experts' outputs; other experts get weight zero.

    Args:
        dim: Input and output width.
        num_experts: Number of experts.
        hidden_dim: Hidden width of each expert.
        top_k: Experts each token is routed to.
    """

    def __init__(self, dim: int, num_experts: int, hidden_dim: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mixes the experts' outputs for ``x`` ([..., dim]); the output has the same shape."""
        tokens = x.reshape(-1, x.shape[-1])  # [T, dim]
        probs = self.router(tokens).softmax(dim=-1)  # [T, E]
        top_probs, top_idx = probs.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, top_idx, top_probs / top_probs.sum(dim=-1, keepdim=True))
        expert_out = self.experts(tokens)  # [E, T, dim]
        mixed = torch.einsum("etd,te->td", expert_out, gates)
        return mixed.view_as(x)


class MoEBlock(nn.Module):
    """Pre-norm block with a mixture-of-experts feed-forward layer.

    Computes ``h = x + attention(attention_norm(x))`` and then ``h + moe(ffn_norm(h))``.

    Args:
        config: Model shape.
    """

    def __init__(self, config: MoEConfig, moe: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim)
        self.attention = CausalSelfAttention(config.dim, config.n_heads, bias=False)
        self.ffn_norm = nn.RMSNorm(config.dim)
        self.moe = (moe or MoE)(config.dim, config.num_experts, config.hidden_dim, config.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Transforms ``x`` ([batch, seq, dim]); the output has the same shape."""
        h = x + self.attention(self.attention_norm(x))
        return h + self.moe(self.ffn_norm(h))


class MoETransformer(nn.Module):
    """Llama-style decoder (RMSNorm, bias-free layers) with mixture-of-experts FFNs.

    Module tree: ``tok_embeddings`` -> ``layers[i]`` (:class:`MoEBlock`) -> ``norm`` ->
    ``output``. The expert weights ``layers[i].moe.experts.w1/w2/w3`` are 3-D with a leading
    expert dimension.

    Args:
        config: Model shape.

    Attributes:
        config: The :class:`MoEConfig` the model was built from.
    """

    def __init__(self, config: MoEConfig, block: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList((block or MoEBlock)(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Maps token ids ([batch, seq], int64) to next-token logits ([batch, seq, vocab])."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def moe_transformer(config: MoEConfig | None = None) -> MoETransformer:
    """Builds a :class:`MoETransformer` (default: full size, about 653M parameters)."""
    return MoETransformer(config if config is not None else MoEConfig())


def moe_transformer_tiny() -> MoETransformer:
    """Builds a :class:`MoETransformer` with :data:`MOE_TINY_CONFIG`."""
    return MoETransformer(MOE_TINY_CONFIG)
