"""Apply a compiled plan to a live model: checkpointing, compile, `fully_shard`, prefetch.

This is the only stage that imports `torch.distributed`. `apply(model, plan)` does what a
careful engineer writes by hand (torchtitan's `apply_fsdp`), in the same order:

    compile + validate against the live model (all or nothing: errors leave it untouched)
    -> activation checkpointing (composable, so module paths and state-dict keys stay)
    -> `module.compile()` (in place, names kept)
    -> `fully_shard` per unit, bottom-up, group units as one list call, the root last
    -> explicit forward/backward prefetch lists

The meta-device flow for models too big for one rank:

    with torch.device("meta"):
        model = build()
    applied = planc.apply(model, "plans/x.plan")       # shards on meta: no memory used
    planc.materialize(model, device)                    # allocate local shards, initialise
    optimizer = torch.optim.AdamW(model.parameters())

`fully_shard_kwargs(unit, compiled, model, mesh)` is the one place that turns a resolved
`Unit` into `fully_shard` keyword arguments; `planc emit` and the simulator reuse it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                                    fully_shard)
from torch.distributed.tensor import DTensor, Shard

from planc.lang import syntax as st
from planc.compiler import CompiledPlan, as_plan, sort_diagnostics
from planc.compiler import compile as compile_plan
from planc.diagnostics import Diagnostic, PlanError, Span
from planc.model.graph import ModelGraph
from planc.resolve.ir import Mesh, Unit

__all__ = ["AppliedPlan", "AppliedUnit", "apply", "build_mesh", "device_type", "fully_shard_kwargs",
           "unit_modules"]

# Backend name -> device type of the mesh it drives.
_BACKEND_DEVICES = {"gloo": "cpu", "nccl": "cuda", "xccl": "xpu", "hccl": "hpu", "mpi": "cpu"}


# ===================================================================== mesh


def device_type(backend: str | None = None) -> str:
    """The device type a mesh should use for a process-group backend.

    `gloo` -> cpu, `nccl` -> cuda, and so on. A combined backend (`cpu:gloo,cuda:nccl`) or an
    unknown one picks the accelerator if there is one, else the CPU, so one training script
    runs unchanged on CPU/gloo and GPU/nccl.
    """
    if backend is None and dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend())
    if backend in _BACKEND_DEVICES:
        return _BACKEND_DEVICES[backend]
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if backend and ":" in backend:  # "cpu:gloo,cuda:nccl": devices named outright
        devices = [part.split(":")[0] for part in backend.split(",")]
        if accelerator is not None and accelerator.type in devices:
            return accelerator.type
        return devices[0]
    return accelerator.type if accelerator is not None else "cpu"


def mesh_sizes(plan_mesh: Mesh, world_size: int) -> tuple[int, int] | None:
    """(replicate, shard) of the plan's mesh at this world size, or None if it does not fit."""
    sizes = plan_mesh.sizes(world_size)
    if sizes is None or None in sizes or sizes[0] * sizes[1] != world_size:
        return None
    return sizes  # type: ignore[return-value]


def build_mesh(plan_mesh: Mesh, world_size: int | None = None, device: str | None = None) -> DeviceMesh:
    """The device mesh a plan asks for, over the default process group.

    1-D `("shard",)` for a plain plan, 2-D `("replicate", "shard")` for HSDP.

    Raises:
        PlanError: P401 if the plan's mesh does not fit the world size.
    """
    world_size = dist.get_world_size() if world_size is None else world_size
    sizes = mesh_sizes(plan_mesh, world_size)
    if sizes is None:
        raise PlanError([Diagnostic(code="P401", severity="error", span=plan_mesh.span,
                                    message=f"mesh {plan_mesh} does not fit {world_size} ranks",
                                    label="this mesh")])
    device = device or device_type()
    if plan_mesh.is_hsdp:
        return init_device_mesh(device, sizes, mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device, (sizes[1],), mesh_dim_names=("shard",))


def check_mesh_fits(mesh: DeviceMesh, plan_mesh: Mesh) -> list[Diagnostic]:
    """P602 if a given device mesh has another shape than the plan's mesh statement."""
    shape = tuple(mesh.shape)
    want_ndim = 2 if plan_mesh.is_hsdp else 1
    sizes = mesh_sizes(plan_mesh, mesh.size())
    want = None if sizes is None else (sizes if want_ndim == 2 else (sizes[1],))
    if mesh.ndim == want_ndim and (want is None or shape == want):
        if want_ndim == 1 or mesh.mesh_dim_names is not None:
            return []
        # FSDP2 needs named dims on an HSDP mesh (it asserts otherwise).
        return [Diagnostic(code="P602", severity="error", span=plan_mesh.span,
                           message="the 2-D mesh passed to `apply` has no dimension names",
                           label=f"the plan's mesh {plan_mesh}",
                           help=('build it with `mesh_dim_names=("replicate", "shard")`',))]
    expected = f"a {want_ndim}-D mesh" + (f" of shape {want}" if want else "")
    return [Diagnostic(code="P602", severity="error", span=plan_mesh.span,
                       message=f"the mesh passed to `apply` has shape {shape}; the plan needs {expected}",
                       label=f"the plan's mesh {plan_mesh}",
                       help=("build it with `planc.backends.runtime.build_mesh(compiled.mesh)`, or pass no mesh",))]


