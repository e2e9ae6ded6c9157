"""The pipeline timeline (planc/estimate/timeline.py) against the textbook closed forms and torch's schedules.

Oracle: on equal stages without communication the bubble of a pipeline is known in closed form,
(p-1)/(m+p-1) for GPipe and 1F1B and (p-1)/(v m+p-1) with v stages per rank (Narayanan et al.,
2021); the simulation derives it from torch's own action lists, it does not add it.
"""

from __future__ import annotations

import dataclasses

import pytest

from planc.estimate.timeline import Deadlock, Uniform, simulate
from planc.lower.job import Action, Schedule, UnknownKind
from planc.lower.schedules import SCHEDULES, SINGLE_STAGE, schedule


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"])
@pytest.mark.parametrize("pp,microbatches", [(2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_bubble_on_uniform_stages_is_the_closed_form(name, pp, microbatches):
    v = 1 if name in SINGLE_STAGE else 2
    for f, b in ((1.0, 1.0), (1.0, 2.0)):
        timeline = simulate(schedule(name, pp, microbatches, v), Uniform(f, b))
        closed = (pp - 1) / (v * microbatches + pp - 1)
        assert timeline.bubble() == pytest.approx(closed, rel=1e-12)
        for rank in range(pp):  # equal stages: every rank idles as long
            assert timeline.bubble(rank) == pytest.approx(closed, rel=1e-12)
        assert timeline.step_s == pytest.approx((v * microbatches + pp - 1) * (f + b))


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("pp,microbatches", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_every_torch_schedule_runs_to_the_end(name, pp, microbatches):
    v = 1 if name in SINGLE_STAGE else 2
    sched = schedule(name, pp, microbatches, v)
    timeline = simulate(sched, Uniform())
    busy = (1.0 + 2.0) * microbatches * v  # every (stage, microbatch) forward and backward ran, once
    assert [r.busy_s for r in timeline.ranks] == pytest.approx([busy] * pp)
    assert all(r.spans[-1].end <= timeline.step_s for r in timeline.ranks)
    if name in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):  # the split backward fills the bubble
        assert timeline.bubble() < (pp - 1) / (v * microbatches + pp - 1)


def test_a_schedule_that_waits_on_itself_deadlocks():
    # rank 1 runs the backward of microbatch 0 before its forward: it waits for itself
    good = schedule("GPipe", 2, 2)
    bad = ((Action(1, "B", 0), Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 1)),)
    with pytest.raises(Deadlock, match="rank 1 at 1B0"):
        simulate(dataclasses.replace(good, actions=good.actions[:1] + bad), Uniform())


def test_transfers_and_stage_costs_shape_the_step():
    class Slow(Uniform):
        def compute_s(self, stage, kind):  # the last stage is twice as slow: it binds
            return super().compute_s(stage, kind) * (2 if stage == 3 else 1)

        def p2p_s(self, src, dst):
            return 0.5

    sched = schedule("1F1B", 4, 8)
    timeline = simulate(sched, Slow())
    assert timeline.ranks[3].busy_s == 2 * timeline.ranks[0].busy_s
    # the first microbatch reaches the last stage after 3 forwards and 3 transfers; then the last
    # stage computes without a break (it is the bottleneck), then its gradient goes back 3 stages
    assert timeline.step_s == pytest.approx(3 * 1.5 + 8 * 6 + 3 * (0.5 + 2))
    assert timeline.binding_rank == 0


def test_an_unknown_action_is_refused():
    sched = Schedule("odd", 1, ((0,),), ((Action(0, "F", 0), Action(0, "X", 0)),))
    with pytest.raises(UnknownKind, match="timeline"):
        simulate(sched, Uniform())
