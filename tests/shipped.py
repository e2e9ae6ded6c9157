"""Which shipped plans the estimators model: the memory and step-time tests skip the others, visibly."""

from __future__ import annotations

import pathlib

import pytest

import planc
from planc.resolve.mesh import Role


def not_estimated(path: pathlib.Path, world: int | None = None) -> str | None:
    """Why the estimators refuse the plan at `path` (their readers refuse its job's kinds) or cannot
    place it at `world` ranks, or None. Context parallelism is estimated; a mesh that cannot fill
    the test's world (`plans/llama3-8b-long-context.plan` needs 64 ranks) is left to its own tests."""
    mesh = planc.compile(planc.load(path), None, strict=False).mesh
    if mesh.axis(Role.PIPELINE) is not None:
        return ("a pipeline plan: the one-part estimators and the fake-process-group step these tests compare with "
                "do not run a schedule; its memory per pipeline rank is held against FSDPMemTracker on each rank "
                "in tests/test_roles_memory_dist.py, its time in tests/test_roles_time.py")
    if mesh.axis(Role.EXPERT) is not None:
        # estimated with balanced routing (tests/test_expert_memory_dist.py, test_expert_collectives_dist.py); the
        # shipped-plan comparisons run the router as trained, whose uneven splits the estimate does not model
        return "expert parallelism is estimated under balanced routing only (tests/test_expert_*_dist.py)"
    if world is not None and mesh.sizes(world) is None:
        return f"the mesh {mesh} does not fill {world} ranks"
    return None


def not_run(path: pathlib.Path) -> str | None:
    """Why the runtime and emit do not run the plan at `path`, or None (they run every shipped plan:
    pipeline plans through planc/backends/pipelining.py and emit_pipeline.py)."""
    return None


def is_pipeline(path: pathlib.Path) -> bool:
    """Whether the plan at `path` has a pipeline axis."""
    return planc.compile(planc.load(path), None, strict=False).mesh.axis(Role.PIPELINE) is not None


def not_verified(path: pathlib.Path) -> str | None:
    """Why `check --verify` does not run the plan at `path` (P426), or None: a plan whose fixed axes
    need more processes than verify runs (the 405B plan: pipeline 8 x tensor 8; the 8B long-context
    plan: context 8 x tensor 8; the Qwen3-MoE plan: expert 8 borrows from shard x tensor)."""
    from planc.analysis.verify import MAX_PROCESSES, verify_world
    from planc.analysis.verify_pipeline import pipeline_world

    mesh = planc.compile(planc.load(path), None, strict=False).mesh
    # a pipeline's world is the fixed axes' (verify_pipeline); the others' `verify_world`
    world = pipeline_world(mesh, MAX_PROCESSES) if mesh.axis(Role.PIPELINE) is not None else verify_world(mesh)
    if world > MAX_PROCESSES:
        return f"its fixed axes need {world} processes, more than `check --verify` runs ({MAX_PROCESSES}): P426"
    return None


def params(cases, path_of=lambda case: case, ids=None, world: int | None = None):
    """`cases` as pytest params, those whose plan is not estimated (at `world`) marked skip with the reason."""
    out = []
    for i, case in enumerate(cases):
        reason = not_estimated(path_of(case), world)
        marks = (pytest.mark.skip(reason=reason),) if reason else ()
        out.append(pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=marks,
                                id=None if ids is None else ids[i]))
    return out
