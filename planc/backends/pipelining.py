"""Apply a pipeline job: this rank's stages split from the model, each stage's program, torch's schedule.

`planc.apply` hands a job with several parts here (`apply`). On each rank, in torchtitan's
order (`pipeline_llm`: split, then the same parallelize function per stage, then the schedule):

    the one root device mesh (pipeline axis outermost, `Job.mesh`)
    -> per stage this pipeline rank holds (`Schedule.stages`, loop or V placement):
       the stage module (`planc.model.split.split`: the model, modules outside the stage
       passed through, paths kept), its program run on it (`runtime.run`: tensor
       parallelism, checkpointing, compile, `fully_shard` on the data-parallel submesh)
       and torch's `PipelineStage` on the pipeline axis's process group
    -> torch's schedule class of the job's name, built on the first `step` (it needs the loss
       function), its action list checked against the job's for this rank.

FSDP under a pipeline: the lowering leaves units unsharded from forward to backward unless the
plan says otherwise (torchtitan's `reshard_after_forward = not pp_enabled`); a stage turns off
gradient sync itself for all but the last microbatch and reduces once (`pipelining/stage.py`).

Gradient scaling, stated: the schedule is built with `scale_grads=True`, so the gradients are
those of the mean over the step's microbatches of `loss_fn(output, target)` per microbatch,
averaged by FSDP over the data-parallel ranks: for a mean-reduced loss over equal microbatches,
the gradients of one unsharded process over the whole global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from planc.backends import experts, runtime
from planc.compiler import CompiledPlan
from planc.diagnostics import Diagnostic, PlanError, sort_diagnostics
from planc.lower.job import ACTION_KINDS, EXPERT, Job, LossParallel, Reader
from planc.lower.program import DispatchExperts
from planc.lower.schedules import SINGLE_STAGE
from planc.model import split as stages
from planc.resolve.mesh import Role
from planc.resolve.step import check_splits

# What the pipeline runtime runs: every op the one-part runtime runs, on each stage; every
# action kind, because torch's schedule class of the job's name runs them (the job's actions
# are that class's `pipeline_order`, checked against it when the schedule is built); the loss
# on vocabulary-sharded logits (`LossParallel`: `step` runs the schedule inside
# `loss_parallel()`, as torchtitan's train context does); context parallelism is refused.
READER = Reader("the pipeline runtime (planc.apply)", runtime.READER.ops, ACTION_KINDS, (LossParallel,))

SCALE_GRADS = True  # the schedule divides each microbatch's gradients by their count (see the docstring)


@dataclass
class PipelinedPlan(runtime.AppliedPlan):
    """What `apply` did with a pipeline job on this rank: its stages and the schedule.

    `model` is the model passed in: the modules of this rank's stages are sharded in place
    and shared with `stages`, the rest is left as it was (on meta, if built there): do not
    call it (built on meta, `planc.materialize(applied, device)` allocates this rank's stages).
    Train `parameters()` (this rank's stages' parameters), with `step` per batch::

        optimizer = torch.optim.AdamW(applied.parameters())
        loss = applied.step(tokens, labels, loss_fn)   # None unless applied.holds_loss
        optimizer.step(); optimizer.zero_grad()

    Attributes:
        stages: this rank's stage modules, in the order it holds them (`stage_ids`).
        stage_ids: the stage indices this pipeline rank holds.
        pipeline_stages: torch's `PipelineStage` of each.
        pipeline_rank: this rank's index on the pipeline axis.
    """

    stages: list[nn.Module] = field(default_factory=list)
    stage_ids: tuple[int, ...] = ()
    pipeline_stages: list = field(default_factory=list)
    pipeline_rank: int = 0
    _schedule: Any = None
    _loss_fn: Callable | None = None

    @property
    def job(self) -> Job:
        return self.compiled.job

    @property
    def loss_pipeline_rank(self) -> int:
        """The pipeline rank that holds the last stage, where the loss is computed (the last
        rank with loop placement, rank 0 with V placement)."""
        last = len(self.job.parts) - 1
        return next(r for r, held in enumerate(self.job.schedule.stages) if last in held)

    @property
    def holds_loss(self) -> bool:
        """Whether `step` returns the loss on this rank (it holds the last stage)."""
        return self.pipeline_rank == self.loss_pipeline_rank

    @property
    def holds_inputs(self) -> bool:
        """Whether this rank holds the first stage (the one `step` feeds the inputs to)."""
        return 0 in self.stage_ids

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's stages' parameters, each once: what its optimizer steps."""
        seen: set[int] = set()
        for module in self.stages:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's stages' parameters under their paths in the whole model."""
        for module in self.stages:
            yield from module.named_parameters()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable) -> torch.Tensor | None:
        """Forward and backward of one optimizer step's batch through the pipeline.

        Every rank of the pipeline passes its data-parallel batch (`inputs` are read on the rank
        holding the first stage, `targets` on the rank holding the last); it is cut into the
        job's microbatches on the first dimension. Returns the mean of the microbatches'
        `loss_fn(output, target)` (detached) on the rank that `holds_loss`, else None.

        Raises:
            MicrobatchError: the batch does not divide into the microbatches.
        """
        for t in (inputs, targets):
            check_splits(tuple(t.shape), self.job.schedule.microbatches)
        schedule = self._schedule_for(loss_fn)
        losses: list[torch.Tensor] = []
        last = len(self.job.parts) - 1 in self.stage_ids
        args = (inputs,) if self.holds_inputs else ()
        kwargs = {"target": targets, "losses": losses} if last else {}
        with self.loss_parallel():  # the plan's `loss_parallel`: the last stage's logits stay sharded
            schedule.step(*args, **kwargs)
        return torch.stack([v.detach() for v in losses]).mean() if last else None

    def accumulate(self, *batch: torch.Tensor):
        """Not under a pipeline: the schedule runs the microbatches (`step`)."""
        raise TypeError("a pipeline plan runs its microbatches in `applied.step(inputs, targets, loss_fn)`")

    def state_dict(self) -> dict[str, Any]:
        """This rank's stages' state, under the paths of the whole model (DTensors where sharded):
        save it with `torch.distributed.checkpoint.save`; every rank adds its stages' keys."""
        out: dict[str, Any] = {}
        for module in self.stages:
            out.update(module.state_dict())
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load each stage's entries of `state` (e.g. filled in place by
        `torch.distributed.checkpoint.load(applied.state_dict(), ...)`)."""
        for module in self.stages:
            mine = module.state_dict()
            module.load_state_dict({k: state[k] for k in mine})

    def _schedule_for(self, loss_fn: Callable):
        """The schedule, built once; it calls the loss function of the current `step` (so a new
        function object per step, e.g. a lambda, does not rebuild it)."""
        self._loss_fn = loss_fn
        if self._schedule is None:
            self._schedule = build_schedule(self.job, self.pipeline_stages, self.pipeline_rank,
                                            lambda output, target: self._loss_fn(output, target))
        return self._schedule

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients of this rank's stages by the total norm over the whole model, and
        return that norm (on every rank): each rank's squared norm of its stages' gradients
        (full tensors, so over the data-parallel and tensor axes too; of expert-parallel experts,
        summed over the stage's expert axis: each expert rank holds other experts), summed over
        the pipeline axis (torchtitan's `clip_grad_norm_` with a pipeline), then every gradient
        scaled by `max_norm / (norm + 1e-6)` clamped to 1 (torch's arithmetic; in place on the local
        shards, as gradients on two meshes, dense and expert, cannot be scaled by one foreach call).
        Each gradient is gathered whole in turn (simple, one full gradient in memory at a time;
        torchtitan reduces DTensor norms instead)."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        params = [p for p in self.parameters() if p.grad is not None]
        spread = {id(p) for m in self.stages for sub in m.modules() if hasattr(sub, experts.EXPERT_SLICE)
                  for p in sub.parameters()}
        squares = {on: torch.zeros((), dtype=torch.float32, device=_device(self.mesh)) for on in (False, True)}
        for p in params:
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            squares[id(p) in spread] += grad.detach().float().pow(2).sum()
        if self.expert_mesh is not None:
            axis = self.expert_mesh[self.job.view(EXPERT).axes[-1].name]
            dist.all_reduce(squares[True], group=axis.get_group())
        total = squares[False] + squares[True]
        dist.all_reduce(total, group=self.mesh[self.job.mesh.axis_name(Role.PIPELINE)].get_group())
        total = total.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for p in params:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(coef)
        return total

    def summary(self) -> str:
        """The pipeline (this rank's stages, the schedule, where the loss is), then the units."""
        sched = self.job.schedule
        head = (f"planc: pipeline rank {self.pipeline_rank} of {len(sched.stages)} holds stage"
                f"{'s' if len(self.stage_ids) > 1 else ''} {', '.join(map(str, self.stage_ids))} of "
                f"{len(self.job.parts)} ({sched.name}, {sched.microbatches} microbatches, scale_grads="
                f"{SCALE_GRADS}); the loss is on pipeline rank {self.loss_pipeline_rank}")
        return head + "\n" + super().summary()

    def local_param_bytes(self) -> int:
        """Bytes of parameter data this rank holds: its stages' local shards."""
        return sum(runtime._local_bytes(p) for p in self.parameters())


def build_schedule(job: Job, pipeline_stages: list, pipeline_rank: int, loss_fn: Callable):
    """torch's schedule class of the job's name over this rank's stages, with `scale_grads`
    stated; its compute actions for this rank must be the job's (multi-stage schedules)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    name = job.schedule.name
    cls = get_schedule_class(name)
    held = pipeline_stages[0] if name in SINGLE_STAGE else pipeline_stages
    schedule = cls(held, n_microbatches=job.schedule.microbatches, loss_fn=loss_fn, scale_grads=SCALE_GRADS)
    order = getattr(schedule, "pipeline_order", None)
    if name not in SINGLE_STAGE and order is not None:
        # the compute actions (torch's runtime adds the REDUCE_GRADs the job lists, `_add_reduce_grad`)
        runs = [str(a) for a in order[pipeline_rank] if a is not None]
        planned = [str(a) for a in job.schedule.actions[pipeline_rank] if a.is_compute]
        if runs != planned:
            raise RuntimeError(f"torch's {name} runs {runs[:6]}... on pipeline rank {pipeline_rank}, the job "
                               f"planned {planned[:6]}...: the lowering and torch disagree")
    return schedule


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def apply(model: nn.Module, compiled: CompiledPlan, extra: list[Diagnostic],
          mesh: DeviceMesh | None = None) -> PipelinedPlan:
    """Split `model` into this rank's stages of `compiled.job`, apply each stage's program and
    build its `PipelineStage` (see the module docstring). Called by `planc.apply`.

    Raises:
        PlanError: the plan has errors.
        SplitError: a stage cannot be cut from the model (the pipeline checks refuse such a plan
            before it runs: `stages.check_chain`).
        UnknownKind: the job holds a step op the pipeline runtime has no rule for.
    """
    from torch.distributed.pipelining import PipelineStage

    job = READER.job(compiled.job)
    diagnostics = sort_diagnostics(list(compiled.diagnostics) + extra)
    if any(d.is_error for d in diagnostics):
        raise PlanError(diagnostics, compiled.sources)
    axis = job.mesh.axis_name(Role.PIPELINE)
    if axis is None:
        raise ValueError("a job with several parts needs a pipeline axis on its mesh (`Job.mesh`)")
    if mesh is None:
        mesh = runtime.build_mesh(job.mesh)
    pp_mesh = mesh[axis]
    rank = pp_mesh.get_local_rank()
    held = job.schedule.stages[rank]
    # every stage split before anything is sharded: a stage that cannot be cut leaves the model as it was
    modules = [stages.split(model, job.parts[s].modules) for s in held]
    # the expert view on every rank (its groups are created by all ranks), each stage's submesh of it
    expert_mesh = (experts.build_expert_mesh(job.view(EXPERT), mesh.device_type)
                   if any(p.program.of_type(DispatchExperts) for p in job.parts) else None)
    applied = PipelinedPlan(compiled=compiled, mesh=mesh, model=model, stage_ids=tuple(held), pipeline_rank=rank)
    for s, module in zip(held, modules):
        one = runtime.run(job.parts[s].program, module, mesh, compiled, expert_mesh)
        if one.expert_mesh is not None:  # this stage dispatches experts
            applied.expert_mesh = one.expert_mesh
        applied.units += one.units
        applied.unit_of_module.update(one.unit_of_module)
        applied.stages.append(module)
        applied.pipeline_stages.append(PipelineStage(module, s, len(job.parts), _device(mesh),
                                                     group=pp_mesh.get_group()))
    return applied
