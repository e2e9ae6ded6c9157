"""torchtitan's Llama 3 (torchtitan 0.3.0), built from its own configs, for plans and tests.

torchtitan 0.3.0 builds language models with flex or varlen attention only, and flex
attention has no backward on CPU. `cpu_attention=True` (the default) swaps each block's inner
attention for torchtitan's own `ScaledDotProductAttention` (causal), the model otherwise
unchanged: same modules, names, parameters and init. `max_seq_len` sizes the RoPE caches as
torchtitan's trainer does (it sets them to `training.seq_len`).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from planc.model.errors import ModelLoadError


def llama3_config(flavor: str = "debugmodel", *, tied: bool = False, max_seq_len: int = 2048,
                  cpu_attention: bool = True):
    """torchtitan's `Llama3Model.Config` for `flavor` (`debugmodel`, `8B`, ...)."""
    try:
        from torchtitan.models.common.attention import ScaledDotProductAttention
        from torchtitan.models.llama3 import model_registry
    except ImportError as err:
        raise ModelLoadError("torchtitan models need torchtitan: pip install 'planc[torchtitan]'") from err
    cfg = model_registry(flavor, attn_backend="flex").model
    layers = []
    for layer in cfg.layers:
        attention = dataclasses.replace(layer.attention, rope=dataclasses.replace(layer.attention.rope,
                                                                                  max_seq_len=max_seq_len))
        if cpu_attention:
            attention = dataclasses.replace(attention, inner_attention=ScaledDotProductAttention.Config())
        layers.append(dataclasses.replace(layer, attention=attention))
    return dataclasses.replace(cfg, layers=layers, enable_weight_tying=tied)


def llama3(flavor: str = "debugmodel", *, tied: bool = False, max_seq_len: int = 2048,
           cpu_attention: bool = True) -> nn.Module:
    """torchtitan's Llama 3 of `flavor`, built on the current default device."""
    return llama3_config(flavor, tied=tied, max_seq_len=max_seq_len, cpu_attention=cpu_attention).build()


def llama3_debugmodel() -> nn.Module:
    """torchtitan's `debugmodel` (6 layers, dim 256, vocab 2048), untied, RoPE for 2048 tokens."""
    return llama3("debugmodel")


def llama3_debugmodel_tied() -> nn.Module:
    """The same with `enable_weight_tying` (tok_embeddings.weight is lm_head.weight)."""
    return llama3("debugmodel", tied=True)


def llama3_8b() -> nn.Module:
    """torchtitan's Llama 3 8B, RoPE for 2048 tokens."""
    return llama3("8B")
