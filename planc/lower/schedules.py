"""A pipeline schedule's actions per rank, taken from torch's own schedule classes.

torch.distributed.pipelining computes each schedule's `pipeline_order` (pipeline rank -> its
`_Action`s, `None` for an idle slot) when the schedule is built from its rank's stages. Only the
stages' index, count and group are read there, so `schedule` builds it from placeholder stages
(no process group, no module) once per pipeline rank and keeps that rank's own row. The
single-stage schedules (GPipe, 1F1B) do not run their `pipeline_order` (their
`_step_microbatches` is a hand-written loop) and torch 2.13's 1F1B order is wrong past rank 0
(rank 1 of 2, 4 microbatches: `1F1 1B0 ... 1F4`): their actions follow the loop instead. The
placement (which stages a rank holds) follows torchtitan's `pipeline_parallel.py`: loop
(`rank + k * pp`) for the looped schedules, V (`rank`, `2 * pp - 1 - rank`) for the V ones.
Every row ends each stage's backwards with its `REDUCE_GRAD` (torch's runtime inserts it with
`_add_reduce_grad`; GPipe's and 1F1B's loops call it last): the gradient sync is `last`.
"""

from __future__ import annotations

from torch.distributed.pipelining import schedules as _torch_schedules
from torch.distributed.pipelining.stage import _PipelineStageBase

from planc.lower.job import Action, Schedule
from planc.resolve.pipeline import SCHEDULES, SINGLE_STAGE, V_SCHEDULES

__all__ = ["SCHEDULES", "SINGLE_STAGE", "V_SCHEDULES", "placement", "schedule"]


class _PlaceholderStage(_PipelineStageBase):
    """A stage with only the numbers a schedule reads while it computes its order."""

    def __init__(self, stage_index: int, num_stages: int, group_rank: int, group_size: int):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_rank, self.group_size = group_rank, group_size
        self.submod, self.has_backward, self.dw_builder = None, True, None

    def _prepare_forward_infra(self, *args, **kwargs):  # pragma: no cover - never run
        raise NotImplementedError

    def _prepare_backward_infra(self, *args, **kwargs):  # pragma: no cover - never run
        raise NotImplementedError

    def _create_grad_recv_info(self, *args, **kwargs):  # pragma: no cover - never run
        raise NotImplementedError


def placement(name: str, pp: int, stages_per_rank: int) -> tuple[tuple[int, ...], ...]:
    """Pipeline rank -> the stages it holds: V for the V schedules, loop otherwise (torchtitan)."""
    if name in V_SCHEDULES:
        if stages_per_rank != 2:
            raise ValueError(f"{name} holds exactly 2 stages per rank (V), not {stages_per_rank}")
        return tuple((r, 2 * pp - 1 - r) for r in range(pp))
    return tuple(tuple(r + k * pp for k in range(stages_per_rank)) for r in range(pp))


def _action(torch_action) -> Action:
    kind = torch_action.computation_type.name if hasattr(torch_action.computation_type, "name") \
        else str(torch_action.computation_type)
    kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}.get(kind, kind)
    sub = tuple(_action(a) for a in (torch_action.sub_actions or ()))
    return Action(torch_action.stage_index, kind, torch_action.microbatch_index, sub)


def schedule(name: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """The schedule `name` on `pp` pipeline ranks: torch's `pipeline_order`, row by row."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; torch's are {', '.join(SCHEDULES)}")
    single = name in SINGLE_STAGE
    if single and stages_per_rank != 1:
        raise ValueError(f"{name} holds one stage per rank, not {stages_per_rank}")
    stages = placement(name, pp, stages_per_rank)
    if single:
        rows = tuple(_single_stage_actions(name, rank, pp, microbatches) for rank in range(pp))
        return Schedule(name, microbatches, stages, rows, "last")
    cls = _torch_schedules.get_schedule_class(name)
    total = pp * stages_per_rank
    rows = []
    # the schedule computes every rank's `pipeline_order` as it is built: built once, on rank 0's stages
    built = cls([_PlaceholderStage(s, total, 0, pp) for s in stages[0]], microbatches)
    for rank in range(pp):
        # the runtime adds each stage's REDUCE_GRAD after its last backward (`_add_reduce_grad`)
        order = _torch_schedules._add_reduce_grad(list(built.pipeline_order[rank]), microbatches)
        rows.append(tuple(_action(a) for a in order if a is not None))
    return Schedule(name, microbatches, stages, tuple(rows), "last")


def _single_stage_actions(name: str, rank: int, pp: int, microbatches: int) -> tuple[Action, ...]:
    """GPipe's and 1F1B's `_step_microbatches` loops on stage `rank`, as actions."""
    forwards = [Action(rank, "F", mb) for mb in range(microbatches)]
    backwards = [Action(rank, "B", mb) for mb in range(microbatches)]
    if name == "GPipe":
        order = forwards + backwards
    else:  # 1F1B: pp - rank forwards of warm-up, then backward/forward pairs, then the backwards left
        warmup = min(microbatches, pp - rank)
        order = forwards[:warmup]
        for mb in range(microbatches - warmup):
            order += [backwards[mb], forwards[warmup + mb]]
        order += backwards[microbatches - warmup:]
    return tuple(order) + (Action(rank, "REDUCE_GRAD"),)
