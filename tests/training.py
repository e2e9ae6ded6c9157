"""The one training loop of the multi-rank tests and of their unsharded references.

`train(model, batches(model), rank, world, loss=..., clip=...)` runs AdamW steps in which
each rank takes its slice of every global batch, so a sharded run on `world` ranks and the
unsharded reference (rank 0 of 1) see the same tokens and should take the same steps. The
callers differ only in how the loss is taken (`loss`) and whether gradients are clipped:
tests/apply_workers.py (zoo models: `next_token_loss`, clipped) and tests/test_hf_dist.py
(Hugging Face models: the model's own loss from `labels=`, unclipped).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

STEPS = 3
GLOBAL_BATCH = 4
SEQ = 16
LR = 1e-2
MAX_NORM = 0.5  # small enough that clipping engages on these tiny models

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]
ClipFn = Callable[[nn.Module, float, int], torch.Tensor]


def batches(model: nn.Module, steps: int = STEPS) -> list[torch.Tensor]:
    """The global batches of a run: the same on every rank and in the reference.

    Counting sequences (`t, t+1, t+2, ...` mod vocab) from random starts: learnable within
    a few steps, so a falling loss shows that the model really trains.
    """
    gen = torch.Generator().manual_seed(1234)
    vocab = model.config.vocab_size
    return [(torch.randint(0, vocab, (GLOBAL_BATCH, 1), generator=gen) + torch.arange(SEQ)) % vocab
            for _ in range(steps)]


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a zoo model's logits against the next token."""
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def clip_grad_norm(model: nn.Module, max_norm: float, world: int) -> torch.Tensor:
    """torch's own clipping (DTensor-aware): the total norm before clipping."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def train(model: nn.Module, data: list[torch.Tensor], rank: int = 0, world: int = 1, *,
          loss: LossFn = next_token_loss, clip: ClipFn | None = clip_grad_norm) -> dict:
    """AdamW steps; each rank takes its slice of every global batch.

    FSDP averages gradients over ranks, so with equal slices the update equals the one of
    the mean loss over the global batch, as in DDP. `clip(model, MAX_NORM, world)` clips the
    gradients and returns their total norm before clipping; `clip=None` does not clip.
    Returns the global losses (the mean over ranks) and the norms (empty without `clip`).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    per_rank = GLOBAL_BATCH // world
    losses, norms = [], []
    for tokens in data:
        local = tokens[rank * per_rank:(rank + 1) * per_rank]
        value = loss(model, local)
        value.backward()
        norm = clip(model, MAX_NORM, world) if clip is not None else None
        opt.step()
        opt.zero_grad()
        value = value.detach().clone()
        if world > 1:
            dist.all_reduce(value)  # gloo has no AVG
            value /= world
        if norm is not None:
            norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        losses.append(value.item())
    return {"losses": losses, "norms": norms}
