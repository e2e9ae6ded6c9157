"""The seed transformer: a plain pre-norm decoder (about 1.41B parameters at full size)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from planc.zoo.layers import MLP, _check_heads


@dataclass(frozen=True)
class SeedConfig:
    """Shape of a :class:`SeedTransformer`.

    Attributes:
        vocab_size: Number of token ids.
        dim: Model (residual stream) width.
        n_layers: Number of transformer blocks.
        n_heads: Attention heads per block; must divide ``dim``.
        ffn_mult: Hidden width of the MLP as a multiple of ``dim``.
    """

    vocab_size: int = 50000
    dim: int = 2048
    n_layers: int = 24
    n_heads: int = 32
    ffn_mult: int = 4

    def __post_init__(self) -> None:
        _check_heads(self.dim, self.n_heads)


# Tiny shapes for fast (multi-process) tests: every size, including derived ones such as the
# MLP width and the fused qkv width, is divisible by 2 and 4, so any parameter dimension can be
# sharded over 2 or 4 ranks.
SEED_TINY_CONFIG = SeedConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4)


class Block(nn.Module):
    """Pre-norm transformer block of the :class:`SeedTransformer`.

    Computes ``h = x + attention(attention_norm(x))`` and then ``h + mlp(ffn_norm(h))``.

    Args:
        config: Model shape.
    """

    def __init__(self, config: SeedConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.dim)
        self.attention = nn.MultiheadAttention(config.dim, config.n_heads, batch_first=True)
        self.ffn_norm = nn.LayerNorm(config.dim)
        self.mlp = MLP(config.dim, config.ffn_mult * config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Transforms ``x`` ([batch, seq, dim]); the output has the same shape."""
        seq = x.shape[1]
        # True marks a masked (future) position. Built here rather than stored as a buffer so
        # the block holds parameters only and builds on any device, meta included.
        causal_mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        h = self.attention_norm(x)
        attn, _ = self.attention(h, h, h, attn_mask=causal_mask, need_weights=False, is_causal=True)
        h = x + attn
        return h + self.mlp(self.ffn_norm(h))


class SeedTransformer(nn.Module):
    """Plain pre-norm decoder-only transformer, the zoo's reference model.

    Module tree: ``embedding`` -> ``transformer_layers[i]`` (:class:`Block`) -> ``norm`` ->
    ``output``. There are no positional embeddings; order comes from the causal mask only.

    Args:
        config: Model shape.

    Attributes:
        config: The :class:`SeedConfig` the model was built from.
    """

    def __init__(self, config: SeedConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.dim)
        self.transformer_layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Maps token ids ([batch, seq], int64) to next-token logits ([batch, seq, vocab])."""
        h = self.embedding(tokens)
        for layer in self.transformer_layers:
            h = layer(h)
        return self.output(self.norm(h))


def seed_transformer(config: SeedConfig | None = None) -> SeedTransformer:
    """Builds a :class:`SeedTransformer` (default: full size, about 1.41B parameters)."""
    return SeedTransformer(config if config is not None else SeedConfig())


def seed_transformer_tiny() -> SeedTransformer:
    """Builds a :class:`SeedTransformer` with :data:`SEED_TINY_CONFIG`."""
    return SeedTransformer(SEED_TINY_CONFIG)