# ===================================================================== one unit


def unit_modules(unit: Unit, model: nn.Module) -> list[nn.Module]:
    """The live modules of a unit: `[model]` for the root, else each module path resolved."""
    if unit.is_root:
        return [model]
    return [model.get_submodule(path) for path in unit.modules]


def _unit_param_names(unit: Unit, graph: ModelGraph) -> set[str]:
    """Canonical names of every parameter in the unit's subtrees (claimed here or below)."""
    names: set[str] = set()
    for path in unit.modules:
        names |= graph.subtree_params(path)
    return names


def fully_shard_kwargs(unit: Unit, compiled: CompiledPlan, model: nn.Module, mesh: DeviceMesh) -> dict[str, Any]:
    """The exact keyword arguments of `fully_shard` for one unit of a compiled plan.

    Call `fully_shard(unit_modules(unit, model) or its single module, **kwargs)`. Every key
    is always present, so a code generator can print them all:

    * `mesh`: the given device mesh.
    * `reshard_after_forward`: the plan's value; None leaves FSDP2's default (True for inner
      units, False for the root).
    * `mp_policy`: `MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype,
      cast_forward_inputs)` from the unit's precision settings.
    * `offload_policy`: `CPUOffloadPolicy(pin_memory=...)` or `OffloadPolicy()`. On a CPU
      mesh `pin_memory` is forced False: pinning needs an accelerator and the data is on the
      CPU already.
    * `shard_placement_fn`: for `place` statements, a function returning `Shard(dim)` for
      the placed parameters (by identity) and None for the rest; None if none is placed.
    * `ignored_params`: the `ignore`d parameters in the unit's subtrees, or None.

    Args:
        unit: a unit of `compiled.units`.
        compiled: the plan compiled against `model` (its graph names `model`'s parameters).
        model: the live model, before `fully_shard` runs on this unit.
        mesh: the device mesh.
    """
    if compiled.graph is None:
        raise ValueError("fully_shard_kwargs needs a plan compiled against a model")
    res = compiled.resolution
    in_subtree = _unit_param_names(unit, compiled.graph)
    placed = {id(model.get_parameter(name)): dim for name, (dim, _) in res.placements.items()
              if name in in_subtree and name not in res.ignored}
    ignored = {model.get_parameter(name) for name in res.ignored if name in in_subtree}

    def shard_placement_fn(param: nn.Parameter) -> Shard | None:
        dim = placed.get(id(param))
        return None if dim is None else Shard(dim)

    if unit["offload"]:
        offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=bool(unit["pin_memory"]) and mesh.device_type != "cpu")
    else:
        offload = OffloadPolicy()
    return {
        "mesh": mesh,
        "reshard_after_forward": unit["reshard_after_forward"],
        "mp_policy": MixedPrecisionPolicy(param_dtype=unit["param_dtype"], reduce_dtype=unit["reduce_dtype"],
                                          output_dtype=unit["output_dtype"],
                                          cast_forward_inputs=bool(unit["cast_inputs"])),
        "offload_policy": offload,
        "shard_placement_fn": shard_placement_fn if placed else None,
        "ignored_params": ignored or None,
    }


# ===================================================================== the result


@dataclass
class AppliedUnit:
    """One applied unit: the resolved `Unit` and the FSDP module(s) `fully_shard` made of it."""

    unit: Unit
    modules: tuple[FSDPModule, ...]

    @property
    def name(self) -> str:
        return self.unit.name

    @property
    def handle(self) -> FSDPModule:
        """The module to call FSDP methods on (a group's modules share one FSDP state)."""
        return self.modules[0]


