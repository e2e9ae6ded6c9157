"""Apply a compiled plan to a live model: checkpointing, compile, `fully_shard`, prefetch.

This is the only stage that imports `torch.distributed`. `apply(model, plan)` does what a
careful engineer writes by hand (torchtitan's `apply_fsdp`), in the same order:

    compile + validate against the live model (all or nothing: errors leave it untouched)
    -> context parallelism: attention modules gather K/V over the context axis (hooks)
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

The order and every argument come from the lowered program (`compiled.program`,
planc/lower/): `run` executes it op by op; `fully_shard_kwargs(op, model, mesh)` turns one
`FullyShard` op into `fully_shard` keyword arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from planc.backends import context, experts
from planc.compiler import CompiledPlan, as_plan
from planc.compiler import compile as compile_plan
from planc.diagnostics import Diagnostic, PlanError, Span, sort_diagnostics
from planc.lang import syntax as st
from planc.lower.checkpointing import context_fn
from planc.lower.job import EXPERT, FORWARD, FULL_BACKWARD, LossParallel, Reader, ShardBatch, UnknownKind
from planc.lower.lowering import tensor_reties
from planc.lower.program import (
    AttendOverContext,
    Checkpoint,
    Compile,
    DispatchExperts,
    FullyShard,
    Layout,
    Parallelize,
    Program,
    SetPrefetch,
    TensorStyle,
    UnitMethod,
)
from planc.model.graph import ModelGraph
from planc.quantities import show_bytes, show_count
from planc.resolve.ir import Unit
from planc.resolve.mesh import Mesh
from planc.resolve.step import MicrobatchError, check_splits  # noqa: F401  (MicrobatchError: what accumulate raises)
from planc.resolve.styles import STYLES

__all__ = ["AppliedPlan", "AppliedUnit", "apply", "build_mesh", "device_type", "fully_shard_kwargs", "run",
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


def build_mesh(plan_mesh: Mesh, world_size: int | None = None, device: str | None = None) -> DeviceMesh:
    """The device mesh a plan asks for, over the default process group.

    Its axes are the plan's dense axes (`Mesh.device_axes`), named as the plan names them:
    1-D `("shard",)` for a plain plan, 2-D `("replicate", "shard")` for HSDP (or the plan's
    words for them, e.g. `("dp_replicate", "fsdp")`), the tensor axis last.

    Raises:
        PlanError: P401 if the plan's mesh does not fit the world size.
    """
    world_size = dist.get_world_size() if world_size is None else world_size
    sizes = plan_mesh.sizes(world_size)
    if sizes is None:
        raise PlanError([Diagnostic(code="P401", severity="error", span=plan_mesh.span,
                                    message=f"mesh {plan_mesh} does not fit {world_size} ranks",
                                    label="this mesh")])
    axes = plan_mesh.device_axes
    return init_device_mesh(device or device_type(), tuple(sizes[a.role] for a in axes),
                            mesh_dim_names=tuple(a.name for a in axes))


def check_mesh_fits(mesh: DeviceMesh, plan_mesh: Mesh) -> list[Diagnostic]:
    """P602 if a given device mesh has another shape (or other axis names) than the plan's mesh."""
    axes = plan_mesh.device_axes
    sizes = plan_mesh.sizes(mesh.size())
    want = None if sizes is None else tuple(sizes[a.role] for a in axes)
    names = tuple(a.name for a in axes)
    if mesh.ndim == len(axes) and (want is None or tuple(mesh.shape) == want):
        if len(axes) == 1 or tuple(mesh.mesh_dim_names or ()) == names:
            return []
        # FSDP2 needs named dims on an HSDP mesh (it asserts otherwise), and the program
        # names the submesh it shards on by them.
        got = "no dimension names" if mesh.mesh_dim_names is None else f"dimensions {tuple(mesh.mesh_dim_names)}"
        return [Diagnostic(code="P602", severity="error", span=plan_mesh.span,
                           message=f"the 2-D mesh passed to `apply` has {got}; the plan names them {names}",
                           label=f"the plan's mesh {plan_mesh}",
                           help=(f"build it with `mesh_dim_names={names}`",))]
    expected = f"a {len(axes)}-D mesh" + (f" of shape {want}" if want else "")
    return [Diagnostic(code="P602", severity="error", span=plan_mesh.span,
                       message=f"the mesh passed to `apply` has shape {tuple(mesh.shape)}; the plan needs {expected}",
                       label=f"the plan's mesh {plan_mesh}",
                       help=("build it with `planc.backends.runtime.build_mesh(compiled.mesh)`, or pass no mesh",))]


