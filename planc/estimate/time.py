"""Step-time model: communication bytes, FLOPs and the FSDP2 overlap schedule of one training step.

Everything here is an **estimate**, computed without torch.distributed and without a GPU,
from the lowered program (`planc/lower/program.py`), the model graph, one traced step of the
model (`StepProfile`) and a hardware profile (`planc/estimate/hardware.py`).

API (what `planc explain` and `planc suggest` call)::

    from planc.estimate.flops import step_profile
    profile = step_profile(graph, input_shape=(8, 4096), dtype=torch.bfloat16)  # once per model + input
    st = estimate_step_time(compiled, world=64, hardware="h100", profile=profile)
    st.total_s, st.exposed_comm_s, st.tokens_per_s, st.mfu, st.per_unit[i].collectives ...

`planc.estimate.flops.step_profile(graph, inputs=None, *, input_shape=None, loss=None, dtype=None)
-> StepProfile | None`
    Runs one forward, loss and backward of the plain model on fake CPU tensors (no memory)
    under torch's `FlopCounterMode`, and records per module path: forward and backward FLOPs,
    what `full` and `selective` checkpointing of that module would rerun, the (module, FLOPs)
    segments in execution order, and the shapes of each module's first floating-point input
    and output (for tensor-parallel collectives). It does not depend on the plan: cached per
    (graph, input, loss, dtype), so a search over units, reshard, precision, offload,
    checkpointing, prefetch and mesh sizes traces the model once. `dtype` runs the step with
    parameters in that dtype (MoE grouped matmuls need bf16); FLOPs do not depend on it.

`estimate_step_time(plan, *, world, hardware="h100", profile=None, graph=None, input_shape=None,
inputs=None, loss=None, optimizer="adamw", efficiency=None) -> StepTime`
    `plan` is a `CompiledPlan` or a lowered `Program` (then `graph` is required). `hardware`
    is a profile name, a TOML/JSON path or a `Hardware`; `efficiency` overrides the profile's
    achievable fraction of peak FLOP/s. Without a profile (and no input), FLOPs are 0 and only
    communication is timed. Given a profile, pure arithmetic over the program: no tracing,
    no torch ops; about 5 ms for the 126-block 405B-shaped model. Without one but with an
    input, the profile is built (and cached) in the plan's main compute dtype.

`StepTime` holds `per_unit` (a `UnitTime` per `fully_shard` call, in program order: its
collectives as `Collective(kind, axis, ranks, bytes, phase)`, forward/backward/recompute
FLOPs, compute seconds), `totals` of bytes per (kind, axis), `compute_s`, `comm_s` (all
collectives' busy time), `exposed_comm_s` (collective time the compute stream waits for),
`optimizer_s`, `total_s`, `tokens_per_s`, `mfu`, the `hardware` and the `assumptions` (the
list of sentences every output prints); `order`: the schedule's (kind, unit, phase) events in issue order.

What is modelled (torch 2.13 FSDP2; docs/time-model.md says it at length):

* bytes, exact: a unit all-gathers once per unshard all its parameters' shards, dim 0
  padded to a multiple of the shard size (`FSDPParam` chunks and pads), in `param_dtype`
  (nccl-tests size = the gathered output); a unit resharded after forward (`true`) gathers
  again in backward on the shard axis; `reshard after_forward = N` gathers in backward within
  groups of N ranks; `false` does not gather again; one reduce-scatter per unit in backward of
  the gradients (padded, `reduce_dtype`; size = the input); with HSDP one all-reduce of the
  reduce-scatter output across the replicate axis; offload copies the sharded parameters
  host->device at each all-gather and the sharded gradients device->host; tensor-parallel
  styles move activations (see `tp_collectives`).
* FLOPs: `FlopCounterMode` counts per module; a unit's are those of the modules it owns
  (nested units' excluded); with a tensor axis, the FLOPs one tensor rank runs, counted on
  its emulated step (`flops.tensor_rank_profile`: a split module its share, a module left
  whole on every rank in full; without an input to run it, every FLOP divided by T, said so
  in the assumptions), and the optimizer step over each rank's local parameters;
  checkpointing adds what torch's checkpoint reruns in backward (its early stop skips the
  ops after the last saved tensor; `selective` reruns only ops that are not matmuls or
  attention, which FlopCounterMode counts as 0).
* time: compute = FLOPs / (peak for the unit's compute dtype x efficiency); collectives in
  alpha-beta form on the link their group spans; the schedule FSDP2 runs: forward all-gathers
  issued at each unit's pre-forward (implicitly one unit ahead, since the CPU runs ahead,
  at most two all-gathers in flight) or by explicit prefetch lists; backward all-gathers at
  pre-backward with the default prefetch of the next unit in reverse post-forward order (or the
  explicit lists); reduce-scatters after each unit's backward compute, overlapping the next
  unit's (a unit whose inputs need no gradient, e.g. an embedding: after all backward compute,
  root first; `lower.fsdp.step_order`); collectives share one network queue in issue order;
  TP collectives block compute.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable

import torch

from planc.estimate.collectives import (  # noqa: F401  (re-exported: the step-time API)
    Collective,
    _ancestors_in,
    _itemsize,
    _Net,
    collective_s,
    context_collectives,
    expert_all_to_alls,
    recompute_collectives,
    totals,
    tp_collectives,
    unit_collectives,
)
from planc.estimate.expert_local import expert_degree
from planc.estimate.hardware import Hardware
from planc.estimate.hardware import hardware as hardware_of
from planc.lower import fsdp as fsdp_rules
from planc.lower.fsdp import compute_dtypes, default_backward_prefetch, fsdp_shape, root_index, shard_numel
from planc.lower.fsdp import owners as fsdp_owners
from planc.lower.job import FORWARD, FULL_BACKWARD, LossParallel, Reader, Schedule, ShardBatch, step_schedule
from planc.lower.lowering import tensor_dims
from planc.lower.pipeline import inside
from planc.lower.program import (
    AttendOverContext,
    Checkpoint,
    Compile,
    DispatchExperts,
    FullyShard,
    Parallelize,
    Program,
    SetPrefetch,
    UnitMethod,
)
from planc.resolve.step import check_splits

PHASES = ("forward", "backward", "optimizer")
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "host_to_device", "device_to_host")


@dataclass
class UnitTime:
    """One unit's share of the step."""

    name: str
    index: int
    collectives: list[Collective] = field(default_factory=list)
    forward_flops: int = 0
    backward_flops: int = 0
    recompute_flops: int = 0
    compute_dtype: str = "float32"
    forward_s: float = 0.0
    backward_s: float = 0.0    # including recompute
    comm_s: float = 0.0        # busy time of this unit's collectives
    exposed_s: float = 0.0     # compute waiting for this unit's gathers (and the step's tail, on the last reducer)

    def bytes(self, kind: str | None = None, axis: str | None = None, phase: str | None = None) -> int:
        return sum(c.bytes * c.times for c in self.collectives if (kind is None or c.kind == kind)
                   and (axis is None or c.axis == axis) and (phase is None or c.phase == phase))

    @property
    def flops(self) -> int:
        return self.forward_flops + self.backward_flops + self.recompute_flops


