"""Lower a resolved plan to the program every backend runs (`planc/lower/program.py`).

The one place that decides what is done to the model, in what order, with which
arguments. FSDP2's defaulting rules are applied here and nowhere else:

* `reshard_after_forward` left unset is True for inner units and False for the root
  (what FSDP2 does with `None`, which is what is passed); under a pipeline it is False for
  every unit (torchtitan's `reshard_after_forward = not pp_enabled`: a stage runs several
  microbatches' forwards before their backwards, and resharding between them is wrong with
  the split-backward schedules on torch 2.13, P465), and False is what is passed;
* a precision left unset keeps the parameter's own dtype; the reduce dtype defaults to the
  compute dtype (`Precision.compute_dtype` / `Precision.reduce`);
* offloading pins memory unless the plan says not to (and never on a CPU mesh).

Order (the order torchtitan's `apply_fsdp` uses): activation checkpointing and compile of
the plain modules, `fully_shard` per unit bottom-up (the root last), then the explicit
prefetch lists and the `FSDPModule` methods the plan sets, which need every unit sharded.
"""

from __future__ import annotations

import dataclasses

from planc.lower import schedules
from planc.lower.job import DENSE, EXPERT, Job, LossParallel, Part, ShardBatch, View, step_schedule
from planc.lower.pipeline import pipeline_job
from planc.lower.program import (
    AttendOverContext,
    Checkpoint,
    Compile,
    DispatchExperts,
    FullyShard,
    Offload,
    Op,
    Parallelize,
    Policy,
    Precision,
    Program,
    SetPrefetch,
    UnitMethod,
)
from planc.model.graph import ModelGraph
from planc.resolve.context import BALANCE, BATCH_TENSORS
from planc.resolve.experts import EFSDP, expert_degrees
from planc.resolve.ir import Resolution, Setting, Unit
from planc.resolve.mesh import Axis, Role
from planc.resolve.styles import ROWS, STYLES, SUBTREE

# Unit settings applied by calling an `FSDPModule` method after sharding: setting -> method.
# A setting left at None calls nothing. Adding such a knob is an option in
# planc/resolve/options.py plus one line here; every backend handles `UnitMethod` already.
UNIT_METHODS: dict[str, str] = {
    "gradient_divide_factor": "set_gradient_divide_factor",
    "force_sum_reduction": "set_force_sum_reduction_for_comms",
}


def policy_of(unit: Unit, pipelined: bool = False) -> Policy:
    """The effective FSDP2 policy of one resolved unit (every default resolved); `pipelined`:
    the plan has a pipeline (no resharding after forward unless the plan says so)."""
    argument = unit["reshard_after_forward"]
    if argument is None and pipelined:
        argument = False
    return Policy(
        reshard_after_forward=(not unit.is_root) if argument is None else argument,
        reshard_argument=argument,
        precision=Precision(param_dtype=unit["param_dtype"], reduce_dtype=unit["reduce_dtype"],
                            output_dtype=unit["output_dtype"], cast_forward_inputs=bool(unit["cast_inputs"])),
        offload=Offload(enabled=bool(unit["offload"]), pin_memory=bool(unit["pin_memory"])),
        origins=unit.settings,
    )


def _fully_shard(unit: Unit, res: Resolution, graph: ModelGraph, axes: tuple[str, ...],
                 experts: dict[str, int] | None = None, expert_axes: tuple[str, ...] = ()) -> FullyShard:
    subtree: set[str] = set()
    for path in unit.modules:
        subtree |= graph.subtree_params(path)
    # FSDP2 asks `shard_placement_fn` only about the parameters the call manages
    experts = experts or {}
    placements = tuple((n, res.placements[n][0]) for n in unit.params if n in res.placements and n not in experts)
    ignored = tuple(sorted(n for n in res.ignored if n in subtree))
    return FullyShard(
        name=unit.name, modules=unit.modules, is_root=unit.is_root, axes=axes,
        policy=policy_of(unit, res.pipeline is not None),
        params=unit.params, placements=placements, ignored=ignored, rule=unit.rule, span=unit.span,
        experts=tuple((n, experts[n]) for n in unit.params if n in experts),
        expert_axes=expert_axes if any(n in experts for n in unit.params) else (),
        placement_spans={n: res.placements[n][1] for n, _ in placements},
        ignored_spans={n: res.ignored[n] for n in ignored})


def tensor_param_dim(kind: str, embedding: bool, local: str) -> int | None:
    """The dim a style of `kind` shards a module's own parameter `local` on (None: replicated),
    by its row's `splits` (`planc.resolve.styles.StyleRule.param_dim`)."""
    return STYLES[kind].param_dim(embedding, local)


