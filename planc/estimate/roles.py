"""Time per role of a pipeline job: each stage's costs from the model's FLOPs and collectives, played on the timeline.

A pipeline job (`planc/lower/pipeline.py::pipeline_job`) has one part per stage and one role
per pipeline rank. `estimate_pipeline_time` prices each stage and plays the schedule on the
discrete-event timeline (`planc/estimate/timeline.py`):

* compute: the FLOPs `FlopCounterMode` counts per module in one microbatch's step of the
  whole model (`flops.step_profile`, the step's batch cut into the schedule's microbatches),
  summed over the stage's module subtrees; the ops outside every module (the loss) on the
  last stage; checkpointing's recompute of the stage's checkpointed modules in its backward;
  seconds at the hardware's peak for the stage's compute dtype x efficiency, as
  `planc/estimate/time.py` prices them. A split backward is half input, half weight gradient
  (each one matmul per linear layer). With a tensor axis, one tensor rank's share is 1/T.
* point-to-point: the boundary activation (the first floating-point output of the stage's last
  module in forward order, one microbatch) and its gradient, alpha + bytes / busbw on the link
  two adjacent pipeline ranks span (the pipeline axis is outermost: `world / pp` ranks apart,
  across nodes when that reaches past a node).
* FSDP: each stage's units' collectives on the stage's data-parallel ranks
  (`collectives.unit_collectives`); torch's `PipelineStage` keeps gradients unreduced and the
  parameters gathered until the last microbatch (`pipelining/stage.py`), so a stage gathers
  once, before its first forward (again before every forward and backward when its units
  reshard after forward), and reduces once, after its last backward; the optimizer step per
  rank over its stages' parameters (`time.estimate_step_time` without FLOPs prices both).

The step time is the slowest rank's; tokens per second count the whole world's tokens of one
step, MFU the model FLOPs (forward and backward, no recompute) over step time x world x peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planc.estimate.collectives import collective_s
from planc.estimate.hardware import Hardware
from planc.estimate.hardware import hardware as hardware_of
from planc.estimate.time import estimate_step_time, main_dtype
from planc.estimate.timeline import ACTIONS, Timeline, simulate
from planc.lower.job import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Job, LossParallel, Reader
from planc.lower.pipeline import inside
from planc.lower.program import Checkpoint, Compile, FullyShard, Parallelize, Program, SetPrefetch, UnitMethod

# What the time per role plays: each stage's units (collectives, optimizer state), tensor styles
# (1/T of the FLOPs), checkpointing's recompute; every action of torch's vocabulary (timeline.py).
READER = Reader("the pipeline step-time estimate", (FullyShard, Parallelize, Checkpoint, Compile, SetPrefetch,
                                                    UnitMethod), ACTIONS, (LossParallel,))


@dataclass
class StageTime:
    """One stage's costs per microbatch, and its collectives per step."""

    stage: int
    modules: tuple[str, ...]
    forward_flops: int = 0
    backward_flops: int = 0        # including recompute
    input_share: float = 0.5       # a split backward's input half, of its FLOPs (`split_backward`)
    forward_s: float = 0.0
    backward_s: float = 0.0
    boundary_bytes: int = 0        # the activation sent to the next stage, one microbatch
    # phase -> (seconds, again) of each unit's all-gather; `again`: its unit reshards after forward,
    # so it gathers before every forward and backward, not only before the stage's first forward
    gathers: dict[str, list[tuple[float, bool]]] = field(default_factory=dict)
    reductions: list[float] = field(default_factory=list)
    optimizer_s: float = 0.0
    collectives: list = field(default_factory=list)  # the stage's FSDP collectives (`Collective`), once each


@dataclass
class PipelineTime:
    """The estimated step of a pipeline job (see the module docstring)."""

    world: int
    pp: int
    hardware: Hardware
    stages: list[StageTime]
    timeline: Timeline
    tokens: int | None
    model_flops: int               # forward + backward of the whole model over the step, all ranks
    assumptions: list[str]

    @property
    def step_s(self) -> float:
        return self.timeline.step_s

    @property
    def bubble(self) -> float:
        return self.timeline.bubble()

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.step_s if self.tokens and self.step_s else None

    @property
    def mfu(self) -> float | None:
        if not self.model_flops or not self.step_s:
            return None
        return self.model_flops / (self.step_s * self.world * self.hardware.bf16_flops)


