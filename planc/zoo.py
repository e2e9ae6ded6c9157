"""Built-in model zoo: small, dependency-free transformers that sharding plans are written against.

The quick start, the documentation and the test-suite (including multi-process FSDP2 tests on
CPU with gloo) all need a few well-known module trees to point plans at. This module provides
four families, each in a full size and a tiny size:

* ``seed_transformer`` -- a plain pre-norm decoder built from ``nn.MultiheadAttention``
  (about 1.41B parameters at full size). Its attribute names (``embedding``,
  ``transformer_layers``, ``norm``, ``output``) are the ones the example plans use.
* ``gpt`` -- a GPT-2-small-like decoder (124M parameters) whose input and output embeddings are
  *tied*, the classic case a sharding plan must keep in one FSDP group.
* ``moe_transformer`` -- a decoder whose feed-forward layers are mixtures of experts, with the
  expert weights stored as 3-D tensors that have a leading expert dimension (the case that
  calls for ``Shard(1)`` or other non-default placements).
* ``llama`` -- a Llama-3-style decoder ready for tensor parallelism (about 1.50B parameters at
  full size, the Llama 3.2 1B shape with an untied output): RMSNorm, separate ``wq``/``wk``/
  ``wv``/``wo`` with grouped-query attention and rotary positions, a SwiGLU feed-forward
  ``w1``/``w2``/``w3``, under torchtitan's module names, so torchtitan-style TP plans read
  the same. Its attention views projections with the *local* head count (``view(b, s, -1,
  head_dim)``) and takes the sequence length from its input, so colwise q/k/v, sequence
  parallelism and loss parallelism all work (``plans/zoo-llama-tp.plan``).

Design rules that every model here follows, because the compiler and the FSDP2 tests rely on
them:

* Each model takes a frozen dataclass config and keeps it as ``model.config``.
* Building is cheap and storage-free, so ``with torch.device("meta"): seed_transformer()``
  takes well under a second: nothing in ``__init__`` reads tensor values, and causal masks are
  built in ``forward``.
* Parameters are only ever used inside the ``forward`` of the module that owns them, without
  in-place updates or ``.data`` tricks, so ``fully_shard`` can be applied to each block, to
  ``[norm, output]`` as a group and to the root.
* Every custom module that owns parameters directly implements ``reset_parameters()``, so a
  model materialised with ``to_empty`` can be initialised module by module.
* There are no buffers.

Example:
    >>> import torch
    >>> from planc import zoo
    >>> model = zoo.gpt_tiny()
    >>> tokens = zoo.example_input(model, batch=2, seq=16)
    >>> model(tokens).shape
    torch.Size([2, 16, 128])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "SeedConfig",
    "GPTConfig",
    "MoEConfig",
    "SEED_TINY_CONFIG",
    "GPT_TINY_CONFIG",
    "MOE_TINY_CONFIG",
    "MLP",
    "Block",
    "SeedTransformer",
    "CausalSelfAttention",
    "GPTBlock",
    "GPT",
    "GroupedExperts",
    "MoE",
    "MoEBlock",
    "MoETransformer",
    "LlamaConfig",
    "LLAMA_TINY_CONFIG",
    "RMSNorm",
    "Attention",
    "FeedForward",
    "TransformerBlock",
    "Llama",
    "llama",
    "llama_tiny",
    "seed_transformer",
    "seed_transformer_tiny",
    "gpt",
    "gpt_tiny",
    "moe_transformer",
    "moe_transformer_tiny",
    "example_input",
    "ZOO",
]


# --------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------


def _check_heads(dim: int, n_heads: int) -> None:
    """Raises ``ValueError`` unless ``dim`` splits evenly into ``n_heads`` attention heads."""
    if dim % n_heads != 0:
        raise ValueError(f"dim ({dim}) must be divisible by n_heads ({n_heads})")


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


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT` (defaults: GPT-2 small).

    Attributes:
        vocab_size: Number of token ids.
        dim: Model (residual stream) width.
        n_layers: Number of transformer blocks.
        n_heads: Attention heads per block; must divide ``dim``.
        context_length: Number of learned positions, i.e. the longest accepted sequence.
        ffn_mult: Hidden width of the MLP as a multiple of ``dim``.
    """

    vocab_size: int = 50257
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    context_length: int = 1024
    ffn_mult: int = 4

    def __post_init__(self) -> None:
        _check_heads(self.dim, self.n_heads)


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
            raise ValueError(
                f"top_k ({self.top_k}) must be between 1 and num_experts ({self.num_experts})"
            )


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


# Tiny shapes for fast (multi-process) tests. Every size, including derived ones such as the
# MLP width and the fused qkv width, is divisible by 2 and 4 so that any parameter dimension
# can be sharded over 2 or 4 ranks.
SEED_TINY_CONFIG = SeedConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4)
GPT_TINY_CONFIG = GPTConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, context_length=64)
MOE_TINY_CONFIG = MoEConfig(
    vocab_size=128, dim=32, n_layers=2, n_heads=4, num_experts=4, hidden_dim=64, top_k=2
)
# 4 query heads and 2 KV heads: tensor parallelism of degree 2 splits both.
LLAMA_TINY_CONFIG = LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128)