def tensor_dims(program: Program, graph: ModelGraph) -> dict[str, int]:
    """Canonical parameter -> the dim tensor parallelism shards it on (absent: replicated on the
    tensor axis), by `tensor_param_dim`."""
    out: dict[str, int] = {}
    for op in program.of_type(Parallelize):
        embedding = graph.cls(op.module).endswith("Embedding")
        for local, canonical in graph.own_params(op.module):
            dim = tensor_param_dim(op.style.kind, embedding, local)
            if dim is not None:
                out[canonical] = dim
    return out


PLACING_STYLES = tuple(r.word for r in ROWS if r.places)  # styles that replace parameters with DTensors
SUBTREE_STYLES = tuple(r.word for r in ROWS if r.places == SUBTREE)  # ... of the whole subtree (the others: the module's own)


def tensor_reties(program: Program, graph: ModelGraph) -> list[tuple[str, str]]:
    """(alias path, canonical path) of each tied parameter tensor parallelism unties, to tie again.

    `parallelize_module` replaces a module's parameters with new DTensor parameters, one module
    at a time, so a parameter two modules share (an embedding tied to the output projection)
    comes out as two objects when both owners get a placing style: two weights, trained apart.
    The static check P421 refuses owners placed differently; with one placement, the runtime
    (and the code `planc emit` prints) sets every alias back to the canonical owner's parameter.
    """
    placed: list[tuple[str, bool]] = [(op.module, op.style.kind in SUBTREE_STYLES)
                                      for op in program.of_type(Parallelize) if op.style.kind in PLACING_STYLES]
    if not placed or not graph.tied:
        return []

    def is_placed(module: str) -> bool:
        return any(module == m or (subtree and (not m or module.startswith(m + "."))) for m, subtree in placed)

    out: list[tuple[str, str]] = []
    for alias, canon in graph.aliases.items():
        if alias == canon or canon not in graph.tied:
            continue
        owner, canon_owner = alias.rpartition(".")[0], canon.rpartition(".")[0]
        if is_placed(owner) or is_placed(canon_owner):
            out.append((alias, canon))
    return out


def expert_view(res: Resolution, world: int | None) -> tuple[Axis, ...]:
    """The expert view's axes (torchtitan's sparse mesh): replicate (when it is over 1), the
    experts' FSDP axis `efsdp` and the expert axis, innermost: ranks that share experts' shards
    are `expert` apart, ranks of one expert group are neighbours (they borrow the innermost
    shard x context x tensor ranks). With a pipeline axis it comes first, as on the dense view:
    each pipeline stage's expert view is the submesh of the other axes (one root mesh, as
    torchtitan's sparse mesh under `pp`). Sizes are None when the world is not known."""
    mesh = res.mesh
    sizes = mesh.sizes(world)
    degrees = None if sizes is None else expert_degrees(mesh, sizes)
    ep, efsdp = degrees if degrees is not None else (None, None)
    outer = [a for a in mesh.device_axes if a.role in (Role.PIPELINE, Role.REPLICATE)]
    return (*outer, Axis(Role.SHARD, efsdp, EFSDP), Axis(Role.EXPERT, ep, mesh.axis_name(Role.EXPERT)))


def _experts(res: Resolution, graph: ModelGraph, world: int | None) -> tuple[list[DispatchExperts], dict[str, int]]:
    """The `DispatchExperts` ops, and each expert parameter -> the dim FSDP shards it on: 0, or 1
    when efsdp x expert > experts (torchtitan's rule: dim 0 would leave ranks without an expert)."""
    axis = res.mesh.axis_name(Role.EXPERT)
    if axis is None or not res.experts:
        return [], {}
    sizes = res.mesh.sizes(world)
    degrees = None if sizes is None else expert_degrees(res.mesh, sizes)
    # with a tensor axis over 1, the MoE layer (the container's parent) splits its tokens over it
    tensor = res.mesh.axis_name(Role.TENSOR) if sizes is not None and sizes.get(Role.TENSOR, 1) > 1 else None
    ops, dims = [], {}
    for path in sorted(res.experts, key=graph.pre):
        params = tuple(canonical for _, canonical in graph.own_params(path))
        count = graph.params[params[0]].shape[0] if params else 0
        unit = next((u for u in res.units if params and params[0] in u.params), None)
        averaged = unit is None or unit["gradient_divide_factor"] is None
        layer = path.rpartition(".")[0] if tensor is not None else None
        ops.append(DispatchExperts(path, axis, count, params, res.experts[path], averaged, tensor, layer))
        dim = 1 if degrees is not None and degrees[0] * degrees[1] > count else 0
        dims.update((p, dim) for p in params)
    return ops, dims