class _JobCosts:
    """`timeline.Costs` from the stages' prices."""

    def __init__(self, stages: list[StageTime], p2p: dict[tuple[int, int], float], owner: dict[int, int]):
        self.stages, self.p2p, self.owner = stages, p2p, owner

    def compute_s(self, stage: int, kind: str) -> float:
        st = self.stages[stage]
        if kind == FORWARD:
            return st.forward_s
        if kind == BACKWARD_INPUT:
            return st.backward_s * st.input_share
        if kind == BACKWARD_WEIGHT:
            return st.backward_s * (1 - st.input_share)
        return st.backward_s

    def p2p_s(self, src: int, dst: int) -> float:
        return 0.0 if self.owner[src] == self.owner[dst] else self.p2p.get((min(src, dst), max(src, dst)), 0.0)

    def gathers(self, stage: int, phase: str, first: bool) -> list[float]:
        return [sec for sec, again in self.stages[stage].gathers.get(phase, ()) if again or first]

    def reductions(self, stage: int) -> list[float]:
        return self.stages[stage].reductions

    def optimizer_s(self, stages: tuple[int, ...]) -> float:
        return sum(self.stages[s].optimizer_s for s in stages)


def stage_world(program: Program, world: int, pp: int) -> int:
    """The ranks a stage's program runs on: `world` when the mesh has the pipeline axis (its data
    and tensor axes are then per stage already), else `world / pp`."""
    sizes = program.mesh.sizes(world) or {}
    return world if sizes.get("pipeline", 1) == pp and pp > 1 and "pipeline" in sizes else world // pp


def whole_program(job: Job) -> Program:
    """The program of the whole model a pipeline job was cut from: every stage's ops, one root
    unit over every stage root's parameters (what the one-part trace of the model runs)."""
    import dataclasses

    ops, root = [], None
    for part in job.parts:
        for op in part.program.ops:
            if isinstance(op, FullyShard) and op.is_root:
                root = op if root is None else dataclasses.replace(root, params=root.params + op.params)
            else:
                ops.append(op)
    return Program(job.parts[0].program.mesh, tuple(ops) + ((root,) if root is not None else ()))


def boundaries(job: Job, graph, inputs=None, input_shape=None, tp: int = 1, repeat: bool = True) -> list[int]:
    """Bytes one rank holds of the activation each stage receives per microbatch (the output of the
    previous stage's last module in forward order: as one tensor rank holds it, sharded on the
    sequence under sequence parallelism, in the compute dtype), then of the model's output (the
    logits; a tensor rank's share of the vocabulary under loss parallelism). 0s without an input.
    `repeat`: runs of identical blocks profiled as four (`planc/estimate/repeat.py`, the same result)."""
    from planc.estimate.flops import step_profile, tensor_rank_profile

    whole = whole_program(job)
    profile = None
    if tp > 1 and whole.of_type(Parallelize):
        profile = tensor_rank_profile(graph, whole, inputs, input_shape=input_shape, tp=tp, repeat=repeat)
    if profile is None:
        profile = step_profile(graph, inputs, input_shape=input_shape, dtype=main_dtype(whole, graph), repeat=repeat)
    if profile is None:
        return [0] * (len(job.parts) + 1)
    order = {p: k for k, p in enumerate(profile.order)}
    out = [0]
    for part in job.parts[:-1]:
        tail = max((m for m in part.modules if m in order), key=order.get, default=None)
        act = profile.outputs.get(tail) if tail is not None else None
        out.append(act.numel * act.dtype.itemsize if act is not None else 0)
    act = profile.outputs.get("")
    return out + [act.numel * act.dtype.itemsize if act is not None else 0]


