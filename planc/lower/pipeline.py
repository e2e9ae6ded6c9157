"""Cut a lowered program into pipeline stages: each stage's `Part` keeps the ops on its modules.

A pipeline stage holds a list of module subtrees of the model (`Part.modules`, paths in the
whole model, e.g. `("tok_embeddings", "layers.0", "layers.1")`). The runtime builds each stage
as the whole model with every module outside the stage removed (torchtitan's
`pipeline_module_split`), so the stage's root is the model's root: paths do not change.

What a stage's program keeps (`stage_program`):
* every op on a module inside the stage (tensor styles, checkpointing, compile, attention over
  the context axis);
* every `fully_shard` unit whose modules all lie inside the stage; the root unit becomes the
  stage's own root unit, managing only the root's parameters that lie inside the stage
  (torchtitan applies `fully_shard` to each model part's root);
* explicit prefetch lists restricted to the stage's units (a unit does not prefetch across
  stages: the next stage runs on another rank), unit methods of the stage's units.
A unit that spans two stages cannot be kept by either: `StageError` (the checks report it
located before lowering, so a plan that lowers has none).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from planc.lower.job import Job, Part, Schedule
from planc.lower.program import FullyShard, Program, SetPrefetch, UnitMethod


class StageError(ValueError):
    """A unit or module cannot be placed in exactly one stage."""


def inside(path: str, modules: Iterable[str]) -> bool:
    """Whether module `path` lies in one of the subtrees `modules` (`""` is the whole model)."""
    return any(m == "" or path == m or path.startswith(m + ".") for m in modules)


def stage_program(program: Program, modules: Sequence[str], stage: int) -> Program:
    """The ops of `program` that act on the stage holding `modules` (see the module docstring)."""
    ops = []
    kept_units: set[str] = set()
    for op in program.ops:
        if isinstance(op, FullyShard):
            kept = _stage_unit(op, modules, stage)
            if kept is not None:
                ops.append(kept)
                kept_units.add(kept.name)
        elif isinstance(op, SetPrefetch):
            targets = tuple(t for t in op.targets if t in kept_units)
            if op.unit in kept_units and targets:
                ops.append(dataclasses.replace(op, targets=targets))
        elif isinstance(op, UnitMethod):
            if op.unit in kept_units:
                ops.append(op)
        elif inside(op.module, modules):
            ops.append(op)
    return Program(program.mesh, tuple(ops))


def _stage_unit(op: FullyShard, modules: Sequence[str], stage: int) -> FullyShard | None:
    if op.is_root:
        params = tuple(p for p in op.params if inside(p.rpartition(".")[0], modules))
        return dataclasses.replace(op, params=params)
    placed = [inside(m, modules) for m in op.modules]
    if all(placed):
        return op
    if any(placed):
        raise StageError(f"unit {op.name} spans stage {stage} and another stage")
    return None


def pipeline_job(job: Job, stages: Sequence[Sequence[str]], schedule: Schedule) -> Job:
    """`job` (one part, the whole model) cut into `stages` (stage index -> its module subtrees),
    run by `schedule` (`planc.lower.schedules.schedule`)."""
    program = job.program
    parts = tuple(Part(i, tuple(mods), stage_program(program, mods, i)) for i, mods in enumerate(stages))
    held = sorted(s for row in schedule.stages for s in row)
    if held != list(range(len(parts))):
        raise StageError(f"the schedule places stages {held}, the plan has {len(parts)}")
    return dataclasses.replace(job, parts=parts, schedule=schedule)
