"""The job: one optimizer step of the whole world, as data, the one contract with every backend.

A plan lowers to a `Job` (`planc/lower/lowering.py::lower_job`); `CompiledPlan.job` holds it.
Every interpreter reads the job: the runtime (`planc.apply`) and emit make it real or print
it, and the estimators (trace, memory, time, the shape check) replay it per *role*, a class of
ranks that do the same thing. Each interpreter refuses a part, action or step-op kind it does
not know rather than skipping it.

    views      the device meshes of one world, each a tuple of named axes (`View`): the dense
               view (pipeline, replicate, shard, context, tensor) and, with expert
               parallelism, the expert view, as torchtitan's `build_mesh` and Megatron's
               process-group views make several meshes of one world.
    parts      the model cut into pipeline stages (`Part`), each with the `Program` that says
               what is done to its modules (`planc/lower/program.py`). Without pipeline
               parallelism there is one part, the whole model, whose program is the plan's.
    schedule   per pipeline rank, the ordered actions of one optimizer step (`Schedule`),
               in torch's `_Action` vocabulary: forward and backward of a stage for a
               microbatch, split backward (input, weight), unshard, reshard, reduce-grad,
               send, receive. The degenerate schedule (one stage, one microbatch) is
               forward then backward: the step every plan ran before pipelines.
    step ops   what happens to each batch outside the parts' programs (`StepOp`): the loss
               and its backward inside `loss_parallel()`, the batch sharded along the
               sequence for context parallelism.

A role is a pipeline rank's place in the schedule: its stages and its actions (`Role`).
Without pipeline parallelism every rank plays the one role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from planc.lower.program import Program
from planc.resolve.ir import Setting
from planc.resolve.mesh import Axis, Mesh
from planc.resolve.step import GRADIENT_SYNC

# torch.distributed.pipelining's `_ComputationType` values (torch 2.13), the words of an action.
FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"
UNSHARD, RESHARD, REDUCE_GRAD = "UNSHARD", "RESHARD", "REDUCE_GRAD"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
OVERLAP_F_B = "OVERLAP_F_B"
ACTION_KINDS = (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, UNSHARD, RESHARD, REDUCE_GRAD,
                SEND_F, RECV_F, SEND_B, RECV_B, OVERLAP_F_B)
COMPUTE_KINDS = (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, OVERLAP_F_B)

# When a stage's backward reduces its gradients over the data-parallel axes (`GRADIENT_SYNC`,
# from the plan's `step` line): after every microbatch's backward, or only after the last
# microbatch's (FSDP2's `set_requires_gradient_sync(False)` before the others).

DENSE = "dense"    # the view every module that is not an expert lives on
EXPERT = "expert"  # the view expert-parallel experts live on


class UnknownKind(ValueError):
    """An interpreter met a part, action or step op it does not know (it never skips one)."""

    def __init__(self, interpreter: str, what: object):
        shown = f"the action {what}" if isinstance(what, Action) else f"a `{type(what).__name__}` ({what!r})"
        super().__init__(f"{interpreter} has no rule for {shown}: refusing it rather than skipping it")
        self.interpreter, self.what = interpreter, what


@dataclass(frozen=True)
class View:
    """One device mesh of the world: named axes, outermost first (`Axis.name` is the `DeviceMesh` axis name)."""

    name: str
    axes: tuple[Axis, ...]

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)


@dataclass(frozen=True)
class Part:
    """One pipeline stage of the model: the module paths it keeps and its program.

    `modules` are the paths the stage keeps of the model (`("",)`: the whole model); the
    program's ops name modules by their paths in the whole model, so paths do not change when
    the model is split.
    """

    stage: int
    modules: tuple[str, ...]
    program: Program


@dataclass(frozen=True, slots=True)
class Action:
    """One action of one pipeline rank: torch's `_Action(stage, computation type, microbatch)`.

    `sub` holds the actions an `OVERLAP_F_B` runs together (DualPipeV). Written as torch writes
    it: `0F1` (stage 0, forward, microbatch 1), `1UNSHARD`, `(0F3;3B1)OVERLAP_F_B`.
    """

    stage: int
    kind: str
    microbatch: int | None = None
    sub: tuple["Action", ...] = ()

    def __str__(self) -> str:
        if self.sub:
            return "(" + ";".join(map(str, self.sub)) + ")" + self.kind
        return f"{self.stage}{self.kind}{'' if self.microbatch is None else self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS


@dataclass(frozen=True)
class Schedule:
    """The actions of one optimizer step, per pipeline rank.

    Attributes:
        name: torch's schedule class name without `Schedule` (`1F1B`, `Interleaved1F1B`, ...),
            or `step` when there is no pipeline (forward and backward of the whole model per
            microbatch).
        microbatches: microbatches per optimizer step (gradient accumulation without a
            pipeline; the pipeline's microbatches with one).
        stages: pipeline rank -> the stages it holds (the placement: loop or V).
        actions: pipeline rank -> its actions, in the order it runs them.
        gradient_sync: `every` or `last` (`GRADIENT_SYNC`).
        origin: the plan setting that chose the schedule, if any.
    """

    name: str
    microbatches: int
    stages: tuple[tuple[int, ...], ...]
    actions: tuple[tuple[Action, ...], ...]
    gradient_sync: str = "every"
    origin: Setting | None = None

    def reduces(self, action: Action) -> bool:
        """Whether `action` reduces its stage's gradients over the data-parallel axes.

        Without a pipeline, a backward does: every microbatch's (`every`) or the last one's
        (`last`). Under a pipeline torch's stage runs every microbatch's backward without
        gradient sync and reduces in the stage's `REDUCE_GRAD` action, after its last backward
        (`PipelineStage.perform_reduce_grad`, torch 2.13): the schedule's sync is `last` and
        only `REDUCE_GRAD` reduces.
        """
        if action.kind == REDUCE_GRAD:
            return True
        if action.kind not in (FULL_BACKWARD, BACKWARD_WEIGHT) or self.pipelined:
            return False
        return self.gradient_sync == "every" or action.microbatch == self.microbatches - 1

    @property
    def pipelined(self) -> bool:
        """A pipeline schedule (torch's), not the `step` of one stage."""
        return self.name != "step"


def step_schedule(microbatches: int = 1, gradient_sync: str = "every", origin: Setting | None = None) -> Schedule:
    """The schedule without a pipeline: forward then backward of the one stage, per microbatch."""
    if microbatches < 1 or gradient_sync not in GRADIENT_SYNC:
        raise ValueError(f"a step needs >= 1 microbatch and a sync in {GRADIENT_SYNC}")
    actions = tuple(a for mb in range(microbatches) for a in (Action(0, FORWARD, mb), Action(0, FULL_BACKWARD, mb)))
    return Schedule("step", microbatches, ((0,),), (actions,), gradient_sync, origin)


@dataclass(frozen=True, slots=True)
class LossParallel:
    """The loss and its backward run inside torch's `loss_parallel()`: the logits of `module`
    stay sharded on the vocabulary over the tensor axis."""

    module: str
    origin: Setting


@dataclass(frozen=True, slots=True)
class ShardBatch:
    """Each batch is cut along the sequence over the context axis before the forward.

    Every rank of the context axis keeps `balance` chunks of each tensor in `tensors`
    (name, dim): head-tail, chunks `r` and `2 x context - 1 - r` of `2 x context`; the
    positions are the global positions of those chunks, passed to the model as `positions=`.
    The loss of a rank is its tokens' share: summed over its tokens and divided by the
    global token count, the ranks' losses (and gradients) add up to the unsharded mean.
    """

    axis: str
    tensors: tuple[tuple[str, int], ...]
    balance: str
    origin: Setting


StepOp = Union[LossParallel, ShardBatch]
STEP_OPS = (LossParallel, ShardBatch)


@dataclass(frozen=True)
class Role:
    """A class of identical ranks: one pipeline rank's stages and actions (all ranks without a pipeline)."""

    pipeline_rank: int
    stages: tuple[int, ...]
    actions: tuple[Action, ...]

    @property
    def name(self) -> str:
        return f"pipeline rank {self.pipeline_rank}"


@dataclass(frozen=True)
class Reader:
    """What one interpreter knows of a job: the op, action and step-op kinds it has a rule for.

    Every interpreter (runtime, emit, trace, memory, time, tensor_local, repeat, comms,
    explain, the shape check) reads the job or program through its reader before it walks
    it, so a kind added to the lowering that an interpreter has no rule for is refused with
    `UnknownKind` rather than left out of what it runs, prints or estimates. A kind an
    interpreter deliberately has nothing to do for (the trace and `UnitMethod`) is listed as
    known: the choice is written down, once, next to the interpreter.
    """

    interpreter: str
    ops: tuple[type, ...]
    actions: tuple[str, ...] = (FORWARD, FULL_BACKWARD)
    step_ops: tuple[type, ...] = ()

    def program(self, program: Program) -> Program:
        """`program`, after checking that every op is of a kind this interpreter knows."""
        for op in program.ops:
            if not isinstance(op, self.ops):
                raise UnknownKind(self.interpreter, op)
        return program

    def action(self, action: Action) -> Action:
        """`action`, after checking its kind (and those of the actions it runs together)."""
        if action.kind not in self.actions:
            raise UnknownKind(self.interpreter, action)
        for sub in action.sub:
            self.action(sub)
        return action

    def job(self, job: "Job") -> "Job":
        """`job`, after checking every part's program, every role's actions and every step op."""
        for part in job.parts:
            self.program(part.program)
        for actions in job.schedule.actions:
            for action in actions:
                self.action(action)
        for op in job.step_ops:
            if not isinstance(op, self.step_ops):
                raise UnknownKind(self.interpreter, op)
        return job

    def compiled(self, compiled) -> "Job":
        """The job of a `CompiledPlan`, checked (`job`)."""
        return self.job(compiled.job)


@dataclass(frozen=True)
class Job:
    """A lowered plan: the views, the parts, the schedule and the step ops (see the module docstring)."""

    mesh: Mesh
    views: tuple[View, ...]
    parts: tuple[Part, ...]
    schedule: Schedule
    step_ops: tuple[StepOp, ...] = ()

    def view(self, name: str = DENSE) -> View:
        for v in self.views:
            if v.name == name:
                return v
        raise KeyError(name)

    @property
    def program(self) -> Program:
        """The one part's program: a job without a pipeline is one program over the whole model.

        Raises:
            ValueError: the job has several parts (pipeline stages): interpret each part's.
        """
        if len(self.parts) != 1:
            raise ValueError(f"a pipeline job has {len(self.parts)} parts: interpret each part's program")
        return self.parts[0].program

    @property
    def roles(self) -> tuple[Role, ...]:
        """One role per pipeline rank (one role without a pipeline)."""
        return tuple(Role(r, stages, actions)
                     for r, (stages, actions) in enumerate(zip(self.schedule.stages, self.schedule.actions)))

    def step_op(self, kind: type) -> tuple:
        return tuple(op for op in self.step_ops if isinstance(op, kind))