def estimate_pipeline_time(plan, *, world: int, hardware: "str | Hardware" = "h100", graph=None, profile=None,
                           input_shape: tuple[int, ...] | None = None, inputs=None, loss=None,
                           optimizer: str = "adamw", efficiency: float | None = None,
                           repeat: bool = True) -> PipelineTime:
    """The step of a pipeline job at `world` ranks. `plan` is a `CompiledPlan` or a `Job` (then
    `graph` is required); `profile` is one microbatch's `StepProfile`, else made from the step's
    `inputs`/`input_shape` cut into the schedule's microbatches (`repeat`: runs of identical blocks
    profiled as four and written out, `planc/estimate/repeat.py`; the same profile, False profiles in full)."""
    from planc.estimate.flops import step_profile
    from planc.estimate.time import _microbatch

    job: Job = READER.job(plan) if isinstance(plan, Job) else READER.compiled(plan)
    graph = graph or getattr(plan, "graph", None)
    if graph is None:
        raise ValueError("estimating a pipeline job needs its model graph")
    sched, pp = job.schedule, len(job.schedule.stages)
    m = sched.microbatches
    hw = hardware_of(hardware)
    eff = hw.efficiency if efficiency is None else float(efficiency)
    if profile is None and (inputs is not None or input_shape is not None):
        inputs, input_shape = _microbatch(inputs, input_shape, m)
        dtype = main_dtype(whole_program(job), graph)
        profile = step_profile(graph, inputs, input_shape=input_shape, loss=loss, dtype=dtype, repeat=repeat)
    last = len(job.parts) - 1
    stages = [_stage(part, graph, profile, world, pp, hw, eff, optimizer, part.stage == last) for part in job.parts]
    tp = (job.parts[0].program.mesh.sizes(stage_world(job.parts[0].program, world, pp)) or {}).get("tensor", 1)
    if inputs is not None or input_shape is not None:  # what one tensor rank sends (`boundaries`)
        for st, nbytes in zip(stages, boundaries(job, graph, inputs, input_shape, tp, repeat)[1:-1]):
            st.boundary_bytes = nbytes
    stride = world // pp
    link = hw.link(2 * stride)  # two adjacent pipeline ranks (the convention `collective_s` uses)
    p2p = {(s, s + 1): (link.alpha_s + stages[s].boundary_bytes / link.busbw) if stages[s].boundary_bytes else 0.0
           for s in range(last)}
    owner = {s: r for r, held in enumerate(sched.stages) for s in held}
    _split_shares(stages, job, graph, inputs, input_shape, loss)
    timeline = simulate(sched, _JobCosts(stages, p2p, owner))
    sizes = job.parts[0].program.mesh.sizes(stage_world(job.parts[0].program, world, pp)) or {}
    tp = sizes.get("tensor", 1)
    dp = world // (pp * tp)
    tokens = profile.tokens * m * dp if profile is not None and profile.tokens else None
    model_flops = profile.total * m * dp if profile is not None else 0
    notes = [
        f"pipeline: {pp} ranks, {sched.name}, {m} microbatches; each rank runs its actions in order, a stage's "
        "forward waits for the previous stage's, a backward for the next stage's",
        f"point-to-point: the boundary activation and its gradient, alpha + bytes / busbw on the "
        f"{'inter' if link is hw.inter else 'intra'}-node link (pipeline ranks {stride} apart)",
        "FSDP under a pipeline: gathered before a stage's first forward (every forward and backward when "
        "resharding after forward), reduced once after its last backward (torch's PipelineStage)",
        "a split backward: its input and weight halves by their FLOPs, counted on torch's stage_backward_input "
        "and stage_backward_weight (half each without an input)",
    ]
    if tp > 1:
        notes.append("FLOPs per tensor rank: the stage's FLOPs / tensor degree")
    return PipelineTime(world, pp, hw, stages, timeline, tokens, model_flops, notes)