# ===================================================================== one unit


def unit_modules(op: FullyShard | Unit, model: nn.Module) -> list[nn.Module]:
    """The live modules of a unit: `[model]` for the root, else each module path resolved."""
    if op.is_root:
        return [model]
    return [model.get_submodule(path) for path in op.modules]


def fully_shard_kwargs(op: FullyShard, model: nn.Module, mesh: DeviceMesh,
                       expert_mesh: DeviceMesh | None = None) -> dict[str, Any]:
    """The exact keyword arguments of `fully_shard` for one `FullyShard` op of the program.

    Call `fully_shard(unit_modules(op, model) or its single module, **kwargs)`, before
    anything is sharded (placed and ignored parameters are matched by identity):

    * `mesh`: the given device mesh.
    * `reshard_after_forward`: the plan's value; None leaves FSDP2's default (True for inner
      units, False for the root).
    * `mp_policy`: `MixedPrecisionPolicy` from the unit's precision.
    * `offload_policy`: `CPUOffloadPolicy(pin_memory=...)` or `OffloadPolicy()`. On a CPU
      mesh `pin_memory` is forced False: pinning needs an accelerator and the data is on the
      CPU already.
    * `shard_placement_fn`: `Shard(dim)` for the placed parameters, None for the rest; None
      when none is placed.
    * `ignored_params`: the `ignore`d parameters in the unit's subtrees, or None.

    A unit with expert-parallel experts (`op.experts`) gets a `shard_placement_fn` returning a
    `ShardPlacementResult` for every parameter: the experts on `expert_mesh` (the expert view's
    FSDP axes), the rest on `mesh` (`planc.backends.experts.expert_placement_fn`).
    """
    policy = op.policy
    placed = {id(model.get_parameter(name)): dim for name, dim in op.placements}
    ignored = {model.get_parameter(name) for name in op.ignored}

    def shard_placement_fn(param: nn.Parameter) -> Shard | None:
        dim = placed.get(id(param))
        return None if dim is None else Shard(dim)

    if policy.offload.enabled:
        offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=policy.offload.pin_memory and mesh.device_type != "cpu")
    else:
        offload = OffloadPolicy()
    placement_fn = shard_placement_fn if placed else None
    if op.experts and expert_mesh is not None:
        placement_fn = experts.expert_placement_fn({model.get_parameter(n): d for n, d in op.experts}, expert_mesh,
                                                   mesh, {model.get_parameter(n): d for n, d in op.placements})
    p = policy.precision
    return {
        "mesh": mesh,
        "reshard_after_forward": policy.reshard_argument,
        "mp_policy": MixedPrecisionPolicy(param_dtype=p.param_dtype, reduce_dtype=p.reduce_dtype,
                                          output_dtype=p.output_dtype, cast_forward_inputs=p.cast_forward_inputs),
        "offload_policy": offload,
        "shard_placement_fn": placement_fn,
        "ignored_params": ignored or None,
    }


# ===================================================================== the result


