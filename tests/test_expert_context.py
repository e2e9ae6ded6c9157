"""Expert x context parallelism, statically and in the estimators (no gloo ranks; the training
proof is tests/test_expert_context_dist.py).

- The plan checks clean (P487 is the pipeline case only) and lowers to both: `AttendOverContext`
  and `DispatchExperts` ops, the `ShardBatch` step op, dense FSDP on shard x context flattened,
  the expert view (efsdp = shard x context / expert, expert) borrowing the context ranks.
- The step-time model's collectives (FSDP's per unit, the context axis's K/V all-gathers and
  reduce-scatters, the all-to-alls of a context rank's `tokens / context` routed rows) equal those
  of a fake-process-group step of the applied plan (`record_collectives`, balanced routing).
- The memory estimate (one rank composing the context and expert emulations) against a
  fake-process-group step's FSDPMemTracker.
- `planc suggest` searches context x expert combinations, and the plan it writes checks clean.
- The shipped long-context MoE plan and its tiny sibling have the same rules.
"""

from __future__ import annotations

import collections
import pathlib

import pytest
import torch

import planc
from planc.lower.job import ShardBatch
from planc.lower.program import AttendOverContext, DispatchExperts, FullyShard
from planc.zoo import moe_llama_tiny

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLAN = """model planc.zoo:moe_llama_tiny
mesh (shard = *, context = 2, expert = 2)
unit layers.*
parallel layers.*.attention context
parallel layers.*.moe.experts expert
"""
SHAPE = (2, 64)


def test_expert_x_context_lowers_to_both_and_borrows_the_context_ranks():
    c = planc.compile(planc.loads(PLAN), moe_llama_tiny(), 4, strict=False)
    assert c.ok, c.diagnostics
    job = c.job
    assert len(job.program.of_type(AttendOverContext)) == 2 and len(job.program.of_type(DispatchExperts)) == 2
    assert job.step_op(ShardBatch)
    assert {op.axes for op in job.program.of_type(FullyShard)} == {("shard_context",)}
    assert [(a.name, a.size) for a in job.view("expert").axes] == [("efsdp", 2), ("expert", 2)]
    two = planc.compile(planc.loads(PLAN), moe_llama_tiny(), 2, strict=False)
    assert two.ok and [(a.name, a.size) for a in two.job.view("expert").axes] == [("efsdp", 1), ("expert", 2)]


CASES = {"context 2 x expert 2": (PLAN, 2), "shard 2 x context 2, expert 2": (PLAN, 4),
         "with checkpointing": (PLAN + "checkpoint layers.* full\n", 2)}


@pytest.mark.parametrize("name", list(CASES))
def test_time_model_collectives_equal_a_fake_process_group_step(name):
    """Under `checkpoint layers.* full` the recompute dispatches and combines again in the backward
    (and gathers K/V again): the model counts both."""
    from planc.analysis.comms import record_collectives
    from planc.analysis.simulate import zoo_inputs
    from planc.estimate.time import estimate_step_time

    text, world = CASES[name]
    with torch.device("meta"):
        model = moe_llama_tiny()
    st = estimate_step_time(planc.compile(planc.loads(text), model, world), world=world, input_shape=SHAPE)
    predicted = collections.Counter()
    for u in st.per_unit:
        for c in u.collectives:
            # the activation collectives run outside FSDP's unshard / post_backward: not attributed to a unit
            key = "activations" if c.axis in ("context", "expert") else u.name
            predicted[(key, c.kind, c.phase, c.bytes, c.ranks)] += c.times
    recorded = collections.Counter(
        ("activations" if r.unit in ("other", "tensor") else r.unit, r.kind, r.phase, r.bytes, r.ranks)
        for r in record_collectives(planc.loads(text), moe_llama_tiny, world, inputs=zoo_inputs(SHAPE)))
    assert predicted == recorded
    # the controls: both axes' collectives are there, the all-to-alls move a context rank's rows
    # (64 tokens / context 2 x top-2 x dim 64 x fp32), 2 layers x dispatch and combine, both ways
    a2a = ("activations", "all_to_all", "forward", 64 * 2 * 64 * 4, 2)
    assert predicted[a2a] == 4
    assert predicted[(*a2a[:2], "backward", *a2a[3:])] == (8 if "checkpoint" in text else 4)
    assert any(k[1] == "all_gather" and k[0] == "activations" for k in predicted)