def expert_prefetch(res: Resolution, graph: ModelGraph, direction: str) -> dict[str, tuple[str, ...]]:
    """With expert parallelism, each inner unit prefetches the next one in `direction` explicitly
    (torchtitan's choice: the dispatch's host sync for the split sizes stalls the CPU before FSDP's
    implicit prefetch is issued). The plan's own `prefetch` lists win over these."""
    inner = sorted((u for u in res.units if not u.is_root), key=lambda u: graph.pre(u.modules[0]))
    if direction == "backward":
        inner.reverse()
    return {a.name: (b.name,) for a, b in zip(inner, inner[1:])}


def lower(res: Resolution, graph: ModelGraph, world: int | None = None) -> Program:
    """The program for a resolution without errors (`CompiledPlan.program` checks that)."""
    ops: list[Op] = []
    # tensor parallelism first (torchtitan's order): FSDP then shards the TP-sharded
    # parameters on the data-parallel submesh of the same root mesh
    tensor_axis = res.mesh.axis_name(Role.TENSOR)
    if tensor_axis is not None:
        for path in sorted(res.parallel, key=graph.pre):
            setting = res.parallel[path]
            ops.append(Parallelize(path, setting.value, tensor_axis, setting, setting.span))
    # context parallelism next: hooks on the attention modules, before checkpointing wraps them
    context_axis = res.mesh.axis_name(Role.CONTEXT)
    if context_axis is not None:
        ops += [AttendOverContext(path, context_axis, res.context[path]) for path in sorted(res.context, key=graph.pre)]
    # expert parallelism next: the experts keep their rank's experts, before FSDP shards them
    dispatches, expert_dims = _experts(res, graph, world)
    ops += dispatches
    expert_axes = tuple(a.name for a in expert_view(res, world)[:-1] if a.role is not Role.PIPELINE) if dispatches else ()
    for path, setting in res.checkpoint.items():
        ops.append(Checkpoint(path, setting.value, setting))
    for path, setting in res.compile.items():
        ops.append(Compile(path, tuple((setting.value or {}).items()), setting))
    dp_axes = res.mesh.fsdp_axis_names  # shard x context flattened into one axis (Mesh.flattened)
    ops += [_fully_shard(u, res, graph, dp_axes, expert_dims, expert_axes) for u in res.units]
    for direction, table in (("forward", res.prefetch_forward), ("backward", res.prefetch_backward)):
        table = table if not dispatches else {**expert_prefetch(res, graph, direction), **table}
        ops += [SetPrefetch(name, direction, targets) for name, targets in table.items()]
    for u in res.units:
        for key, method in UNIT_METHODS.items():
            setting = u.settings.get(key)
            if setting is not None and setting.value is not None:
                ops.append(UnitMethod(u.name, method, (setting.value,), setting))
    return Program(res.mesh, tuple(ops))


def lower_job(res: Resolution, graph: ModelGraph, world: int | None = None) -> Job:
    """The job for a resolution without errors: one part (the whole model), the dense view, the
    one-stage schedule over the `step` line's microbatches, `loss_parallel()` as a step op when
    the plan asks for it, and with a context axis the batch sharded along the sequence
    (`ShardBatch`); with expert-parallel experts, the expert view (`expert_view`). With a
    pipeline: one part per stage (`pipeline_job`), run by torch's schedule over the `pipeline`
    line's microbatches (`planc.lower.schedules.schedule`)."""
    program = lower(res, graph, world)
    step_ops: tuple = tuple(LossParallel(op.module, op.origin) for op in program.of_type(Parallelize)
                            if op.style.loss_parallel)
    attends = program.of_type(AttendOverContext)
    if attends:
        step_ops += (ShardBatch(attends[0].axis, BATCH_TENSORS, BALANCE, attends[0].origin),)
    step = res.step
    schedule = step_schedule() if step is None else step_schedule(step.value.microbatches, step.value.sync, step)
    views = (View(DENSE, res.mesh.device_axes),)
    if program.of_type(DispatchExperts):
        views += (View(EXPERT, expert_view(res, world)),)
    job = Job(res.mesh, views, (Part(0, ("",), program),), schedule, step_ops)
    pp = res.pipeline
    if pp is None:
        return job
    # the pipeline's stages, run by torch's schedule over the plan's microbatches (planc/lower/pipeline.py)
    piped = schedules.schedule(pp.schedule, pp.pp, pp.microbatch_count, pp.stages_per_rank)
    return pipeline_job(job, pp.stages, dataclasses.replace(piped, origin=Setting(pp, pp.span, "pipeline", 0)))
