"""A GPT-2-small-like decoder whose input and output embeddings are tied."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from planc.zoo.layers import MLP, CausalSelfAttention, _check_heads


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


# Tiny shapes for fast (multi-process) tests: every size, including derived ones such as the
# MLP width and the fused qkv width, is divisible by 2 and 4, so any parameter dimension can be
# sharded over 2 or 4 ranks.
GPT_TINY_CONFIG = GPTConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, context_length=64)


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
            raise ValueError(f"sequence length {seq} exceeds context_length {self.config.context_length}")
        positions = torch.arange(seq, device=tokens.device)
        h = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))


def gpt(config: GPTConfig | None = None) -> GPT:
    """Builds a :class:`GPT` (default: GPT-2 small shape, about 124M parameters)."""
    return GPT(config if config is not None else GPTConfig())


def gpt_tiny() -> GPT:
    """Builds a :class:`GPT` with :data:`GPT_TINY_CONFIG`."""
    return GPT(GPT_TINY_CONFIG)
