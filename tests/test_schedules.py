"""planc's pipeline schedules against torch's: placement, torch's own order, each (stage, microbatch) once."""

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from planc.lower.schedules import SCHEDULES, SINGLE_STAGE, _PlaceholderStage, placement, schedule


def _v(name):
    return 1 if name in SINGLE_STAGE else 2


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("pp,microbatches", [(2, 4), (4, 8)])
def test_every_stage_runs_forward_and_backward_of_every_microbatch_once(name, pp, microbatches):
    sched = schedule(name, pp, microbatches, _v(name))
    done = []  # a full backward (B) is the input backward (I) and the weight backward (W) at once
    for rank, actions in enumerate(sched.actions):
        for action in actions:
            for a in action.sub or (action,):
                if a.is_compute:
                    assert a.stage in sched.stages[rank], (rank, str(a))
                    done += [(a.stage, k, a.microbatch) for k in ({"B": "IW"}.get(a.kind, a.kind))]
    expected = [(s, k, m) for s in range(pp * _v(name)) for k in "FIW" for m in range(microbatches)]
    assert sorted(done) == sorted(expected)


@pytest.mark.parametrize("name", [n for n in SCHEDULES if n not in SINGLE_STAGE])
@pytest.mark.parametrize("pp,mb", [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_multi_stage_actions_are_torchs_pipeline_order(name, pp, mb):
    if name == "DualPipeV" and mb < 2 * pp:  # torch 2.13 refuses fewer microbatches than stages
        with pytest.raises(ValueError, match="at least as many microbatches as stages"):
            schedule(name, pp, mb, 2)
        return
    sched = schedule(name, pp, mb, 2)
    cls = torch_schedules.get_schedule_class(name)
    for rank, held in enumerate(sched.stages):
        built = cls([_PlaceholderStage(s, 2 * pp, rank, pp) for s in held], mb)
        # the runtime lowers the compute-only order with torch's own `_add_reduce_grad`
        order = torch_schedules._add_reduce_grad(list(built.pipeline_order[rank]), mb)
        assert [str(a) for a in sched.actions[rank]] == [str(a) for a in order if a is not None]


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_stage_reduces_once_after_its_last_backward(name):
    # torch's stage backs every microbatch without gradient sync and reduces in REDUCE_GRAD
    sched = schedule(name, 2, 4, _v(name))
    assert sched.gradient_sync == "last" and sched.pipelined
    for rank, actions in enumerate(sched.actions):
        flat = [a for action in actions for a in (action.sub or (action,))]
        reducing = [i for i, a in enumerate(flat) if sched.reduces(a)]
        assert sorted(flat[i].stage for i in reducing) == sorted(sched.stages[rank])
        assert all(flat[i].kind == "REDUCE_GRAD" for i in reducing)
        for i in reducing:
            last = max(j for j, a in enumerate(flat) if a.stage == flat[i].stage and a.kind in "BW")
            assert last < i


def test_single_stage_rank0_matches_torchs_order():
    # torch's 1F1B order is right on rank 0 (wrong past it on 2.13: see planc/lower/schedules.py).
    for name in SINGLE_STAGE:
        built = torch_schedules.get_schedule_class(name)(_PlaceholderStage(0, 4, 0, 4), 8)
        ours = schedule(name, 4, 8).actions[0]
        assert [str(a) for a in ours] == [str(a) for a in built.pipeline_order[0] if a is not None]


def test_one_f_one_b_keeps_pp_minus_rank_microbatches_in_flight():
    sched = schedule("1F1B", 4, 8)
    for rank, actions in enumerate(sched.actions):
        live = peak = 0
        for a in actions:
            live += {"F": 1, "B": -1}.get(a.kind, 0)
            peak = max(peak, live)
        assert peak == 4 - rank


def test_placement_loop_and_v():
    assert placement("Interleaved1F1B", 4, 2) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert placement("ZBVZeroBubble", 4, 2) == ((0, 7), (1, 6), (2, 5), (3, 4))
    with pytest.raises(ValueError):
        placement("DualPipeV", 4, 3)
    with pytest.raises(ValueError):
        schedule("1F1B", 2, 4, 2)