def _split_shares(stages: list[StageTime], job: Job, graph, inputs, input_shape, loss) -> None:
    """Each stage's input-half share of a split backward, from `split_backward.split_costs` (one
    microbatch: `inputs`/`input_shape` are the microbatch's); kept at half without an input."""
    import types

    from planc.estimate.split_backward import has_split_backward, split_costs
    from planc.estimate.trace import Example, TraceError, default_input

    if not has_split_backward(job.schedule) or (inputs is None and (input_shape is None or graph.model is None)):
        return
    example = Example.of(inputs if inputs is not None else default_input(graph.model, input_shape))
    try:
        costs = split_costs(types.SimpleNamespace(graph=graph, program=whole_program(job)), job, example, loss)
    except TraceError:
        return  # the memory estimate reports it; the time keeps half and half
    for st, cost in zip(stages, costs):
        st.input_share = cost.input_share


def _stage(part, graph, profile, world: int, pp: int, hw: Hardware, eff: float, optimizer: str,
           last: bool) -> StageTime:
    """One stage's prices (see the module docstring)."""
    program = part.program
    st = StageTime(part.stage, part.modules)
    n = stage_world(program, world, pp)
    plain = estimate_step_time(program, world=n, hardware=hw, graph=graph, optimizer=optimizer, efficiency=eff)
    st.optimizer_s = plain.optimizer_s
    for u, t in zip(program.units, plain.per_unit):
        again = u.policy.reshard_after_forward is not False
        st.collectives += t.collectives
        for c in t.collectives:
            if c.kind == "all_gather":
                st.gathers.setdefault(c.phase, []).append((collective_s(c, hw), again))
            elif c.kind in ("reduce_scatter", "all_reduce"):
                st.reductions.append(collective_s(c, hw))
    if profile is None:
        return st
    tp = (program.mesh.sizes(n) or {}).get("tensor", 1)

    def mine(path: str) -> bool:
        return inside(path, part.modules) or (last and path == "")
    st.forward_flops = sum(v for p, v in profile.forward.items() if mine(p)) // tp
    recompute = 0
    for op in program.of_type(Checkpoint):
        table = profile.recompute_selective if op.mode == "selective" else profile.recompute_full
        recompute += table.get(op.module, 0)
    st.backward_flops = (sum(v for p, v in profile.backward.items() if mine(p)) + recompute) // tp
    dtype = main_dtype(program, graph, part.modules)
    rate = hw.flops(str(dtype).replace("torch.", "") if dtype is not None else "float32") * eff
    st.forward_s, st.backward_s = st.forward_flops / rate, st.backward_flops / rate
    return st


def step_time_of_pipeline(compiled, *, world: int, hardware="h100", **kwargs):
    """A pipeline job's step as a `time.StepTime` (what explain, suggest and the checks read): the
    binding rank's stages as its rows, the step time the slowest rank's, the `PipelineTime` in
    `pipeline`. FLOPs per rank: the world's model FLOPs / world."""
    from planc.estimate.time import StepTime, UnitTime, _assumptions

    pt = estimate_pipeline_time(compiled, world=world, hardware=hardware, **kwargs)
    binding = pt.timeline.ranks[pt.timeline.binding_rank]
    m = pt.timeline.microbatches
    rows = []
    for i, s in enumerate(binding.stages):
        st = pt.stages[s]
        rows.append(UnitTime(f"stage {s}", i, list(st.collectives), m * st.forward_flops, m * st.backward_flops, 0,
                             forward_s=m * st.forward_s, backward_s=m * st.backward_s, comm_s=0.0))
    eff = kwargs.get("efficiency") or pt.hardware.efficiency
    exposed = max(0.0, pt.step_s - binding.busy_s - binding.optimizer_s)
    tp = (compiled.job.parts[0].program.mesh.sizes(stage_world(compiled.job.parts[0].program, world, pt.pp))
          or {}).get("tensor", 1)
    return StepTime(world, pt.hardware, rows, binding.busy_s, binding.comm_s, exposed, binding.optimizer_s,
                    pt.step_s, pt.tokens, pt.model_flops // world, _assumptions(pt.hardware, eff, tp) + pt.assumptions,
                    efficiency=eff, tp=tp, pipeline=pt)