@dataclass
class StepTime:
    """The estimated time of one training step on one rank (see the module docstring)."""

    world: int
    hardware: Hardware
    per_unit: list[UnitTime]
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    optimizer_s: float
    total_s: float
    tokens: int | None
    model_flops: int
    assumptions: list[str]
    efficiency: float = 0.6
    tp: int = 1
    order: list[tuple[str, str, str]] = field(default_factory=list)  # the schedule's (kind, unit, phase) events
    pipeline: object | None = None  # a pipeline job: its `roles.PipelineTime` (per_unit: the binding rank's stages)

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second per rank (None without an input)."""
        return self.tokens / self.total_s if self.tokens and self.total_s else None

    @property
    def mfu(self) -> float | None:
        """Model FLOPs (forward + backward, no recompute) / (step time x peak bf16 FLOP/s)."""
        if not self.model_flops or not self.total_s:
            return None
        return self.model_flops / (self.total_s * self.hardware.bf16_flops)

    def totals(self) -> dict[str, dict[str, int]]:
        return totals(self.per_unit)


def main_dtype(program: Program, graph, modules: Iterable[str] | None = None) -> torch.dtype | None:
    """The compute dtype most parameters are gathered in (the dtype a step profile is run in); with
    `modules`, of the parameters inside those subtrees only (a pipeline stage's: the other stages'
    parameters, outside its units, would count in their stored dtype)."""
    counts: dict[torch.dtype, int] = {}
    for name, dtype in compute_dtypes(program, graph).items():
        if modules is not None and not inside(name.rpartition(".")[0], modules):
            continue
        if dtype.is_floating_point:
            counts[dtype] = counts.get(dtype, 0) + graph.params[name].numel
    return max(counts, key=counts.get) if counts else None


# ===================================================================== ownership


def owners(program: Program, graph, paths: Iterable[str]) -> dict[str, int]:
    """Module path -> index of the unit whose parameters it uses (`planc.lower.fsdp.owners`)."""
    return fsdp_owners(program.units, paths)


# ===================================================================== the schedule


def _assumptions(hw: Hardware, eff: float, tp: int) -> list[str]:
    return [
        f"estimates, not measurements: hardware `{hw.name}` ({hw.source or 'user profile'})",
        f"compute = counted FLOPs / ({eff:.0%} of peak dense FLOP/s for the unit's compute dtype: "
        f"bf16 {hw.bf16_flops / 1e12:.0f} TFLOP/s, fp32 {hw.fp32_flops / 1e12:.1f} TFLOP/s); ops FlopCounterMode "
        "counts 0 (norms, elementwise, softmax) take no time",
        f"collectives: alpha + bytes x bus factor / busbw (nccl-tests); within a node ({hw.gpus_per_node} GPUs) "
        f"busbw {hw.intra.busbw / 1e9:.0f} GB/s, alpha {hw.intra.alpha_s * 1e6:.0f} us; across nodes "
        f"{hw.inter.busbw / 1e9:.0f} GB/s, {hw.inter.alpha_s * 1e6:.0f} us; ranks are laid out tensor axis "
        "innermost, then shard, then replicate",
        "FSDP2's schedule: forward all-gathers issued at each unit's pre-forward or by prefetch lists, at most "
        "two units ahead of compute; backward all-gathers prefetched one unit ahead (or by the lists); "
        "reduce-scatters after each unit's backward; all FSDP collectives share one network in issue order",
        "tensor-parallel collectives block compute (no async TP)" if tp > 1 else "no tensor parallelism",
        f"optimizer step: memory-bound, bytes read and written / HBM bandwidth ({hw.hbm_bw / 1e9:.0f} GB/s); "
        f"offloaded units step on the host at {hw.host_optimizer_bw / 1e9:.0f} GB/s, not overlapped",
        "not modelled: kernel launch and CPU overheads, stragglers, memory-bandwidth-bound kernels, "
        "bandwidth shared by concurrent tensor-parallel and FSDP traffic",
    ]


BLOCKING_AXES = ("tensor", "context", "expert")  # activation collectives: compute waits for them (not FSDP's overlap)
_CONTEXT_NOTE = ("context parallelism ({cp} ranks): a rank computes 1/{cp} of its batch's FLOPs (the head-tail cut "
                 "balances causal attention; the math attention computes its shard's scores against every key); "
                 "each styled attention's K/V all-gathers (before a grouped-query repeat) and their gradients' "
                 "reduce-scatters on the context axis block compute, as tensor-parallel collectives do")
OUTSIDE = "(outside units)"  # the row of compute no unit owns (plans with `root none`)
OPTIMIZER_BYTES = {"adamw": 7, "adam": 7, "adamw_fused": 7, "adam_fused": 7, "sgd": 3, "none": 0}


# What the step time plays: the units' collectives and prefetch order, the tensor styles'
# collectives and FLOP split, the context styles' K/V gathers (`AttendOverContext`) and the
# sequence cut (`ShardBatch`: a rank computes 1 / context of its batch's FLOPs), checkpointing's
# recompute, the loss in the traced profile, the experts' all-to-alls (`DispatchExperts`, blocking,
# balanced routing: a rank computes the FLOPs of its batch's routed rows, as without the axis; or a measured
# histogram: the combine's bytes and the experts' FLOPs are its binding rank's received rows);
# `compile` and unit methods are not modelled (the efficiency factor stands for kernels).
READER = Reader("the step-time estimate",
                (FullyShard, Parallelize, AttendOverContext, DispatchExperts, Checkpoint, Compile, SetPrefetch,
                 UnitMethod),
                (FORWARD, FULL_BACKWARD), (LossParallel, ShardBatch))


def estimate_step_time(plan, *, world: int, hardware: "str | Hardware" = "h100", profile=None, graph=None,
                       input_shape: tuple[int, ...] | None = None, inputs=None, loss=None,
                       optimizer: str = "adamw", efficiency: float | None = None) -> StepTime:
    """The estimated step time of `plan` at `world` ranks (see the module docstring for the contract)."""
    from planc.estimate.flops import step_profile

    notes: list[str] = []
    schedule = step_schedule()
    if isinstance(plan, Program):
        program = READER.program(plan)
        if graph is None:
            raise ValueError("estimating a Program needs its model graph")
    elif len(plan.job.parts) > 1:  # a pipeline: time per role (planc/estimate/roles.py)
        from planc.estimate.roles import step_time_of_pipeline
        return step_time_of_pipeline(plan, world=world, hardware=hardware, profile=profile, graph=graph,
                                     input_shape=input_shape, inputs=inputs, loss=loss, optimizer=optimizer,
                                     efficiency=efficiency)
    else:
        job = READER.compiled(plan)
        program, graph, schedule = job.program, graph or plan.graph, job.schedule
    k = schedule.microbatches
    if k > 1:  # the profile is one microbatch's; the schedule runs it k times
        inputs, input_shape = _microbatch(inputs, input_shape, k)
        notes.append(f"{schedule.origin.value.show()}: compute, gathers and tensor-parallel collectives "
                     f"per microbatch; the input is the step's batch")
    routing = getattr(plan, "routing", None)  # a measured routing histogram (CompiledPlan.routing)
    if routing is not None and any(True for _ in program.of_type(DispatchExperts)):
        notes.append(f"all-to-alls and the experts' compute: {routing.describe(expert_degree(program, world))}")
    hw = hardware_of(hardware)
    eff = hw.efficiency if efficiency is None else float(efficiency)
    if not 0 < eff <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {eff}")
    if profile is None and (inputs is not None or input_shape is not None):
        profile = step_profile(graph, inputs, input_shape=input_shape, loss=loss, dtype=main_dtype(program, graph))
    sizes = program.mesh.sizes(world) or {"shard": world}
    tp = sizes.get("tensor", 1)
    cp = sizes.get("context", 1) if any(True for _ in program.of_type(AttendOverContext)) else 1
    if cp > 1:
        notes.append(_CONTEXT_NOTE.format(cp=cp))
    units = program.units
    fsdp = unit_collectives(program, graph, world, schedule)
    per_unit = [UnitTime(u.name, i, list(cs)) for i, (u, cs) in enumerate(zip(units, fsdp))]
    compute = compute_dtypes(program, graph)
    for i, u in enumerate(units):
        if u.params:
            per_unit[i].compute_dtype = str(compute[u.params[0]]).replace("torch.", "")
    root = root_index(units)
    if root is None:  # `root none`: compute outside every unit has a row of its own, with no collectives
        per_unit.append(UnitTime(OUTSIDE, len(units)))

    fwd_segments: list[tuple[int, float]] = []
    bwd_segments: list[tuple[int, float]] = []
    tp_cs: dict[str, list[Collective]] = {}
    model_flops, per_rank = 0, None
    if profile is not None:
        per_rank, note = _tensor_rank(program, graph, profile, inputs, input_shape, loss, tp)
        if note:
            notes.append(note)
        own = owners(program, graph, set(profile.forward) | set(profile.backward) | set(profile.order) | {""})
        computed = per_rank or profile
        if routing is not None:  # the estimated expert rank computes the rows it receives
            computed = routing.reweighted(computed, [op.module for op in program.of_type(DispatchExperts)],
                                          expert_degree(program, world))
        model_flops, fwd_segments, bwd_segments = _compute(program, graph, computed,
                                                           (1 if per_rank else tp) * cp, per_unit, own, hw, eff)
        if computed is not (per_rank or profile):  # MFU counts a rank's share of the model's FLOPs, not the busiest's
            model_flops = (per_rank or profile).total // ((1 if per_rank else tp) * cp)
        tp_cs = tp_collectives(program, graph, profile, world, cp)
        for path, cs in recompute_collectives(program, profile, tp_cs).items():
            tp_cs[path] = tp_cs[path] + cs
        for path, cs in context_collectives(program, per_rank or profile, world).items():  # blocking, as TP's
            tp_cs[path] = tp_cs.get(path, []) + cs
        for path, cs in expert_all_to_alls(program, graph, world, profile.tokens, routing).items():  # blocking (host sync)
            tp_cs[path] = tp_cs.get(path, []) + cs
        tp_cs = {path: [dataclasses.replace(c, times=k) for c in cs] for path, cs in tp_cs.items()}
        for path, cs in tp_cs.items():
            per_unit[own.get(path, root if root is not None else len(units))].collectives.extend(cs)
    for u in per_unit:
        u.comm_s = sum(collective_s(c, hw) * c.times for c in u.collectives)

    # TP collectives: blocking, at their module's forward / backward
    tp_s = sum(collective_s(c, hw) * c.times for cs in tp_cs.values() for c in cs)

    total_s, compute_s, net, order = _schedule(program, per_unit, fwd_segments, bwd_segments, hw, root, schedule,
                                               fsdp_rules.step_order(units, graph, profile))
    for u in per_unit:  # `_compute` filled in one microbatch's
        u.forward_flops, u.backward_flops, u.recompute_flops = k * u.forward_flops, k * u.backward_flops, \
            k * u.recompute_flops
        u.forward_s, u.backward_s = k * u.forward_s, k * u.backward_s
    model_flops *= k
    total_s += tp_s
    compute_s_all = compute_s
    optimizer_s = _optimizer_s(program, graph, sizes, optimizer, hw)
    total_s += optimizer_s
    exposed = max(0.0, total_s - compute_s_all - optimizer_s)
    tokens = None
    if profile is not None and profile.tokens:
        tokens = profile.tokens * k * (world // (tp * cp))
    return StepTime(world, hw, per_unit, compute_s_all, net.busy + tp_s, exposed, optimizer_s, total_s, tokens,
                    model_flops, _assumptions(hw, eff, tp) + notes, efficiency=eff, tp=tp, order=order)


def _optimizer_s(program: Program, graph, sizes: dict, optimizer: str, hw: Hardware) -> float:
    """The optimizer step: memory-bound, each unit's local trainable bytes read and written (HBM, or
    the host for offloaded units), FSDP's shard over shard x context, a tensor split's local share."""
    tp = sizes.get("tensor", 1)
    shard = sizes.get("shard", 1) * sizes.get("context", 1)  # FSDP's group: shard x context, flattened
    split = tensor_dims(program, graph) if tp > 1 else {}  # a parameter no rule splits is whole on every tensor rank
    on_device = on_host = 0
    for u in program.units:
        n = sum(shard_numel(fsdp_shape(graph.params[name].shape, split.get(name), tp), shard)
                * _itemsize(graph.params[name].dtype)
                for name in u.params if graph.params[name].requires_grad) * OPTIMIZER_BYTES.get(optimizer, 7)
        if u.policy.offload.enabled:
            on_host += n
        else:
            on_device += n
    return on_device / hw.hbm_bw + on_host / hw.host_optimizer_bw


def _tensor_rank(program: Program, graph, profile, inputs, input_shape, loss, tp: int):
    """One tensor rank's compute profile (`flops.tensor_rank_profile`) when the plan has a tensor
    axis and the step's input is known, with a note for the assumptions when it cannot be had."""
    from planc.estimate.flops import tensor_rank_profile
    from planc.estimate.trace import TraceError

    if tp <= 1 or not any(True for _ in program.of_type(Parallelize)):
        return None, None
    if inputs is None and input_shape is None:
        return None, ("FLOPs per tensor rank taken as the plain step's / tensor degree for every module (no input "
                      "given to count one rank's step; a module left whole on each rank is under-counted)")
    try:
        return tensor_rank_profile(graph, program, inputs, input_shape=input_shape, loss=loss, tp=tp), None
    except TraceError as err:
        return None, f"FLOPs per tensor rank taken as the plain step's / tensor degree: {err}"


