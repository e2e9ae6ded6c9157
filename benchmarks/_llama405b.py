"""Llama-3-405B-shaped decoder for meta-device benchmarks (module names as in torchtitan).

The apply and compile benchmarks need a model with the size and module count of a real
frontier job -- 126 blocks, about 1,500 modules, 406B parameters -- without the memory. Build it
under ``torch.device("meta")``: no storage is allocated and building takes about a second.

Module tree (torchtitan's Llama3 names): ``tok_embeddings`` -> ``layers.N`` (``attention_norm``,
``attention.{wq,wk,wv,wo}``, ``ffn_norm``, ``feed_forward.{w1,w2,w3}``) -> ``norm`` ->
``output``. Differences from torchtitan, on purpose: ``layers`` is an ``nn.ModuleList`` (same
dotted names), and there is no rotary ``freqs_cis`` buffer, so the model holds parameters only
(position information does not matter for sharding or benchmark timing).

Example:
    >>> import torch
    >>> with torch.device("meta"):
    ...     model = llama405b()
    >>> sum(p.numel() for p in model.parameters()) / 1e9  # doctest: +ELLIPSIS
    405.8...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Llama405BConfig", "LLAMA_405B", "Attention", "FeedForward", "TransformerBlock",
           "Llama", "llama405b"]


@dataclass(frozen=True)
class Llama405BConfig:
    """Shape of a :class:`Llama` (defaults: Llama 3.1 405B).

    Attributes:
        vocab_size: Number of token ids.
        dim: Model (residual stream) width.
        n_layers: Number of transformer blocks.
        n_heads: Query heads; must divide ``dim``.
        n_kv_heads: Key/value heads (grouped-query attention); must divide ``n_heads``.
        ffn_hidden_dim: Hidden width of the SwiGLU feed-forward layer.
        norm_eps: RMSNorm epsilon.
    """

    vocab_size: int = 128256
    dim: int = 16384
    n_layers: int = 126
    n_heads: int = 128
    n_kv_heads: int = 8
    ffn_hidden_dim: int = 53248
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError("n_heads must divide dim and n_kv_heads must divide n_heads")


LLAMA_405B = Llama405BConfig()


class Attention(nn.Module):
    """Grouped-query causal self-attention with bias-free projections ``wq, wk, wv, wo``."""

    def __init__(self, config: Llama405BConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attends each position of ``x`` ([batch, seq, dim]) to itself and earlier ones."""
        batch, seq, _ = x.shape
        # -1, not the global head counts: under tensor parallelism each rank holds n_heads / tp
        # heads (torchtitan's forward; `planc check --simulate` reports P440 on the global count)
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        # Each key/value head serves n_heads / n_kv_heads query heads.
        repeat = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU feed-forward layer: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the layer to the last dimension of ``x``."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(attention_norm(x))``, then ``h + ffn(ffn_norm(h))``."""

    def __init__(self, config: Llama405BConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Transforms ``x`` ([batch, seq, dim]); the output has the same shape."""
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Llama-3-style decoder: ``tok_embeddings`` -> ``layers[i]`` -> ``norm`` -> ``output``.

    Args:
        config: Model shape.

    Attributes:
        config: The :class:`Llama405BConfig` the model was built from.
    """

    def __init__(self, config: Llama405BConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Maps token ids ([batch, seq], int64) to next-token logits ([batch, seq, vocab])."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def llama405b(n_layers: int = 126) -> Llama:
    """Builds the 405B-shaped model on the caller's device (use ``torch.device("meta")``).

    Args:
        n_layers: Number of blocks; fewer than 126 gives a shallower model of the same width
            (for quick runs).
    """
    return Llama(Llama405BConfig(n_layers=n_layers))


# torchtitan's FSDP recipe for these module names, as a plan (shared by the benchmarks).
TORCHTITAN_PLAN = """\
model benchmarks._llama405b:llama405b
mesh (replicate = 1, shard = *)
defaults {
  precision param = bf16, reduce = fp32, cast_inputs = false
  reshard after_forward = true
}
unit tok_embeddings
unit layers.*
unit [norm, output] { reshard after_forward = false }
root { reshard after_forward = false }
expect unit layers.*
"""
