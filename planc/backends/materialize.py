"""Allocate a model sharded on the meta device and initialise it: `planc.materialize`."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

__all__ = ["materialize"]


def materialize(model: nn.Module, device: torch.device | str,
                init: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Allocate a meta-built (and usually sharded) model on `device` and initialise it.

    The flow: build on meta, `apply` (shards on meta, allocates nothing), then this:
    `model.to_empty(device=device)` allocates each rank's local shards only (those of
    units offloaded to the CPU on the CPU), then, under
    `torch.no_grad()`, `init(model)` if given, else `reset_parameters()` on every module
    that has one (and `nn.MultiheadAttention._reset_parameters()`, which has no public
    one), children before parents as when the model was built; a tied parameter is
    initialised by its first owner only. Models with `tie_weights()` (the zoo GPT) are
    re-tied afterwards, as `to_empty` makes one new tensor per registration.

    Initialisation runs on local shards, so values differ from an unsharded build with the
    same seed (on a CPU mesh DTensor's random ops draw each shard from the rank's own
    generator, so shards of one parameter can repeat values; pass `init` if that matters);
    to reproduce an unsharded run exactly, build on the CPU with the same seed on
    every rank and apply the plan to that instead.

    Args:
        model: the model, parameters on meta.
        device: where to allocate (e.g. `"cpu"`, `torch.device("cuda", local_rank)`).
        init: your own initialiser, called with the whole model.

    Returns:
        The same model.
    """
    # Units offloaded to the CPU keep their local shards there (FSDP2 moves them back only
    # when pinning); everything else goes to `device`. This is `to_empty`, per parameter.
    offloaded = _offloaded_params(model)
    model._apply(lambda t: torch.empty_like(t, device="cpu" if id(t) in offloaded else device))
    with torch.no_grad():
        if init is not None:
            init(model)
        else:
            done: set[int] = set()
            # NOTE: post-order, as modules initialise when built: children first, then the
            # parent (MultiheadAttention zeroes `out_proj.bias` after out_proj's own init).
            for module in _post_order(model):
                own = [id(p) for p in module._parameters.values() if p is not None]
                # A tied parameter is initialised by its first owner only, as a model that
                # ties after building (`lm_head.weight = wte.weight`) keeps the first one.
                if own and all(i in done for i in own):
                    continue
                if isinstance(module, nn.MultiheadAttention):
                    module._reset_parameters()
                elif callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()
                else:
                    continue
                done.update(own)
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()
    return model


def _offloaded_params(model: nn.Module) -> set[int]:
    """Ids of the sharded parameters of units with a `CPUOffloadPolicy`."""
    out: set[int] = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                if isinstance(group.offload_policy, CPUOffloadPolicy):
                    out.update(id(fsdp_param.sharded_param) for fsdp_param in group.fsdp_params)
    return out


def _post_order(module: nn.Module) -> Iterable[nn.Module]:
    """Each module once, children (in registration order) before their parent."""
    seen: set[int] = set()

    def visit(m: nn.Module):
        for child in m.children():
            if id(child) not in seen:
                seen.add(id(child))
                yield from visit(child)
        yield m
    return visit(module)
