"""What each activation-checkpointing mode of a plan means, for every backend to use the same.

`full` recomputes a module's whole forward in backward. `selective` (op-level selective
activation checkpointing, as torchtitan's `selective` mode and torch's
`create_selective_checkpoint_contexts`) keeps the outputs of the compute-heavy ops (matrix
multiplies and attention) and recomputes the rest (norms, activations, elementwise ops),
which costs little time and keeps most of the memory saving. The runtime and the traced
step pass `context_fn(mode)` to torch's composable `checkpoint`; `planc emit` prints the
functions below as they are written here (`inspect.getsource`), so the three cannot differ.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# Ops whose outputs `selective` keeps: the matrix multiplies and attention kernels a
# transformer's time goes to (the CPU and GPU spellings of attention both).
SAVED_OPS = frozenset(op for op in (
    getattr(_aten, name, None) for name in (
        "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention")) if op is not None)


def save_compute_heavy_ops(ctx, func, *args, **kwargs):
    """Selective checkpointing policy: keep matmul and attention outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if func.overloadpacket in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_context():
    """The `context_fn` for torch's checkpoint that applies `save_compute_heavy_ops`."""
    return create_selective_checkpoint_contexts(save_compute_heavy_ops)


def context_fn(mode: str):
    """The `context_fn` argument of `checkpoint(module, ...)` for a plan's mode (None: full)."""
    return selective_checkpoint_context if mode == "selective" else None
