"""Allocate a model sharded on the meta device and initialise it: `planc.materialize`."""

from __future__ import annotations

import inspect
from typing import Callable, Iterable

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from planc.diagnostics import Diagnostic, PlanError

__all__ = ["materialize", "initialiser_of"]

_SHOWN = 5  # modules named in a P606 before "and N more"


def materialize(model: nn.Module, device: torch.device | str,
                init: Callable[[nn.Module], None] | None = None, *, reproducible: bool = False) -> nn.Module:
    """Allocate a meta-built (and usually sharded) model on `device` and initialise it.

    The flow: build on meta, `apply` (shards on meta, allocates nothing), then this:
    `model.to_empty(device=device)` allocates each rank's local shards only (those of
    units offloaded to the CPU on the CPU) and fills them with poison (NaN; the lowest
    value for integer tensors). Then, under `torch.no_grad()`, `init(model)` if given,
    else the model's own initialiser (`initialiser_of`):

    * `model.init_states(buffer_device=device)` or `model.init_weights(buffer_device=device)`
      (torchtitan's models: their init, and their RoPE caches rebuilt);
    * Hugging Face models: `initialize_weights()` (each module's `_init_weights`, which
      also recomputes rotary `inv_freq` buffers), then `tie_weights()`;
    * otherwise `reset_parameters()` on every module that has one (and
      `nn.MultiheadAttention._reset_parameters()`), children before parents as when the
      model was built; a tied parameter is initialised by its first owner only. This is
      the real init only for models built from torch modules without init code of their
      own; anything it misses is caught below.

    Models with `tie_weights()` are re-tied afterwards (`to_empty` makes one tensor per
    registration). Finally every parameter and buffer is checked: one still holding the
    poison was initialised by nothing, and `PlanError` P606 names its modules instead of
    letting training start from garbage (boolean tensors cannot hold poison and are not
    checked; on a rank whose shard of a parameter is empty there is nothing to check).

    Initialisation runs on local shards, so values differ from an unsharded build with the
    same seed (on a CPU mesh DTensor's random ops draw each shard from the rank's own
    generator, so shards of one parameter can repeat values; pass `init` if that matters);
    to reproduce an unsharded run exactly, pass `reproducible=True`, or build on the CPU
    with the same seed on every rank and apply the plan to that instead.

    `reproducible=True` (the `reset_parameters()` initialiser only): each module with a
    `reset_parameters()` is initialised at full size on every rank, its sharded parameters
    swapped for plain full tensors for the call, and each rank keeps its own shard of the
    result (any placements: FSDP's, tensor parallelism's, both). With the same seed on every
    rank the parameters are then exactly those this call gives the unsharded model, whatever
    the plan: an eager build's, for a model whose constructor initialises each module once,
    children first (the zoo's, except GPT: its constructor also draws `lm_head`'s init for
    the weight it then ties to the embedding). It
    costs one module's full parameters in temporary memory (a whole subtree for a module
    whose own init also sets its children's, as the zoo GPT's root does).

    Under a pipeline plan pass the applied plan (`planc.materialize(applied, device)`): each
    of this rank's stages is materialized; the modules of the stages other ranks hold stay on
    meta, nothing of them is allocated.

    Args:
        model: the model, parameters on meta (or a pipeline plan's `PipelinedPlan`).
        device: where to allocate (e.g. `"cpu"`, `torch.device("cuda", local_rank)`).
        init: your own initialiser, called with the whole model.
        reproducible: initialise at full size and keep the local shards (see above).

    Returns:
        The same model.

    Raises:
        PlanError: P606 when some parameter or buffer was left uninitialised.
        ValueError: `reproducible=True` with `init` or a model whose own initialiser is not
            `reset_parameters()` per module.
    """
    if not isinstance(model, nn.Module) and hasattr(model, "stages"):  # a `PipelinedPlan`: this rank's stages
        if reproducible:
            raise ValueError("`reproducible=True` initialises modules in the whole model's order, which a pipeline "
                             "rank does not see: load a checkpoint saved under another plan instead (DCP)")
        for stage in model.stages:
            materialize(stage, device, init)
        return model
    if reproducible and (init is not None or initialiser_of(model, torch.device(device))[1] is not _reset_parameters):
        raise ValueError("`reproducible=True` needs the `reset_parameters()` initialiser, and this model initialises "
                         f"itself as a whole ({initialiser_of(model, torch.device(device))[0]}) or `init` was given: "
                         "for the same weights under two plans, save a DCP checkpoint under one (`get_state_dict`, "
                         "`torch.distributed.checkpoint.save`) and load it under the other (`set_state_dict`), "
                         "or load a full state dict (README, `planc.materialize`)")
    # Units offloaded to the CPU keep their local shards there (FSDP2 moves them back only
    # when pinning); everything else goes to `device`. This is `to_empty`, per parameter.
    offloaded = _offloaded_params(model)
    model._apply(lambda t: torch.empty_like(t, device="cpu" if id(t) in offloaded else device))
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()
    with torch.no_grad():
        for _, t in _states(model):
            _poison(t)
        if reproducible:
            _reset_parameters(model, full_size=True)
        else:
            (init or initialiser_of(model, torch.device(device))[1])(model)
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()
    left = [name for name, t in _states(model) if _poisoned(t)]
    if left:
        raise PlanError([_uninitialised(left, init is not None, initialiser_of(model, torch.device(device))[0])])
    return model


