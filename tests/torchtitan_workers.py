"""torchtitan's side of the parity tests: its Llama 3 debug model and its own FSDP recipe.

torchtitan 0.3.0 builds language models with flex or varlen attention only, and flex
attention has no backward on CPU; the CPU tests swap each block's inner attention for
torchtitan's own `ScaledDotProductAttention` (causal), the same model otherwise. The RoPE
cache is cut to `max_seq_len` (131072 in the config) to keep it small.
"""

from __future__ import annotations

import dataclasses

import torch


def llama3_config(tied: bool = False, max_seq_len: int = 64):
    """torchtitan's `debugmodel` Llama 3 config, CPU-trainable (see the module docstring)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    cfg = model_registry("debugmodel", attn_backend="flex").model
    layers = [dataclasses.replace(layer, attention=dataclasses.replace(
        layer.attention, inner_attention=ScaledDotProductAttention.Config(),
        rope=dataclasses.replace(layer.attention.rope, max_seq_len=max_seq_len))) for layer in cfg.layers]
    return dataclasses.replace(cfg, layers=layers, enable_weight_tying=tied)


def llama3_debug(tied: bool = False, max_seq_len: int = 64) -> torch.nn.Module:
    """torchtitan's Llama 3 debug model, built on the current default device."""
    return llama3_config(tied, max_seq_len).build()
