"""A Llama decoder whose feed-forward layers are routed mixtures of experts (Qwen3-MoE's shape).

The blocks are the zoo Llama's (`planc/zoo/llama3.py`: RMSNorm, grouped-query attention with
rotary positions, separate `wq`/`wk`/`wv`/`wo` viewed with the local head count, so tensor
parallelism and sequence parallelism apply as in `plans/zoo-llama-tp.plan`) with the
feed-forward replaced by the routed MoE of `planc/zoo/routed.py` (a top-k router, experts as
3-D weights run on their own tokens). The case expert x tensor parallelism is for: attention
split over the tensor axis, experts placed whole over the expert axis (plans/qwen3-moe-ep-tp.plan);
and expert x context parallelism: the forward takes each rank's global `positions=` (the `context`
style on `layers.*.attention`), the experts borrow the context ranks (plans/qwen3-moe-long-context.plan).

Module tree (torchtitan's names): `tok_embeddings` -> `layers[i]` (`attention_norm`,
`attention.{wq,wk,wv,wo}`, `ffn_norm`, `moe`: `router.gate`, `experts.w1/w2/w3`) -> `norm` -> `output`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from planc.zoo.llama3 import Attention, Llama, LlamaConfig, RMSNorm
from planc.zoo.routed import RoutedMoE


@dataclass(frozen=True)
class MoELlamaConfig(LlamaConfig):
    """A :class:`LlamaConfig` (``hidden_dim`` is each expert's hidden width) with its experts.

    Attributes:
        num_experts: Routed experts per MoE layer.
        top_k: Experts each token is routed to; at most ``num_experts``.
    """

    num_experts: int = 8
    top_k: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and num_experts ({self.num_experts})")


class MoELlamaBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(attention_norm(x))``, then ``h + moe(ffn_norm(h))``."""

    def __init__(self, config: MoELlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.moe = RoutedMoE(config.dim, config.num_experts, config.hidden_dim, config.top_k)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Transforms ``x`` ([batch, seq, dim]); the output has the same shape."""
        h = x + (self.attention(self.attention_norm(x)) if positions is None
                 else self.attention(self.attention_norm(x), positions=positions))
        return h + self.moe(self.ffn_norm(h))


class MoELlama(Llama):
    """The zoo Llama's decoder of :class:`MoELlamaBlock` (see the module docstring for its tree; its
    forward takes ``positions=`` for context parallelism, where each rank's MoE layers route its own
    tokens); output not tied."""

    block = MoELlamaBlock


# Qwen3-30B-A3B's routing and widths (Qwen's config.json: 48 layers of width 2048, 128 experts,
# 8 per token, expert width 768, 32 query and 4 KV heads, vocabulary 151936), with the zoo
# Llama's attention (head dim 2048 / 32 = 64 where Qwen3 has 128, no q/k norms): about 30.1B parameters.
QWEN3_MOE_CONFIG = MoELlamaConfig(vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                                  hidden_dim=768, rope_theta=1000000.0, norm_eps=1e-6, num_experts=128, top_k=8)
# 4 query and 2 KV heads (tensor 2 splits both), 4 experts of top-2 (expert 2 keeps 2 per rank).
MOE_LLAMA_TINY_CONFIG = MoELlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64,
                                       num_experts=4, top_k=2)


def moe_llama(config: MoELlamaConfig | None = None) -> MoELlama:
    """Builds a :class:`MoELlama` (default: :data:`QWEN3_MOE_CONFIG`; build it on meta, 120 GB in fp32)."""
    return MoELlama(config if config is not None else QWEN3_MOE_CONFIG)


def moe_llama_tiny() -> MoELlama:
    """Builds a :class:`MoELlama` with :data:`MOE_LLAMA_TINY_CONFIG`."""
    return MoELlama(MOE_LLAMA_TINY_CONFIG)
