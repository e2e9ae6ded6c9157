"""The job (planc/lower/job.py): the lowered contract every backend interprets.

Checked here: the degenerate job of every plan (one part whose program is the plan's, the
dense view, the one-stage schedule), step ops, and that planc's action vocabulary is torch's
(`torch.distributed.pipelining.schedules._ComputationType`, `_Action`'s notation).
"""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

import planc
from planc.lower.job import (
    ACTION_KINDS,
    DENSE,
    FORWARD,
    FULL_BACKWARD,
    Action,
    LossParallel,
    step_schedule,
)
from planc.zoo import llama_tiny, seed_transformer_tiny


def test_action_vocabulary_is_torchs():
    assert set(ACTION_KINDS) == {t.value for t in torch_schedules._ComputationType}
    for text in ("0F1", "3B0", "2I0", "1W3", "1UNSHARD", "0RESHARD", "2REDUCE_GRAD", "0SEND_F2", "1RECV_B0"):
        theirs = torch_schedules._Action.from_str(text)
        ours = Action(theirs.stage_index, theirs.computation_type.value, theirs.microbatch_index)
        assert str(ours) == str(theirs) == text
    overlap = Action(0, "OVERLAP_F_B", None, (Action(0, FORWARD, 3), Action(3, FULL_BACKWARD, 1)))
    assert str(overlap) == "(0F3;3B1)OVERLAP_F_B"


def test_degenerate_job_is_the_plans_program():
    compiled = planc.compile("plans/seed.plan", seed_transformer_tiny(), 4)
    job = compiled.job
    assert len(job.parts) == 1 and job.parts[0].modules == ("",)
    assert job.program is compiled.program is job.parts[0].program
    assert job.view(DENSE).axis_names == ("shard",)
    assert [str(a) for a in job.schedule.actions[0]] == ["0F0", "0B0"]
    (role,) = job.roles
    assert role.stages == (0,) and role.actions == job.schedule.actions[0]
    assert job.step_ops == ()


def test_loss_parallel_is_a_step_op():
    job = planc.compile("plans/zoo-llama-tp.plan", llama_tiny(), 4).job
    (op,) = job.step_ops
    assert isinstance(op, LossParallel) and op.module == "output"
    assert job.view(DENSE).axis_names == ("shard", "tensor")


def test_step_schedule_gradient_sync():
    every, last = step_schedule(4), step_schedule(4, "last")
    backward = [a for a in every.actions[0] if a.kind == FULL_BACKWARD]
    assert [str(a) for a in last.actions[0]] == ["0F0", "0B0", "0F1", "0B1", "0F2", "0B2", "0F3", "0B3"]
    assert [every.reduces(a) for a in backward] == [True] * 4
    assert [last.reduces(a) for a in backward] == [False, False, False, True]
    with pytest.raises(ValueError):
        step_schedule(0)