@dataclass
class AppliedUnit:
    """One applied unit: the resolved `Unit` and the FSDP module(s) `fully_shard` made of it."""

    unit: Unit
    modules: tuple[FSDPModule, ...]
    op: FullyShard | None = None  # the program's call that made it

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
    expert_mesh: DeviceMesh | None = None  # the expert view (`efsdp`, `expert`), with expert parallelism

    def clip_grad_norm_(self, max_norm: float, parameters=None) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_(parameters or model.parameters(), max_norm)`, which torch
        2.13 refuses when experts live on their own mesh: then planc's recipe (`planc.backends.experts`)."""
        params = self.model.parameters() if parameters is None else parameters
        if self.expert_mesh is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        axis = self.compiled.job.view(EXPERT).axes[-1].name
        return experts.clip_grad_norm_(params, max_norm, self.expert_mesh[axis])

    def loss_parallel(self):
        """The context the loss and its backward run in: torch's `loss_parallel()` when the plan
        shards the logits on the vocabulary (`parallel output colwise { loss_parallel }`), else a no-op."""
        import contextlib

        from torch.distributed.tensor.parallel import loss_parallel

        if self.compiled.job.step_op(LossParallel):
            return loss_parallel()
        return contextlib.nullcontext()

    @property
    def microbatches(self) -> int:
        """Microbatches per optimizer step (`step { accumulate N }`; 1 without a `step` line).
        Divide each microbatch's loss by it for the mean over the step's batch."""
        return self.compiled.job.schedule.microbatches

    def accumulate(self, *batch: torch.Tensor):
        """The step's microbatches, as the plan's `step` line says: yields, per microbatch, the
        slices of `batch` (each tensor split on its first dimension into `microbatches` equal
        parts), with FSDP2's gradient sync set for it (`gradient_sync`). Run forward and
        backward on each; call the optimizer after the loop::

            for tokens_mb, labels_mb in applied.accumulate(tokens, labels):
                loss = loss_fn(model(tokens_mb), labels_mb) / applied.microbatches
                loss.backward()
            optimizer.step()

        Raises:
            MicrobatchError: a tensor's first dimension does not divide into the microbatches.
        """
        k = self.microbatches
        for t in batch:
            check_splits(tuple(t.shape), k)
        chunks = [t.chunk(k) for t in batch]
        try:
            for mb in range(k):
                self.gradient_sync(mb)
                yield tuple(c[mb] for c in chunks)
        finally:  # a loop left early must not leave the next step without its reduction
            self.gradient_sync(k - 1)

    holds_loss = True  # every rank computes the loss without a pipeline (`PipelinedPlan` says which rank does)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn) -> torch.Tensor:
        """Forward and backward of one optimizer step's batch, as a pipeline plan's `step` does:
        the mean over the step's microbatches (`accumulate`) of `loss_fn(model(inputs), targets)`
        (inside `loss_parallel()` when the plan says so), returned detached on every rank. A
        plan with a context axis shards each batch first: use `shard_batch` in your own loop."""
        if self.compiled.job.step_op(ShardBatch):
            raise TypeError("a plan with a context axis needs `applied.shard_batch(tokens, labels)` and "
                            "`positions=` in the loop: write the loop (README)")
        total = None
        for x, y in self.accumulate(inputs, targets):
            with self.loss_parallel():
                loss = loss_fn(self.model(x), y) / self.microbatches
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    def gradient_sync(self, microbatch: int) -> bool:
        """Set FSDP2's gradient sync for `microbatch` of the step as the plan says (`step {
        accumulate N, sync = last }`: off before the last microbatch, `set_requires_gradient_sync`;
        otherwise on); returns whether this microbatch's backward reduces its gradients."""
        schedule = self.compiled.job.schedule
        sync = schedule.gradient_sync == "every" or microbatch == schedule.microbatches - 1
        for applied in self.units:
            applied.handle.set_requires_gradient_sync(sync, recurse=False)
        return sync

    def data_parallel_rank(self) -> tuple[int, int]:
        """(this rank's index, count) over the data-parallel axes (replicate x shard): the batch a
        data loader gives this rank. Ranks of one context (or tensor) group share it."""
        names = self.compiled.mesh.dp_axis_names
        rank, size = 0, 1
        for name in names:
            sub = self.mesh[name]
            rank, size = rank * sub.size() + sub.get_local_rank(), size * sub.size()
        return rank, size

    def shard_batch(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> context.Batch:
        """This rank's share of its data-parallel batch for the model's forward (`ShardBatch`).

        Without a context axis: the tensors as they are, positions None. With one: each
        `(batch, seq)` tensor cut along the sequence, head-tail (chunks `r` and `2cp - 1 - r` of
        `2cp` on context rank `r`), and the global positions of those chunks; call the model
        as `model(batch.tokens, positions=batch.positions)`. The loss is scaled as in plain
        data parallelism: the mean over this rank's tokens. FSDP averages the gradients over
        the flattened shard x context ranks, each of which holds the same number of tokens,
        so the average of the ranks' means is the mean over the whole batch (and so are the
        gradients). Ranks of one context group must be given the same batch
        (`data_parallel_rank`).
        """
        ops = self.compiled.job.step_op(ShardBatch)
        if not ops:
            return context.Batch(tokens, labels, None)
        return context.shard_batch(ops[0], self.mesh[ops[0].axis], tokens, labels)

    def unshard_sequence(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence from every context rank's head-tail shard of `t` along `dim` (no
        gradient), e.g. logits for evaluation; `t` itself without a context axis."""
        ops = self.compiled.job.step_op(ShardBatch)
        return context.unshard(t, dim, self.mesh[ops[0].axis].get_group()) if ops else t

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

    def _expert_slices(self, unit: Unit) -> str:
        """`; experts 2..3 of 4 here (layers.0.moe.experts)`: the whole experts this rank keeps of
        each expert-parallel container `unit` holds (its `/rank` bytes count only these)."""
        out = []
        for part in self.compiled.job.parts:
            for op in part.program.of_type(DispatchExperts):
                if op.params and op.params[0] in unit.params:
                    rank, ep = getattr(self.model.get_submodule(op.module), experts.EXPERT_SLICE)
                    local = op.experts // ep
                    out.append(f"experts {rank * local}..{(rank + 1) * local - 1} of {op.experts} here ({op.module})")
        return "".join(f"; {s}" for s in out)

    def summary(self) -> str:
        """A short human text: mesh, units, parameters (whole: all experts counted) and bytes held on
        this rank (its shards; of the experts, its own); each unit's local expert slice."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        ep = 1 if self.expert_mesh is None else self.expert_mesh[self.compiled.job.view(EXPERT).axes[-1].name].size()
        experts_ = {n for part in self.compiled.job.parts for op in part.program.of_type(DispatchExperts)
                    for n in op.params}  # every part's: a pipeline job has one per stage
        # tied parameters come once; an expert-parallel parameter holds 1 / expert of the experts
        total = sum(p.numel() * (ep if n in experts_ else 1) for n, p in self.model.named_parameters())
        lines = [f"planc: {self.compiled.plan.file}: {len(self.units)} units on mesh "
                 f"{dict(zip(self.mesh.mesh_dim_names or (), self.mesh.shape))} ({self.mesh.device_type}); "
                 f"{show_count(total)} parameters, rank {rank} holds {show_bytes(self.local_param_bytes())}"]
        width = max((len(u.name) for u in self.units), default=0)
        for applied in self.units:
            u = applied.unit
            numel = sum(self.model.get_parameter(n).numel() * (ep if n in experts_ else 1) for n in u.params)
            lines.append(f"  {u.name:<{width}}  {show_count(numel):>7} params  {show_bytes(self.unit_local_bytes(u)):>10}/rank  "
                         f"{_describe(applied.op.policy)}{self._expert_slices(u)}")
        if self.expert_mesh is not None:
            lines.append(f"  experts: {len(experts_)} parameters on the expert mesh "
                         f"{dict(zip(self.expert_mesh.mesh_dim_names or (), self.expert_mesh.shape))}, each rank "
                         f"holding 1/{ep} of the experts; clip with `applied.clip_grad_norm_(max_norm)`")
        if self.compiled.job.step_op(ShardBatch):
            lines.append("  context axis: cut each batch with `applied.shard_batch(tokens, labels)` and pass "
                         "`positions=` to the model")
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


def _describe(policy) -> str:
    from planc.resolve.options import show_value
    p = policy.precision
    parts = [f"reshard={show_value(policy.reshard_after_forward)}"]
    if p.param_dtype is not None or p.reduce_dtype is not None:
        parts.append(f"param={show_value(p.param_dtype)} reduce={show_value(p.reduce_dtype)}")
    if policy.offload.enabled:
        parts.append("offload=cpu")
    return " ".join(parts)






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
        For a job with several parts (pipeline stages) a `PipelinedPlan`
        (planc/backends/pipelining.py): this rank's stages, `step`, `holds_loss`.

    Raises:
        PlanError: with every diagnostic if the plan has any error for this model and world
            size, the model is already sharded, or `mesh` does not fit the plan. The model is
            then left exactly as it was. (An error torch raises while sharding, which planc's
            checks did not foresee, propagates as it is and can leave the model partly
            sharded; please report it.)
    """
    compiled, extra = _compile_live(plan, model, mesh)
    if compiled.ok and len(compiled.job.parts) > 1:  # pipeline stages: planc/backends/pipelining.py
        from planc.backends import pipelining
        return pipelining.apply(model, compiled, extra, mesh)
    if compiled.ok:
        READER.compiled(compiled)  # before anything changes, so a refused job leaves the model as it was
    diagnostics = sort_diagnostics(list(compiled.diagnostics) + extra)
    if any(d.is_error for d in diagnostics):
        raise PlanError(diagnostics, compiled.sources)
    if mesh is None:
        mesh = build_mesh(compiled.mesh)
    return run(compiled.program, model, mesh, compiled)


# ===================================================================== tensor parallelism


def placement(layout: Layout | None):
    """The DTensor placement of a plan layout (None stays None: an input left alone)."""
    from torch.distributed.tensor import Partial, Replicate

    if layout is None:
        return None
    return {"replicate": Replicate, "partial": Partial}[layout.kind]() if layout.kind != "shard" else Shard(layout.dim)


class ReplicateParallel(ParallelStyle):
    """Parameters replicated on the tensor axis, the forward run on local tensors (torchtitan's
    `NoParallel`): a module tensor parallelism does not split still lives on the same meshes.

    Every rank of the tensor axis computes the same thing from the same (replicated) inputs,
    so the forward runs on the parameters' local tensors and on its inputs' (a DTensor input is
    first made `Replicate`, as torchtitan's `NoParallel` asks), and returns local tensors; the
    parameter gradients come back as `Replicate` DTensors through `to_local`. No DTensor
    operator runs inside the module, so any module works: `nn.MultiheadAttention` (CPU flash
    attention has no DTensor sharding rule), a mixture of experts (`grouped_mm`, data-dependent
    indexing), torchtitan 0.3.0's `Embedding` (which unwraps its own weight). A parameter
    shared by two submodules stays shared.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import Replicate, distribute_tensor

        done: dict[int, nn.Parameter] = {}
        for sub in module.modules():
            for key, p in list(sub._parameters.items()):
                if p is None or isinstance(p, DTensor):
                    continue
                if id(p) not in done:
                    done[id(p)] = nn.Parameter(distribute_tensor(p, device_mesh, [Replicate()]),
                                               requires_grad=p.requires_grad)
                sub.register_parameter(key, done[id(p)])
        forward = module.forward

        def local(x):
            if not isinstance(x, DTensor):
                return x
            if not all(p.is_replicate() for p in x.placements):  # e.g. a sequence-parallel Shard(1) input
                x = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
            return x.to_local()

        def local_forward(*args, **kwargs):
            # NOTE: the parameters are read here, inside forward, after FSDP's pre-forward hook
            # has put the unsharded ones in place; they are put back however forward ends.
            swapped = [(sub, key, p) for sub in module.modules() for key, p in sub._parameters.items()
                       if isinstance(p, DTensor)]
            for sub, key, p in swapped:
                sub._parameters[key] = p.to_local()
            try:
                out = forward(*(local(a) for a in args), **{k: local(v) for k, v in kwargs.items()})
            finally:
                for sub, key, p in swapped:
                    sub._parameters[key] = p
            return torch.utils._pytree.tree_map(local, out)

        module.forward = local_forward
        return module


def torch_style(style: TensorStyle):
    """The `ParallelStyle` a plan's style names (its row's `torch_class`), with the plan's arguments
    (torch's defaults otherwise)."""
    from torch.distributed.tensor import parallel

    row = STYLES[style.kind]
    cls = getattr(parallel, row.torch_class) if row.torch_own else ReplicateParallel

    def layouts(ls):
        return None if ls is None else tuple(placement(x) for x in ls)

    def kw(pairs):
        return {k: placement(v) for k, v in pairs} or None

    local = {} if style.use_local_output is None else {"use_local_output": style.use_local_output}
    if row.one_layout:
        one = {k: placement(v[0]) for k, v in (("input_layouts", style.input_layouts),
                                                ("output_layouts", style.output_layouts)) if v is not None}
        return cls(**one, **local)
    if not (row.prepares_input or row.prepares_output):  # sequence, replicate
        return cls(**({} if style.sequence_dim is None else {"sequence_dim": style.sequence_dim}), **local)
    inputs = dict(input_layouts=layouts(style.input_layouts), desired_input_layouts=layouts(style.desired_input_layouts),
                  input_kwarg_layouts=kw(style.input_kwarg_layouts),
                  desired_input_kwarg_layouts=kw(style.desired_input_kwarg_layouts)) if row.prepares_input else {}
    outputs = dict(output_layouts=layouts(style.output_layouts),
                   desired_output_layouts=layouts(style.desired_output_layouts)) if row.prepares_output else {}
    return cls(**inputs, **outputs, **local)


def _submesh(mesh: DeviceMesh, axes: tuple[str, ...]) -> DeviceMesh:
    """The submesh of the axes named `axes`: the mesh itself when it has exactly those axes."""
    if mesh.ndim == len(axes) and (len(axes) == 1 or tuple(mesh.mesh_dim_names or ()) == axes):
        return mesh
    return mesh[axes if len(axes) > 1 else axes[0]]


def _retie(model: nn.Module, reties: list[tuple[str, str]]) -> None:
    """Tie again the parameters tensor parallelism untied (`planc.lower.lowering.tensor_reties`)."""
    for alias, canon in reties:
        owner, _, local = alias.rpartition(".")
        shared = model.get_parameter(canon)
        mine = model.get_parameter(alias)
        if mine is not shared:
            same = getattr(mine, "placements", None) == getattr(shared, "placements", None) and mine.shape == shared.shape
            if not same:  # P421 refuses this plan; a live model that differs from its graph lands here
                raise PlanError([Diagnostic(code="P421", severity="error", span=None, message=f"`{alias}` is tied to "
                                            f"`{canon}` but tensor parallelism placed them differently")], {})
            setattr(model.get_submodule(owner), local, shared)


# What the runtime runs: every op; the step is the user's loop (forward, backward, in
# `AppliedPlan.loss_parallel()` for the `LossParallel` step op).
# `ShardBatch`: the loop's `AppliedPlan.shard_batch`.
READER = Reader("the runtime (planc.apply)",
                (Parallelize, AttendOverContext, DispatchExperts, Checkpoint, Compile, FullyShard, SetPrefetch,
                 UnitMethod),
                (FORWARD, FULL_BACKWARD), (LossParallel, ShardBatch))


def run(program: Program, model: nn.Module, mesh: DeviceMesh, compiled: CompiledPlan,
        expert_mesh: DeviceMesh | None = None) -> AppliedPlan:
    """Execute a lowered program on a live model, op by op, in the program's order.

    Every `fully_shard` argument is computed before anything changes, while parameters are
    still the model's own objects (placements and ignores are matched by identity).
    `expert_mesh`: the expert view, built by the caller (a pipeline builds it once on every
    rank: a stage without experts still takes part in creating its groups); else built here
    when the program dispatches experts.
    """
    from torch.distributed._composable import checkpoint

    READER.program(program)
    if len(compiled.job.parts) == 1:  # a pipeline's job is read by its own reader (pipelining.READER)
        READER.compiled(compiled)
    # tensor parallelism runs first (the lowering puts it first): it replaces parameters with
    # DTensors, so the `fully_shard` arguments are computed after it, on the parameters FSDP sees
    tp = [op for op in program.ops if isinstance(op, Parallelize)]
    if program.ops[:len(tp)] != tuple(tp):
        raise TypeError("the runtime needs every `Parallelize` operation before the others")
    # NOTE: each submesh is sliced once, as hand-written code does (`tp_mesh = mesh["tp"]`):
    # `mesh[axes]` builds a new DeviceMesh every call, about half a millisecond on a 2-D mesh,
    # which across one call per parallelized module was most of apply's overhead on a large model.
    submeshes: dict[tuple[str, ...], DeviceMesh] = {}
    for name, joined in program.mesh.flattened.items():
        # FSDP over shard x context as one axis: on the 2-D submesh it would silently be HSDP
        submeshes[(name,)] = mesh[joined]._flatten(name)

    def submesh(axes: tuple[str, ...]) -> DeviceMesh:
        if axes not in submeshes:
            submeshes[axes] = _submesh(mesh, axes)
        return submeshes[axes]

    # one style object per distinct style, as a hand-written plan's `"layers.*.attention.wq"` entry
    # serves every block (a style holds only its arguments; the hooks it installs are per module)
    styles: dict[TensorStyle, ParallelStyle] = {}
    for op in tp:
        from torch.distributed.tensor.parallel import parallelize_module

        if op.style not in styles:
            styles[op.style] = torch_style(op.style)
        parallelize_module(model.get_submodule(op.module), submesh((op.axis,)), styles[op.style])
    if tp:
        _retie(model, tensor_reties(program, compiled.graph))
    # expert parallelism next: it replaces the experts' parameters with their rank's slices
    if not program.of_type(DispatchExperts):
        expert_mesh = None
    elif expert_mesh is None:
        expert_mesh = experts.build_expert_mesh(compiled.job.view(EXPERT), mesh.device_type)
    for op in program.of_type(DispatchExperts):
        split = (submesh((op.tensor,)), model.get_submodule(op.layer)) if op.tensor is not None else ()
        experts.dispatch_experts(model.get_submodule(op.module), expert_mesh, op.axis, *split, averaged=op.averaged)
    expert_axes = next((u.expert_axes for u in program.units if u.expert_axes), ())
    expert_fsdp = _submesh(expert_mesh, expert_axes) if expert_mesh is not None and expert_axes else None
    calls = {id(op): (unit_modules(op, model), fully_shard_kwargs(op, model, submesh(op.axes), expert_fsdp))
             for op in program.units}
    applied = AppliedPlan(compiled=compiled, mesh=mesh, model=model, expert_mesh=expert_mesh)
    handles: dict[str, FSDPModule] = {}
    for op in program.ops:
        # NOTE: the program's order is the order that works (torchtitan's): checkpointing
        # and compile wrap the plain modules first, `fully_shard` then hooks around them,
        # bottom-up (a call owns the parameters of its subtree not claimed by an earlier
        # call on a descendant); prefetch lists and unit methods need every unit sharded.
        if isinstance(op, (Parallelize, DispatchExperts)):
            continue  # done above
        if isinstance(op, AttendOverContext):
            context.attend_over_context(model.get_submodule(op.module), submesh((op.axis,)).get_group())
        elif isinstance(op, Checkpoint):
            checkpoint(model.get_submodule(op.module), context_fn=context_fn(op.mode))
        elif isinstance(op, Compile):
            model.get_submodule(op.module).compile(**dict(op.options))
        elif isinstance(op, FullyShard):
            modules, kwargs = calls[id(op)]
            fully_shard(modules if op.is_group else modules[0], **kwargs)
            applied.units.append(AppliedUnit(compiled.unit(op.name), tuple(modules), op))  # type: ignore[arg-type]
            handles[op.name] = modules[0]  # type: ignore[assignment]
            for path in op.modules:
                applied.unit_of_module[path] = applied.units[-1].unit
        elif isinstance(op, SetPrefetch):
            setter = getattr(handles[op.unit], f"set_modules_to_{op.direction}_prefetch")
            setter([handles[t] for t in op.targets])
        elif isinstance(op, UnitMethod):
            getattr(handles[op.unit], op.method)(*op.args)
        else:  # READER.program refused it above; kept for a kind added to READER and not here
            raise UnknownKind(READER.interpreter, op)
    return applied