# --------------------------------------------------------------------------------------------
# Shared layers
# --------------------------------------------------------------------------------------------


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
        q, k, v = (
            self.qkv(x)
            .view(batch, seq, 3, self.n_heads, dim // self.n_heads)
            .permute(2, 0, 3, 1, 4)
            .unbind(0)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, dim))


# --------------------------------------------------------------------------------------------
# Seed transformer
# --------------------------------------------------------------------------------------------


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
        attn, _ = self.attention(
            h, h, h, attn_mask=causal_mask, need_weights=False, is_causal=True
        )
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


# --------------------------------------------------------------------------------------------
# GPT (tied embeddings)
# --------------------------------------------------------------------------------------------


class GPTBlock(nn.Module):
    """Pre-norm GPT-2 block: ``h = x + attn(ln_1(x))`` and then ``h + mlp(ln_2(h))``.

    Args:
        config: Model shape.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.dim)
        self.attn = CausalSelfAttention(config.dim, config.n_heads)
        self.ln_2 = nn.LayerNorm(config.dim)
        self.mlp = MLP(config.dim, config.ffn_mult * config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Transforms ``x`` ([batch, seq, dim]); the output has the same shape."""
        h = x + self.attn(self.ln_1(x))
        return h + self.mlp(self.ln_2(h))