@dataclass
class AppliedPlan:
    """What `apply` did: the compiled plan, the mesh, and each unit with its FSDP handles.

    Attributes:
        compiled: the plan compiled against the live model at the live world size.
        mesh: the device mesh the model is sharded on.
        model: the sharded model (the same object that was passed in).
        units: applied units in application order (bottom-up, root last).
        unit_of_module: module path -> the `Unit` that shards it (only the modules units name;
            the root is `""`).
    """

    compiled: CompiledPlan
    mesh: DeviceMesh
    model: nn.Module
    units: list[AppliedUnit] = field(default_factory=list)
    unit_of_module: dict[str, Unit] = field(default_factory=dict)

    def unit(self, name: str) -> AppliedUnit:
        """The applied unit called `name` (`<root>`, `layers.0`, `[norm, output]`)."""
        for applied in self.units:
            if applied.name == name:
                return applied
        raise KeyError(name)

    def handle(self, name: str) -> FSDPModule:
        """The FSDP module of the unit called `name`."""
        return self.unit(name).handle

    def local_param_bytes(self) -> int:
        """Bytes of parameter data this rank holds: local shards, plus unsharded (ignored) params.

        Counts each parameter once (tied ones too) at its local, unpadded shard size.
        """
        return sum(_local_bytes(p) for p in self.model.parameters())  # tied parameters come once

    def unit_local_bytes(self, unit: Unit) -> int:
        """Bytes of the local shards of the parameters `unit` manages."""
        return sum(_local_bytes(self.model.get_parameter(name)) for name in unit.params)

    def summary(self) -> str:
        """A short human text: mesh, units, parameters and bytes held on this rank."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        total = sum(p.numel() for p in self.model.parameters())  # tied parameters come once
        lines = [f"planc: {self.compiled.plan.file}: {len(self.units)} units on mesh "
                 f"{dict(zip(self.mesh.mesh_dim_names or (), self.mesh.shape))} ({self.mesh.device_type}); "
                 f"{_count(total)} parameters, rank {rank} holds {_bytes(self.local_param_bytes())}"]
        width = max((len(u.name) for u in self.units), default=0)
        for applied in self.units:
            u = applied.unit
            numel = sum(self.model.get_parameter(n).numel() for n in u.params)
            lines.append(f"  {u.name:<{width}}  {_count(numel):>7} params  {_bytes(self.unit_local_bytes(u)):>10}/rank  "
                         f"{_describe(u)}")
        ignored = self.compiled.resolution.ignored
        if ignored:
            lines.append(f"  ignored (replicated): {', '.join(sorted(ignored))}")
        warnings = [d for d in self.compiled.diagnostics if d.severity == "warning"]
        if warnings:
            codes = ", ".join(sorted({d.code for d in warnings}))
            lines.append(f"  {len(warnings)} warning(s) ({codes}): see `planc check` or `.compiled.diagnostics`")
        return "\n".join(lines)


def _local_bytes(p: torch.Tensor) -> int:
    local = p.to_local() if isinstance(p, DTensor) else p
    return local.numel() * local.element_size()


def _describe(u: Unit) -> str:
    from planc.resolve.options import show_value
    parts = [f"reshard={show_value(u.reshard_after_forward)}"]
    if u["param_dtype"] is not None or u["reduce_dtype"] is not None:
        parts.append(f"param={show_value(u['param_dtype'])} reduce={show_value(u['reduce_dtype'])}")
    if u["offload"]:
        parts.append("offload=cpu")
    return " ".join(parts)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


# ===================================================================== apply


def _already_sharded(graph: ModelGraph, span: Span | None) -> list[Diagnostic]:
    """P601 when FSDP, DTensor parameters or composable checkpointing are already there.

    Read from the graph, which records them in the walk that builds it (a reused graph is
    reused only while `ModelGraph.describes` finds none of them added since).
    """
    state = graph.already_sharded
    found = [(state["fsdp"], "FSDP modules"), (state["dtensor"], "DTensor parameters"),
             (state["checkpoint"], "checkpointed modules")]
    notes = tuple(f"{what}: " + ", ".join(f"`{n or '<root>'}`" for n in names[:3]) +
                  (f" and {len(names) - 3} more" if len(names) > 3 else "") for names, what in found if names)
    if not notes:
        return []
    return [Diagnostic(code="P601", severity="error", span=span, message="the model is already sharded",
                       label="this plan was not applied", notes=notes,
                       help=("apply a plan once, to a freshly built model",))]


def _non_contiguous(compiled: CompiledPlan) -> list[Diagnostic]:
    """P604 for parameters FSDP2 cannot shard (read from the graph: no parameter lookups)."""
    ignored, params = compiled.resolution.ignored, compiled.graph.params
    out = []
    for unit in compiled.units:
        for name in unit.params:
            if name not in ignored and not params[name].contiguous:
                out.append(Diagnostic(code="P604", severity="error", span=unit.span,
                                      message=f"parameter `{name}` of unit `{unit.name}` is not contiguous",
                                      label="this unit", help=(f"`ignore {name}`, or make it contiguous in the model",)))
    return out


def _compile_live(plan, model: nn.Module, mesh: DeviceMesh | None) -> tuple[CompiledPlan, list[Diagnostic]]:
    """Compile against the live model at the live world size; collect every error.

    A `CompiledPlan` is reused as it is when it was compiled against this very model (same
    modules, same parameter objects) at this world size; otherwise it is compiled again.
    """
    precompiled = plan if isinstance(plan, CompiledPlan) else None
    parsed = as_plan(plan.plan if precompiled is not None else plan)  # raises PlanError on syntax errors
    extra: list[Diagnostic] = []
    if mesh is not None:
        world = mesh.size()
    elif dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = None
        extra.append(Diagnostic(code="P603", severity="error", span=None,
                                message="`planc.apply` needs an initialised process group or a `mesh`",
                                help=("call `torch.distributed.init_process_group()` first (torchrun sets "
                                      "the environment for it), or pass `mesh=`",)))
    if (precompiled is not None and precompiled.world_size == world and precompiled.graph is not None
            and precompiled.graph.describes(model)):
        compiled = precompiled
    else:
        compiled = compile_plan(parsed, model, world, strict=False, check_memory=False)
    span = parsed.statements[0].span if parsed.statements else None
    extra += _already_sharded(compiled.graph, span)
    if mesh is not None:
        extra += check_mesh_fits(mesh, compiled.mesh)
    if not compiled.errors:
        extra += _non_contiguous(compiled)
    return compiled, extra


def apply(model: nn.Module, plan: st.Plan | CompiledPlan | str | os.PathLike, *,
          mesh: DeviceMesh | None = None) -> AppliedPlan:
    """Shard `model` in place as `plan` says; all or nothing.

    Args:
        model: the model, on meta, CPU or the mesh's device; not yet sharded.
        plan: a path, a parsed `Plan` (`planc.load`/`loads`), or a `CompiledPlan` (reused if it
            was compiled against this model, unchanged, at this world size; else recompiled
            against the live model and world size).
        mesh: the device mesh; by default built from the plan's mesh over the default
            process group, on the device the backend drives (gloo: cpu, nccl: cuda).

    Returns:
        The `AppliedPlan`: units with their FSDP handles, `summary()`, `local_param_bytes()`.

    Raises:
        PlanError: with every diagnostic if the plan has any error for this model and world
            size, the model is already sharded, or `mesh` does not fit the plan. The model is
            then left exactly as it was. (An error torch raises while sharding, which planc's
            checks did not foresee, propagates as it is and can leave the model partly
            sharded; please report it.)
    """
    compiled, extra = _compile_live(plan, model, mesh)
    diagnostics = sort_diagnostics(list(compiled.diagnostics) + extra)
    if any(d.is_error for d in diagnostics):
        raise PlanError(diagnostics, compiled.sources)
    if mesh is None:
        mesh = build_mesh(compiled.mesh)
    res = compiled.resolution
    # Every unit's arguments are computed before anything changes, while parameters are
    # still the model's own objects (placements and ignores are matched by identity).
    calls = [(unit, unit_modules(unit, model), fully_shard_kwargs(unit, compiled, model, mesh))
             for unit in compiled.units]

    # NOTE: order matters, as in torchtitan: checkpointing and compile wrap the plain
    # modules first; fully_shard then hooks around them. The composable checkpoint keeps
    # module paths and state-dict keys (the wrapper class would add `_checkpoint_wrapped_module`).
    from torch.distributed._composable import checkpoint
    for path in res.checkpoint:
        checkpoint(model.get_submodule(path))
    for path, setting in res.compile.items():
        model.get_submodule(path).compile(**(setting.value or {}))

    # NOTE: bottom-up (compiled.units is post-order, root last): a call owns the parameters
    # of its subtree not already claimed by an earlier call on a descendant.
    applied = AppliedPlan(compiled=compiled, mesh=mesh, model=model)
    for unit, modules, kwargs in calls:
        fully_shard(modules if unit.is_group else modules[0], **kwargs)
        applied.units.append(AppliedUnit(unit, tuple(modules)))  # type: ignore[arg-type]
        for path in unit.modules:
            applied.unit_of_module[path] = unit

    handles = {a.name: a.handle for a in applied.units}
    for name, targets in res.prefetch_forward.items():
        handles[name].set_modules_to_forward_prefetch([handles[t] for t in targets])
    for name, targets in res.prefetch_backward.items():
        handles[name].set_modules_to_backward_prefetch([handles[t] for t in targets])
    return applied