@pytest.mark.parametrize("world", [2, 4])
def test_memory_estimate_equals_a_fake_process_group_step(world, monkeypatch):
    """The trace of one rank that is both a context rank and an expert rank (rank 0's CPU path:
    `context_local.CPU_RANK`; balanced routing in both) against FSDPMemTracker on the applied plan in a
    fake process group (the runtime's dispatch under `balanced_routing`): the fake step allocates 1,024
    bytes more, the same constant as every context plan without experts (tests/test_time_context.py);
    the GPU path's estimate is below by the CPU kernel's float masks. Real gloo ranks:
    tests/test_expert_context_dist.py."""
    import expert_memory_workers

    from planc.analysis.simulate import simulate, zoo_inputs
    from planc.backends.experts import balanced_routing
    from planc.estimate import context_local, memory
    from planc.zoo import routed

    monkeypatch.setattr(routed.Router, "forward", expert_memory_workers.balanced_route)
    with balanced_routing():  # clipping is planc's (two meshes), not torch's: none in the measured steps
        sim = simulate(planc.loads(PLAN), moe_llama_tiny, world, inputs=zoo_inputs(SHAPE), clip=None)
    peaks = {}
    for cpu in (0, None):
        monkeypatch.setattr(context_local, "CPU_RANK", cpu)
        with torch.device("meta"):
            model = moe_llama_tiny()  # a new graph: no trace cached across modes
        est = memory.estimate(planc.compile(planc.loads(PLAN), model, world), world, input_shape=SHAPE)
        assert "one of 2 context ranks" in est.source and "one of 2 expert ranks" in est.source
        peaks[cpu] = est.peak.total
    assert sim.peak - peaks[0] == 1024, (sim.peak, peaks)
    assert 0 < peaks[0] - peaks[None] <= 16384  # the CPU kernel's float masks, 2 layers


def test_suggest_searches_context_and_expert_together(tmp_path):
    """At a budget only the context 2 x expert 2 search is asked for: the plan written has both
    axes and checks clean (its `expect` line included)."""
    from planc import cli

    out = tmp_path / "s.plan"
    code = cli.main(["suggest", "--model", "planc.zoo:moe_llama_tiny", "--world-size", "4", "--budget", "64MiB",
                     "--input-shape", "2x64", "--context-parallel", "auto", "--context", "2", "--expert-parallel",
                     "auto", "--expert", "2", "-o", str(out), "-q"])
    assert code == 0
    text = out.read_text()
    assert "context = 2" in text and "expert = 2" in text, text
    assert "parallel layers.*.attention context" in text and "parallel layers.*.moe.experts expert" in text
    assert "borrowed from shard x context" in text
    assert cli.main(["check", str(out), "--world-size", "4"]) == 0


def _rules(path: pathlib.Path) -> list[str]:
    return [line for line in path.read_text().splitlines()
            if line.strip() and not line.startswith(("#", "model ", "mesh ", "expect "))]


def test_the_shipped_plan_and_its_tiny_sibling_have_the_same_rules():
    big, tiny = ROOT / "plans" / "qwen3-moe-long-context.plan", ROOT / "plans" / "qwen3-moe-long-context-tiny.plan"
    assert _rules(big) == _rules(tiny)
    assert "parallel layers.*.attention context" in _rules(big) and "parallel layers.*.moe.experts expert" in _rules(big)