class GPT(nn.Module):
    """GPT-2-style decoder whose output projection shares its weight with the token embedding.

    Module tree: ``wte`` + ``wpe`` -> ``blocks[i]`` (:class:`GPTBlock`) -> ``ln_f`` ->
    ``lm_head``, with ``lm_head.weight is wte.weight``. Because the weight is shared,
    ``model.parameters()`` yields it once, under the name ``wte.weight``, and a sharding plan
    must keep ``wte`` and ``lm_head`` in the same FSDP group (for example the root's):
    wrapping ``lm_head`` alone would move the shared weight out of the group that is gathered
    when ``wte`` runs.

    Keeping the tie: ``nn.Module.to_empty`` (materialising a meta-device model) and
    ``load_state_dict(..., assign=True)`` replace each module's parameter separately and would
    silently untie the two. The model re-ties itself after both (see :meth:`_apply` and the
    load-state-dict post-hook registered in ``__init__``); after any other surgery that swaps
    parameters, call :meth:`tie_weights`. Since ``to_empty`` leaves values uninitialised, the
    caller initialises the shared weight afterwards, like every other parameter.

    Args:
        config: Model shape.

    Attributes:
        config: The :class:`GPTConfig` the model was built from.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.dim)
        self.wpe = nn.Embedding(config.context_length, config.dim)
        self.blocks = nn.ModuleList(GPTBlock(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()
        self.reset_parameters()
        self.register_load_state_dict_post_hook(GPT._retie_after_load)

    def reset_parameters(self) -> None:
        """GPT-2's embedding init, N(0, 0.02), for the shared token/output weight and positions.

        nn.Embedding's own N(0, 1) makes a tied output projection start with logits of
        magnitude ~sqrt(dim) and losses far above log(vocab). Runs after the children's
        own `reset_parameters` (materialisation initialises children first).
        """
        with torch.no_grad():
            nn.init.normal_(self.wte.weight, std=0.02)
            nn.init.normal_(self.wpe.weight, std=0.02)

    def tie_weights(self) -> None:
        """Makes ``lm_head`` use the token embedding's weight (``wte.weight`` wins)."""
        self.lm_head.weight = self.wte.weight

    def _apply(self, fn, recurse: bool = True):
        # nn.Module._apply backs .to(), .float(), .to_empty(), ... Conversions that must build
        # new Parameter objects (to_empty from meta does) build one per module, which unties
        # wte and lm_head; restore the tie once every submodule has been converted.
        # FSDP2's FSDPModule._apply wraps this one and re-reads the parameters afterwards.
        super()._apply(fn, recurse)
        self.tie_weights()
        return self

    @staticmethod
    def _retie_after_load(module: GPT, incompatible_keys) -> None:
        """Post-hook of ``load_state_dict``: ``assign=True`` loads the two keys separately."""
        module.tie_weights()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Maps token ids ([batch, seq], int64) to next-token logits ([batch, seq, vocab]).

        Raises:
            ValueError: If ``seq`` exceeds ``config.context_length``.
        """
        seq = tokens.shape[1]
        if seq > self.config.context_length:
            raise ValueError(
                f"sequence length {seq} exceeds context_length {self.config.context_length}"
            )
        positions = torch.arange(seq, device=tokens.device)
        h = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))


# --------------------------------------------------------------------------------------------
# Mixture-of-experts transformer
# --------------------------------------------------------------------------------------------


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
        gates = torch.zeros_like(probs).scatter(
            -1, top_idx, top_probs / top_probs.sum(dim=-1, keepdim=True)
        )
        expert_out = self.experts(tokens)  # [E, T, dim]
        mixed = torch.einsum("etd,te->td", expert_out, gates)
        return mixed.view_as(x)


class MoEBlock(nn.Module):
    """Pre-norm block with a mixture-of-experts feed-forward layer.

    Computes ``h = x + attention(attention_norm(x))`` and then ``h + moe(ffn_norm(h))``.

    Args:
        config: Model shape.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim)
        self.attention = CausalSelfAttention(config.dim, config.n_heads, bias=False)
        self.ffn_norm = nn.RMSNorm(config.dim)
        self.moe = MoE(config.dim, config.num_experts, config.hidden_dim, config.top_k)

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

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(MoEBlock(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Maps token ids ([batch, seq], int64) to next-token logits ([batch, seq, vocab])."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# --------------------------------------------------------------------------------------------
# Llama (tensor-parallel ready)
# --------------------------------------------------------------------------------------------


RMSNorm = nn.RMSNorm  # torch's own; its `reset_parameters` sets the weight to ones


def _rotary(seq: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each ``[seq, head_dim // 2]`` (fp32, built per call: no buffer)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), freqs)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attends each position of ``x`` ([batch, seq, dim]) to itself and earlier ones."""
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        cos, sin = _rotary(seq, self.head_dim, self.rope_theta, q.device)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Transforms ``x`` ([batch, seq, dim]); the output has the same shape."""
        h = x + self.attention(self.attention_norm(x))
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

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Maps token ids ([batch, seq], int64) to next-token logits ([batch, seq, vocab])."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# --------------------------------------------------------------------------------------------
# Builders, inputs and the registry
# --------------------------------------------------------------------------------------------


def seed_transformer(config: SeedConfig | None = None) -> SeedTransformer:
    """Builds a :class:`SeedTransformer` (default: full size, about 1.41B parameters)."""
    return SeedTransformer(config if config is not None else SeedConfig())


def seed_transformer_tiny() -> SeedTransformer:
    """Builds a :class:`SeedTransformer` with :data:`SEED_TINY_CONFIG`."""
    return SeedTransformer(SEED_TINY_CONFIG)


def gpt(config: GPTConfig | None = None) -> GPT:
    """Builds a :class:`GPT` (default: GPT-2 small shape, about 124M parameters)."""
    return GPT(config if config is not None else GPTConfig())


def gpt_tiny() -> GPT:
    """Builds a :class:`GPT` with :data:`GPT_TINY_CONFIG`."""
    return GPT(GPT_TINY_CONFIG)


def moe_transformer(config: MoEConfig | None = None) -> MoETransformer:
    """Builds a :class:`MoETransformer` (default: full size, about 653M parameters)."""
    return MoETransformer(config if config is not None else MoEConfig())


def moe_transformer_tiny() -> MoETransformer:
    """Builds a :class:`MoETransformer` with :data:`MOE_TINY_CONFIG`."""
    return MoETransformer(MOE_TINY_CONFIG)


def llama(config: LlamaConfig | None = None) -> Llama:
    """Builds a :class:`Llama` (default: the Llama 3.2 1B shape, untied, about 1.50B parameters)."""
    return Llama(config if config is not None else LlamaConfig())


def llama_tiny() -> Llama:
    """Builds a :class:`Llama` with :data:`LLAMA_TINY_CONFIG`."""
    return Llama(LLAMA_TINY_CONFIG)


def example_input(
    model: nn.Module,
    batch: int = 2,
    seq: int = 16,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Returns random token ids that ``model`` accepts.

    The ids are drawn uniformly from ``[0, model.config.vocab_size)`` on the CPU, even under a
    ``torch.device("meta")`` context; move them with ``.to(device)`` if needed.

    Args:
        model: A zoo model (anything with a ``config`` holding ``vocab_size``).
        batch: Number of sequences.
        seq: Tokens per sequence.
        generator: CPU random generator; the global one if ``None``.

    Returns:
        An int64 tensor of shape ``[batch, seq]``.

    Raises:
        ValueError: If ``seq`` is longer than the model's ``context_length`` (GPT only).
    """
    config = model.config
    context_length = getattr(config, "context_length", None)
    if context_length is not None and seq > context_length:
        raise ValueError(f"seq ({seq}) exceeds the model's context_length ({context_length})")
    return torch.randint(
        0, config.vocab_size, (batch, seq), generator=generator, dtype=torch.long, device="cpu"
    )


#: Name -> zero-argument builder, for every model in the zoo.
ZOO: dict[str, Callable[[], nn.Module]] = {
    "seed_transformer": seed_transformer,
    "seed_transformer_tiny": seed_transformer_tiny,
    "gpt": gpt,
    "gpt_tiny": gpt_tiny,
    "moe_transformer": moe_transformer,
    "moe_transformer_tiny": moe_transformer_tiny,
    "llama": llama,
    "llama_tiny": llama_tiny,
}