def _compute(program: Program, graph, flops, div: int, per_unit: list[UnitTime], own: dict[str, int],
             hw: Hardware, eff: float) -> tuple[int, list[tuple[int, float]], list[tuple[int, float]]]:
    """Each unit's forward, backward and recompute FLOPs and seconds from a compute profile (one
    rank's FLOPs are the profile's / `div`), the model FLOPs, and the forward and backward compute
    segments (unit index, seconds) in execution order."""

    # recompute: what torch's checkpoint reruns of the module in backward (`full` or `selective`)
    recompute: dict[str, int] = {}
    for op in program.of_type(Checkpoint):
        table = flops.recompute_selective if op.mode == "selective" else flops.recompute_full
        recompute[op.module] = table.get(op.module, 0)
    own.update(owners(program, graph, set(recompute) | set(flops.forward) | set(flops.backward)))
    for path, n in flops.forward.items():
        per_unit[own[path]].forward_flops += n // div
    for path, n in flops.backward.items():
        per_unit[own[path]].backward_flops += n // div
    for path, n in recompute.items():
        per_unit[own[path]].recompute_flops += n // div
    rate = [hw.flops(u.compute_dtype) * eff for u in per_unit]
    fwd = [(own[path], n / div / rate[own[path]]) for path, n in flops.forward_segments]
    # recompute runs at the start of the checkpointed module's backward
    bwd: list[tuple[int, float]] = []
    pending = dict(recompute)
    checkpointed = _ancestors_in(pending, {p for p, _ in flops.backward_segments})
    for path, n in flops.backward_segments:
        for m in checkpointed.get(path, ()):
            if m in pending:
                bwd.append((own[m], pending.pop(m) / div / rate[own[m]]))
        bwd.append((own[path], n / div / rate[own[path]]))
    for u in per_unit:
        r = rate[u.index]
        u.forward_s = u.forward_flops / r
        u.backward_s = (u.backward_flops + u.recompute_flops) / r
    return flops.total // div, fwd, bwd


