"""Memory per role of a pipeline job (planc/estimate/role_memory.py), without processes.

Oracles: torch's schedules (1F1B keeps at most pp - rank microbatches in flight, GPipe all);
the whole model's program (a stage owns exactly its modules' parameters); the one-part memory
estimate of the same model (a pipeline rank holds a share of its state). The peaks themselves
are held against FSDPMemTracker on real ranks in tests/test_roles_memory_dist.py.
"""

from __future__ import annotations

import re

import pytest

import planc
from planc.estimate import memory
from planc.estimate.role_memory import RoleError, estimate_pipeline_memory, whole_program
from planc.lower.pipeline import pipeline_job
from planc.lower.schedules import schedule
from planc.zoo import llama_tiny

PLAN = """model planc.zoo:llama_tiny
mesh (shard = *)
unit tok_embeddings { reshard after_forward = false }
unit layers.* { reshard after_forward = false }
unit [norm, output] { reshard after_forward = false }
root { reshard after_forward = false }
"""
FOUR = [("tok_embeddings",), ("layers.0",), ("layers.1",), ("norm", "output")]
TWO = [("tok_embeddings", "layers.0"), ("layers.1", "norm", "output")]


def _compiled(world):
    return planc.compile(planc.loads(PLAN, filename="pp.plan"), llama_tiny(), world)


def _in_flight(est) -> int:
    return int(re.search(r"at most (\d+) in flight", " ".join(est.notes)).group(1))


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
def test_microbatches_in_flight_follow_the_schedule(name):
    compiled = _compiled(4)
    job = pipeline_job(compiled.job, FOUR, schedule(name, 4, 8))
    ests = estimate_pipeline_memory(job, 4, graph=compiled.graph, input_shape=(8, 16))
    expected = [8] * 4 if name == "GPipe" else [4 - rank for rank in range(4)]
    assert [_in_flight(e) for e in ests] == expected


def test_one_f_one_b_needs_less_than_gpipe_on_the_first_rank():
    compiled = _compiled(2)
    peaks = {}
    for name in ("GPipe", "1F1B"):
        job = pipeline_job(compiled.job, TWO, schedule(name, 2, 8))
        peaks[name] = [e.peak.total for e in estimate_pipeline_memory(job, 2, graph=compiled.graph,
                                                                      input_shape=(16, 16))]
    assert peaks["1F1B"][0] < peaks["GPipe"][0]


def test_each_rank_holds_its_stage_state_only():
    compiled = _compiled(4)  # 2 pipeline ranks x 2 data-parallel ranks
    job = pipeline_job(compiled.job, TWO, schedule("1F1B", 2, 4))
    whole = memory.estimate(compiled, 2)  # the whole model sharded over 2 ranks
    ests = estimate_pipeline_memory(job, 4, graph=compiled.graph, input_shape=(8, 16))
    assert sum(e.sharded_state for e in ests) == whole.sharded_state
    assert all(e.shard == 2 for e in ests)
    units = {p for u in whole_program(job).units for p in u.params}
    assert units == {p for u in compiled.job.program.units for p in u.params}


@pytest.mark.parametrize("name", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                                  "DualPipeV"])
def test_ranks_holding_two_stages_hold_both_states(name):
    compiled = _compiled(2)
    job = pipeline_job(compiled.job, FOUR, schedule(name, 2, 4, 2))
    ests = estimate_pipeline_memory(job, 2, graph=compiled.graph, input_shape=(8, 16))
    whole = memory.estimate(compiled, 1, input_shape=(8, 16))  # one rank: every parameter
    assert sum(e.sharded_state for e in ests) == whole.sharded_state
    for rank, est in enumerate(ests):
        stages = job.schedule.stages[rank]
        assert len(est.notes) == 2 and all(f"stage {s} " in " ".join(est.notes) for s in stages)
        # the step's batch once per rank that feeds the first stage or the last stage's loss
        assert est.peak.bytes["inputs"] == (8 * 16 * 8 if {0, 3} & set(stages) else 0)


def test_a_stage_without_a_unit_of_its_own_is_refused():
    plan = PLAN.replace("unit [norm, output] { reshard after_forward = false }\n", "")
    compiled = planc.compile(planc.loads(plan, filename="pp.plan"), llama_tiny(), 2)
    job = pipeline_job(compiled.job, [("tok_embeddings", "layers.0", "layers.1"), ("norm", "output")],
                       schedule("1F1B", 2, 4))
    with pytest.raises(RoleError, match="stage 1 \\(norm, output\\) has no unit of its own"):
        estimate_pipeline_memory(job, 2, graph=compiled.graph, input_shape=(8, 16))
