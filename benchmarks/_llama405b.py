"""The Llama-3.1-405B-shaped decoder the benchmarks build on meta: the zoo's (`planc.zoo:llama3_405b`).

The apply, compile, suggest and time benchmarks need a model with the size and module count of a
real frontier job -- 126 blocks, about 1,500 modules, 406B parameters -- without the memory. This
is `planc/zoo/llama3.py`'s Llama with `LLAMA3_405B_CONFIG` (torchtitan's module names), with the
number of blocks a parameter for quick runs. Build it under ``torch.device("meta")``.

Example:
    >>> import torch
    >>> with torch.device("meta"):
    ...     model = llama405b()
    >>> sum(p.numel() for p in model.parameters()) / 1e9  # doctest: +ELLIPSIS
    405.8...
"""

from __future__ import annotations

import dataclasses

from planc.zoo.llama3 import LLAMA3_405B_CONFIG, Llama

__all__ = ["Llama", "llama405b", "TORCHTITAN_PLAN"]


def llama405b(n_layers: int = 126) -> Llama:
    """Builds the 405B-shaped model on the caller's device (use ``torch.device("meta")``).

    Args:
        n_layers: Number of blocks; fewer than 126 gives a shallower model of the same width
            (for quick runs).
    """
    return Llama(dataclasses.replace(LLAMA3_405B_CONFIG, n_layers=n_layers))


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
