"""A Llama-3-style decoder ready for tensor parallelism, under torchtitan's module names."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from planc.zoo.layers import _check_heads


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a :class:`Llama` (defaults: the Llama 3.2 1B shape, output not tied).

    Attributes:
        vocab_size: Number of token ids.
        dim: Model (residual stream) width.
        n_layers: Number of transformer blocks.
        n_heads: Query heads per block; must divide ``dim``.
        n_kv_heads: Key/value heads per block (grouped-query attention); must divide
            ``n_heads``.
        hidden_dim: Hidden width of the SwiGLU feed-forward layer.
        rope_theta: Base of the rotary position frequencies.
        norm_eps: Epsilon of every RMSNorm.
    """

    vocab_size: int = 128256
    dim: int = 2048
    n_layers: int = 16
    n_heads: int = 32
    n_kv_heads: int = 8
    hidden_dim: int = 8192
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        _check_heads(self.dim, self.n_heads)
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if (self.dim // self.n_heads) % 2 != 0:
            raise ValueError(f"the head dimension ({self.dim // self.n_heads}) must be even for rotary positions")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads


# 4 query heads and 2 KV heads: tensor parallelism of degree 2 splits both.
LLAMA_TINY_CONFIG = LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128)


RMSNorm = nn.RMSNorm  # torch's own; its `reset_parameters` sets the weight to ones


def _rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles at ``positions``, each ``[seq, head_dim // 2]`` (fp32, built per call)."""
    device = positions.device
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(positions.to(torch.float32), freqs)
    return angles.cos(), angles.sin()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates each (even, odd) pair of ``x`` ([batch, seq, heads, head_dim]) by its position's angle."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary positions and separate q/k/v/o projections.

    Written for tensor parallelism, as torchtitan's and Hugging Face's are: the projections
    are viewed with ``view(batch, seq, -1, head_dim)``, so under colwise ``wq``/``wk``/``wv``
    each rank works on its local heads, and the number of query heads per KV head is read
    from the local shapes. The sequence length comes from the input, which under sequence
    parallelism is made whole (``Replicate``) before this module runs.

    Args:
        config: Model shape.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Attends each position of ``x`` ([batch, seq, dim]) to itself and earlier ones.

        ``positions`` ([seq], int64): the global position of each row of ``x`` (default
        ``arange(seq)``); a context-parallel shard passes its own (`planc.backends.context`).
        """
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if positions is None:
            positions = torch.arange(seq, device=q.device)
        cos, sin = _rotary(positions, self.head_dim, self.rope_theta)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        repeats = q.shape[1] // k.shape[1]  # query heads per KV head, from the (local) shapes
        if repeats > 1:
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU feed-forward layer: ``w2(silu(w1(x)) * w3(x))``.

    Args:
        dim: Input and output width.
        hidden_dim: Hidden width.
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the layer to the last dimension of ``x``."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm Llama block: ``h = x + attention(attention_norm(x))``, then ``h + feed_forward(ffn_norm(h))``.

    Args:
        config: Model shape.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.hidden_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Transforms ``x`` ([batch, seq, dim]); the output has the same shape."""
        h = x + (self.attention(self.attention_norm(x)) if positions is None
                 else self.attention(self.attention_norm(x), positions=positions))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Llama-3-style decoder with torchtitan's module names, ready for tensor parallelism.

    Module tree: ``tok_embeddings`` -> ``layers[i]`` (:class:`TransformerBlock`: ``attention_norm``,
    ``attention.{wq,wk,wv,wo}``, ``ffn_norm``, ``feed_forward.{w1,w2,w3}``) -> ``norm`` ->
    ``output`` (not tied). Bias-free; rotary angles are computed in ``forward`` (no buffers).
    Every module takes one tensor and returns one, so torchtitan's Llama 3 TP plan (sequence
    parallel norms, ``PrepareModuleInput`` on attention and feed-forward, loss parallel on
    ``output``) applies as written.

    Args:
        config: Model shape.

    Attributes:
        config: The :class:`LlamaConfig` the model was built from.
    """

    block = TransformerBlock  # what `layers` holds (planc.zoo.moe_llama's subclass: a routed MoE block)

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(self.block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Maps token ids ([batch, seq], int64) to next-token logits ([batch, seq, vocab]).

        ``positions`` ([seq]): the global positions of ``tokens`` when they are a shard of a
        longer sequence (context parallelism); by default ``arange(seq)``.
        """
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h) if positions is None else layer(h, positions=positions)
        return self.output(self.norm(h))


def llama(config: LlamaConfig | None = None) -> Llama:
    """Builds a :class:`Llama` (default: the Llama 3.2 1B shape, untied, about 1.50B parameters)."""
    return Llama(config if config is not None else LlamaConfig())


# Llama 3 8B's shape (Meta's release: 32 blocks of width 4096, 32 query and 8 KV heads, SwiGLU
# 14336, vocabulary 128256, RoPE theta 500000), about 8.03B parameters.
LLAMA3_8B_CONFIG = LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336)


def llama3_8b() -> Llama:
    """Builds a :class:`Llama` with :data:`LLAMA3_8B_CONFIG` (build it on meta: 32 GB in fp32)."""
    return Llama(LLAMA3_8B_CONFIG)


def llama_tiny() -> Llama:
    """Builds a :class:`Llama` with :data:`LLAMA_TINY_CONFIG`."""
    return Llama(LLAMA_TINY_CONFIG)


# Llama 3.1 405B (torchtitan's `llama3_405b` / Meta's params.json: dim 16384, 126 layers, 128 query
# heads, 8 KV heads, FFN 53248 = 1.3 x 8/3 x 16384 rounded up to a multiple of 4096).
LLAMA3_405B_CONFIG = LlamaConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                                 hidden_dim=53248)


def llama3_405b() -> Llama:
    """Builds the Llama 3.1 405B shape on the meta device (no memory: for planning, never training)."""
    with torch.device("meta"):
        return Llama(LLAMA3_405B_CONFIG)
