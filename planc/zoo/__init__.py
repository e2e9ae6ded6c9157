"""Built-in model zoo: small, dependency-free transformers that sharding plans are written against.

The quick start, the documentation and the test-suite (including multi-process FSDP2 tests on
CPU with gloo) all need a few well-known module trees to point plans at. This module provides
six families, each in a full size and a tiny size:

* ``seed_transformer`` -- a plain pre-norm decoder built from ``nn.MultiheadAttention``
  (about 1.41B parameters at full size). Its attribute names (``embedding``,
  ``transformer_layers``, ``norm``, ``output``) are the ones the example plans use.
* ``gpt`` -- a GPT-2-small-like decoder (124M parameters) whose input and output embeddings are
  *tied*, the classic case a sharding plan must keep in one FSDP group.
* ``moe_transformer`` -- a decoder whose feed-forward layers are mixtures of experts, with the
  expert weights stored as 3-D tensors that have a leading expert dimension (the case that
  calls for ``Shard(1)`` or other non-default placements). Every expert runs on every token.
* ``llama`` -- a Llama-3-style decoder ready for tensor parallelism (about 1.50B parameters at
  full size, the Llama 3.2 1B shape with an untied output): RMSNorm, separate ``wq``/``wk``/
  ``wv``/``wo`` with grouped-query attention and rotary positions, a SwiGLU feed-forward
  ``w1``/``w2``/``w3``, under torchtitan's module names, so torchtitan-style TP plans read
  the same. Its attention views projections with the *local* head count (``view(b, s, -1,
  head_dim)``) and takes the sequence length from its input, so colwise q/k/v, sequence
  parallelism and loss parallelism all work (``plans/zoo-llama-tp.plan``).
* ``routed_moe`` -- a *routed* mixture of experts (64 experts, top-6 at full size): a top-k
  router, tokens sorted by expert, each expert run only on its own tokens by a grouped matmul
  (``planc::grouped_mm``), torchtitan's module names and 3-D expert layout.
* ``moe_llama`` -- the Llama above with routed MoE layers for feed-forward (Qwen3-30B-A3B's
  shape at full size: 128 experts, top-8, 48 layers, about 30.1B parameters): tensor-parallel
  attention beside expert-parallel experts (``plans/qwen3-moe-ep-tp.plan``).

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

from typing import Callable

import torch
from torch import nn

from planc.zoo.gpt import GPT, GPT_TINY_CONFIG, GPTBlock, GPTConfig, gpt, gpt_tiny
from planc.zoo.layers import MLP, CausalSelfAttention
from planc.zoo.llama3 import (
    LLAMA3_8B_CONFIG,
    LLAMA3_405B_CONFIG,
    LLAMA_TINY_CONFIG,
    Attention,
    FeedForward,
    Llama,
    LlamaConfig,
    RMSNorm,
    TransformerBlock,
    llama,
    llama3_8b,
    llama3_405b,
    llama_tiny,
)
from planc.zoo.moe import (
    MOE_TINY_CONFIG,
    GroupedExperts,
    MoE,
    MoEBlock,
    MoEConfig,
    MoETransformer,
    moe_transformer,
    moe_transformer_tiny,
)
from planc.zoo.moe_llama import MOE_LLAMA_TINY_CONFIG, QWEN3_MOE_CONFIG, MoELlama, moe_llama, moe_llama_tiny
from planc.zoo.routed import ROUTED_MOE_TINY_CONFIG, RoutedMoETransformer, routed_moe, routed_moe_tiny
from planc.zoo.seed import SEED_TINY_CONFIG, Block, SeedConfig, SeedTransformer, seed_transformer, seed_transformer_tiny

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
    "LLAMA3_8B_CONFIG",
    "RMSNorm",
    "Attention",
    "FeedForward",
    "TransformerBlock",
    "Llama",
    "llama",
    "llama_tiny",
    "llama3_405b",
    "LLAMA3_405B_CONFIG",
    "llama3_8b",
    "seed_transformer",
    "seed_transformer_tiny",
    "gpt",
    "gpt_tiny",
    "moe_transformer",
    "moe_transformer_tiny",
    "RoutedMoETransformer",
    "ROUTED_MOE_TINY_CONFIG",
    "routed_moe",
    "routed_moe_tiny",
    "MoELlama",
    "MOE_LLAMA_TINY_CONFIG",
    "QWEN3_MOE_CONFIG",
    "moe_llama",
    "moe_llama_tiny",
    "example_input",
    "ZOO",
]


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
    return torch.randint(0, config.vocab_size, (batch, seq), generator=generator, dtype=torch.long, device="cpu")


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
    "llama3_405b": llama3_405b,
    "llama3_8b": llama3_8b,  # the Llama 3 8B shape (plans/llama3-8b-long-context.plan); tiny: llama_tiny
    "routed_moe": routed_moe,
    "routed_moe_tiny": routed_moe_tiny,
    "moe_llama": moe_llama,  # Qwen3-30B-A3B's shape (plans/qwen3-moe-ep-tp.plan)
    "moe_llama_tiny": moe_llama_tiny,
}