def _microbatch(inputs, input_shape, k: int):
    """The inputs of one of `k` microbatches of a step's (`MicrobatchError` when they do not divide)."""
    from planc.estimate.trace import Example

    if inputs is not None:
        return Example.of(inputs).microbatch(k), input_shape
    if input_shape is not None:
        check_splits(tuple(input_shape), k)
        return None, (input_shape[0] // k, *input_shape[1:])
    return None, None


def _schedule(program: Program, per_unit: list[UnitTime], fwd: list[tuple[int, float]],
              bwd: list[tuple[int, float]], hw: Hardware, root: int | None,
              schedule: Schedule | None = None, fsdp_order=([], {}, [])) -> tuple[float, float, _Net, list]:
    """Replay FSDP2's overlap of collectives with compute over the schedule's actions (forward and
    backward of each microbatch); returns (end of backward, compute seconds, network, events)."""
    schedule = schedule or step_schedule()
    sim = _Overlap(per_unit, hw, *fsdp_order)
    segs, order = [], []
    for action in schedule.actions[0]:
        if action.kind == FORWARD:
            segs, order = sim.forward(program, fwd, root)
        else:
            sim.reducing = schedule.reduces(action)
            sim.backward(program, bwd, segs, order, root)
    end = max(sim.t, sim.net.free, sim.pcie.free)
    if end > sim.t and sim.last_rs is not None:  # the tail: collectives still running after the last compute
        per_unit[sim.last_rs].exposed_s += end - sim.t
    return end, sim.compute_s, sim.net, sim.order


class _Overlap:
    """One rank's compute stream, its network and its host link, as FSDP2 drives them in one step."""

    def __init__(self, per_unit: list[UnitTime], hw: Hardware, starts=(), post=(), late=()) -> None:
        self.per_unit, self.hw, self.starts, self.post, self.late = per_unit, hw, list(starts), dict(post), list(late)
        self.names = [u.name for u in per_unit]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.net, self.pcie = _Net(), _Net()
        self.t = self.compute_s = 0.0
        self.last_rs: int | None = None  # the last unit that reduced its gradients
        self.reducing, self.order, self.phase = True, [], "forward"  # `sync = last`: False before the last microbatch;
        # order: the (kind, unit, phase) events issued or started, in order (StepTime.order)

    def wait(self, i: int, ready: float) -> None:
        """Compute of unit i waits for its all-gather: the wait is exposed communication, billed to i."""
        self.order.append(("compute", self.names[i], self.phase))
        if ready > self.t:
            self.per_unit[i].exposed_s += ready - self.t
            self.t = ready

    def compute(self, seconds: float) -> None:
        self.t += seconds
        self.compute_s += seconds

    def cols(self, i: int, kind: str, phase: str) -> list[Collective]:
        return [c for c in self.per_unit[i].collectives if c.kind == kind and c.phase == phase
                and c.axis not in BLOCKING_AXES]

    def gather(self, i: int, phase: str, ready: float) -> float:
        """Issue unit i's all-gather (after its host copy, if offloaded); returns when it is done."""
        done = ready
        for c in self.cols(i, "host_to_device", phase):
            done = self.pcie.run(done, collective_s(c, self.hw))
        end = done
        for c in self.cols(i, "all_gather", phase):
            self.order.append(("all_gather", self.names[i], phase))
            end = self.net.run(done, collective_s(c, self.hw))
        return end

    # ---------------------------------------------------------------- forward
    def forward(self, program: Program, fwd: list[tuple[int, float]], root: int | None):
        """Forward: all-gathers at each unit's pre-forward or by its prefetch list, at most two units
        ahead of compute; returns the forward segments and the units in pre-forward order."""
        n, self.phase = len(self.per_unit), "forward"
        order = list(dict.fromkeys(self.starts + [i for i, _ in fwd]))  # pre-forward order (`step_order`)
        if root is not None:
            order = [root] + [i for i in order if i != root]
        order += [i for i in range(n) if i not in order]
        pf_fwd = program.prefetch("forward")
        ready_at: dict[int, float] = {}
        starts: list[float] = []
        issued: set[int] = set()
        seen: set[int] = set()
        begin = self.t  # a later microbatch's forward starts after the previous backward

        def pre_forward(i: int) -> None:
            # the all-gather streams wait for the copy-out two units back (at most two in flight)
            k = len(starts)
            limit = starts[k - 2] if k >= 2 else begin
            for j in [i] + [self.index[x] for x in pf_fwd.get(self.names[i], ()) if x in self.index]:
                if j not in issued:
                    issued.add(j)
                    ready_at[j] = self.gather(j, "forward", limit)

        def start(i: int) -> None:
            seen.add(i)
            pre_forward(i)
            self.wait(i, ready_at.get(i, 0.0))
            starts.append(self.t)

        segs = list(fwd) or [(i, 0.0) for i in order]
        if root is not None and segs[0][0] != root:
            segs.insert(0, (root, 0.0))
        for i, sec in segs:
            if i not in seen:
                for j in order[:order.index(i) + 1]:  # i, after the units that run before it with no FLOPs
                    if j not in seen:
                        start(j)
            self.compute(sec)
        for i in order:  # units with no compute of their own still gather
            if i not in seen:
                start(i)
        return segs, order

    # ---------------------------------------------------------------- backward
    def backward(self, program: Program, bwd: list[tuple[int, float]], segs, order: list[int],
                 root: int | None) -> None:
        """Backward: each unit's all-gather at its pre-backward, the next one prefetched (or its list);
        its reduce-scatter (and all-reduce) after its last backward segment."""
        self.phase, last_fwd = "backward", {i: k for k, (i, _) in enumerate(segs)}
        # post-forward order: when each unit's forward returned (`step_order`), else its last forward segment
        post_forward = sorted((i for i in order if i != root), key=lambda i: (self.post.get(i, 0), last_fwd.get(i, -1)))
        bwd_order = list(reversed(post_forward))
        pf_bwd = program.prefetch("backward")
        b_ready: dict[int, float] = {}

        def bgather(j: int, ready: float) -> None:
            if j not in b_ready:
                b_ready[j] = self.gather(j, "backward", ready) if self.cols(j, "all_gather", "backward") else ready

        def pre_backward(i: int) -> None:
            bgather(i, self.t)
            if self.names[i] in pf_bwd:
                targets = [self.index[x] for x in pf_bwd[self.names[i]] if x in self.index]
            else:
                targets = default_backward_prefetch(post_forward, i, root)
            for j in targets:
                bgather(j, self.t)

        bsegs = list(bwd) or [(i, 0.0) for i in bwd_order]
        last_b = {i: k for k, (i, _) in enumerate(bsegs)}
        b_seen: set[int] = set()
        def begin(j: int) -> None:  # j's pre-backward, its compute's wait; with no backward compute, its reduction
            b_seen.add(j)
            pre_backward(j)
            self.wait(j, b_ready.get(j, self.t))
            if j not in last_b and j not in self.late:
                self.post_backward(j)
        if root is not None:
            b_seen.add(root)
            pre_backward(root)
        for k, (i, sec) in enumerate(bsegs):
            if i not in b_seen:  # i, after the units whose output's gradient comes first (a unit around i)
                for j in bwd_order[:bwd_order.index(i) + 1] if i in bwd_order else [i]:
                    if j not in b_seen:
                        begin(j)
            self.compute(sec)
            if last_b[i] == k and i not in self.late:
                self.post_backward(i)
        for i in [j for j in bwd_order if j not in b_seen]:  # units with no backward compute (token embeddings)
            begin(i)
        for i in self.late:  # FSDP2's final callback (`step_order`)
            self.post_backward(i)

    def post_backward(self, i: int) -> None:
        """Unit i's reduce-scatter, all-reduce across replicas, and host copy of its gradients."""
        if not self.reducing:  # FSDP2 keeps the unsharded gradients for the next microbatch
            return
        if self.cols(i, "reduce_scatter", "backward") or self.cols(i, "all_reduce", "backward"):
            self.last_rs = i
        end = self.t
        for c in self.cols(i, "reduce_scatter", "backward") + self.cols(i, "all_reduce", "backward"):
            self.order.append((c.kind, self.names[i], "backward"))
            end = self.net.run(end, collective_s(c, self.hw))
        for c in self.cols(i, "device_to_host", "backward"):
            self.pcie.run(end, collective_s(c, self.hw))


__all__ = ["Collective", "UnitTime", "StepTime", "estimate_step_time", "unit_collectives", "hardware_of", "KINDS"]