def initialiser_of(model: nn.Module, device: torch.device) -> tuple[str, Callable[[nn.Module], None]]:
    """The model's own initialiser, as (a name for messages, a function of the model)."""
    for method in ("init_states", "init_weights"):
        fn = getattr(model, method, None)
        if callable(fn) and not _is_hf(model) and "buffer_device" in _parameters(fn):
            return f"`{method}(buffer_device=...)`", lambda m, method=method: getattr(m, method)(buffer_device=device)
    if _is_hf(model):
        return "Hugging Face's `initialize_weights()`", _hf_init
    return "`reset_parameters()` per module", _reset_parameters


def _parameters(fn: Callable) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _is_hf(model: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(model).__mro__)


def _hf_init(model: nn.Module) -> None:
    """Hugging Face's own init, forced: modules built on meta may carry `_is_hf_initialized`."""
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            t.__dict__.pop("_is_hf_initialized", None)
    model.initialize_weights()


def _reset_parameters(model: nn.Module, full_size: bool = False) -> None:
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
            reset = module._reset_parameters
        elif callable(getattr(module, "reset_parameters", None)):
            reset = module.reset_parameters
        else:
            continue
        if full_size:
            _at_full_size(module, reset, done)
        else:
            reset()
        done.update(own)


def _at_full_size(module: nn.Module, reset: Callable[[], None], done: set[int]) -> None:
    """Run `reset` with the sharded parameters of `module`'s subtree as plain full tensors, then
    keep each rank's shard. Parameters initialised before (`done`) are gathered first, so a
    parent's init that sets only some of its children's sees the others as they are."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from planc.backends.experts import EXPERT_SLICE

    # an expert-parallel experts container holds its rank's experts: initialise all, keep those
    rank, ep = getattr(module, EXPERT_SLICE, (0, 1))
    fulls: dict[int, nn.Parameter] = {}
    swapped: list[tuple[nn.Module, str, DTensor]] = []
    for m in module.modules():  # a leaf: itself only
        for key, p in list(m._parameters.items()):
            if not isinstance(p, DTensor):
                continue
            if id(p) not in fulls:
                shape = (p.shape[0] * ep, *p.shape[1:]) if m is module else p.shape
                value = p.full_tensor() if id(p) in done else torch.empty(shape, dtype=p.dtype, device=p.to_local().device)
                fulls[id(p)] = nn.Parameter(value.detach().clone(), requires_grad=p.requires_grad)
            m._parameters[key] = fulls[id(p)]
            swapped.append((m, key, p))
    try:
        reset()
    finally:
        for m, key, p in swapped:
            m._parameters[key] = p
    for _, _, p in swapped:
        full = fulls.pop(id(p), None)
        if full is not None:  # tied: the first registration copies
            if full.shape != p.shape:  # all the experts: this expert rank's
                full = full[rank * p.shape[0]:(rank + 1) * p.shape[0]]
            local = distribute_tensor(full.detach(), p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)


# ------------------------------------------------------------------ poison and its check


def _states(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, local tensor) of every parameter and buffer, each storage once."""
    from torch.distributed.tensor import DTensor
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        yield name, t.to_local() if isinstance(t, DTensor) else t


def _sentinel(t: torch.Tensor):
    if t.is_floating_point() or t.is_complex():
        return float("nan")
    if t.dtype == torch.bool:
        return None
    return torch.iinfo(t.dtype).min


def _poison(t: torch.Tensor) -> None:
    value = _sentinel(t)
    if value is not None and t.numel():
        t.detach().fill_(value)


def _poisoned(t: torch.Tensor) -> bool:
    value = _sentinel(t)
    if value is None or not t.numel() or t.device.type == "meta":
        return False
    t = t.detach()
    return bool(torch.isnan(t).any()) if isinstance(value, float) else bool((t == value).any())


def _uninitialised(names: list[str], custom: bool, default: str) -> Diagnostic:
    modules = list(dict.fromkeys(n.rpartition(".")[0] or "<root>" for n in names))
    shown = ", ".join(f"`{m}`" for m in modules[:_SHOWN])
    more = f" and {len(modules) - _SHOWN} more" if len(modules) > _SHOWN else ""
    by = "your `init`" if custom else default
    tensors = ", ".join(f"`{n}`" for n in names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
    return Diagnostic(code="P606", severity="error", span=None,
                      message=f"{len(names)} parameter(s) or buffer(s) left uninitialised by {by}",
                      notes=(f"in modules {shown}{more}", f"uninitialised: {tensors}"),
                      help=("pass `planc.materialize(model, device, init=fn)` with the model's real "
                            "initialiser, covering these modules (buffers too: a RoPE cache or position ids "
                            "must be recomputed)",))


def _offloaded_params(model: nn.Module) -> set[int]:
    """Ids of the sharded parameters of units with a `CPUOffloadPolicy`."""
    out: set[int] = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            # torch >= 2.13 keeps a list of groups per module; older torch one group (or None)
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
            for group in groups:
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
