"""The step-time model of a context plan: its collectives equal a fake-process-group step's, per kind, axis and bytes.

`record_collectives` applies the plan with `planc.apply` on a fake process group (rank 0 of N)
and runs one step with each microbatch cut by `applied.shard_batch`: FSDP's collectives, over
the flattened shard x context ranks, are attributed to their unit; the context attention's
K/V and position all-gathers (forward, and again in a checkpointed block's recompute) and the
all-reduces of the gathered K/V gradients (backward) run outside any unit ("other"). The
model (`planc/estimate/collectives.py`: `unit_collectives`, `context_collectives`) predicts
each, from the plan and one profiled step of the plain model.
"""

from __future__ import annotations

import collections

import context_workers
import pytest
import torch

import planc
from planc.analysis.comms import record_collectives
from planc.analysis.simulate import zoo_inputs
from planc.estimate.time import estimate_step_time
from planc.zoo import llama3

SHAPE = (2, 64)
BASE = "unit layers.*\nparallel layers.*.attention context\n"
CASES = {
    "context 2": ("mesh (shard = *, context = 2)\n" + BASE, 2),
    "shard x context 2 x 2": ("mesh (shard = 2, context = 2)\n" + BASE, 4),
    "context 4": ("mesh (shard = *, context = 4)\n" + BASE, 4),
    "replicate x context 2 x 2": ("mesh (replicate = 2, shard = 1, cp = 2)\n" + BASE, 4),
    "context + checkpoint": ("mesh (shard = *, context = 2)\ncheckpoint layers.*\n" + BASE, 2),
    "context + accumulate": ("mesh (shard = *, context = 2)\nstep { accumulate 2, sync = last }\n" + BASE, 2),
    # tensor parallelism's activation collectives move a context rank's 1/context of the sequence
    "context x tensor": (context_workers.PLANS["context x tensor"], 4),
    "context x sequence parallel": (context_workers.PLANS["context x sequence parallel"], 4),
}


def _predicted(text: str, world: int):
    with torch.device("meta"):
        model = llama3.llama_tiny()
    st = estimate_step_time(planc.compile(planc.loads(text), model, world), world=world, input_shape=SHAPE)
    found = collections.Counter()
    for u in st.per_unit:
        for c in u.collectives:
            # the context collectives run outside FSDP's unshard / post_backward: the recorder says "other"
            found[("other" if c.axis == "context" else u.name, c.kind, c.phase, c.bytes, c.ranks)] += c.times
    return st, found


@pytest.mark.parametrize("name", list(CASES))
def test_collectives_equal_a_fake_process_group_step(name):
    text, world = CASES[name]
    st, predicted = _predicted(text, world)
    recorded = collections.Counter((r.unit, r.kind, r.phase, r.bytes, r.ranks) for r in record_collectives(
        planc.loads(text), llama3.llama_tiny, world, inputs=zoo_inputs(SHAPE)))
    if "tensor" in text:  # DTensor's collectives are not attributed to a unit (a sequence norm's are): no units
        predicted, recorded = (sum((collections.Counter({k[1:]: n}) for k, n in c.items()), collections.Counter())
                               for c in (predicted, recorded))
    assert predicted == recorded
    context = [c for u in st.per_unit for c in u.collectives if c.axis == "context"]
    assert {c.kind for c in context} == {"all_gather", "reduce_scatter"}  # the control: the gathers are there
    cp = 4 if name == "context 4" else 2
    assert all(c.ranks == cp for c in context)


@pytest.mark.parametrize("name", ["context x tensor", "context x sequence parallel"])
def test_memory_of_context_x_tensor_equals_a_fake_process_group_step(name):
    """The trace of one context x tensor rank (local heads, 1 / context of the sequence; the CPU
    path, `context_local.CPU_RANK`) against FSDPMemTracker on the applied plan in a fake process
    group. NOTE: the fake-process-group step allocates 1,024 bytes more than the trace in every
    context case, with or without a tensor axis, where real gloo ranks equal the trace byte for
    byte (tests/test_context_memory_dist.py); the GPU path's estimate is below by the CPU masks."""
    from planc.analysis.simulate import simulate
    from planc.estimate import context_local, memory

    text, world = CASES[name]
    sim = simulate(planc.loads(text), llama3.llama_tiny, world, inputs=zoo_inputs(SHAPE))
    peaks = {}
    for cpu in (0, None):
        with torch.device("meta"):
            model = llama3.llama_tiny()
        context_local.CPU_RANK = cpu
        try:
            est = memory.estimate(planc.compile(planc.loads(text), model, world), world, input_shape=SHAPE)
        finally:
            context_local.CPU_RANK = None
        assert "one of 2 tensor-parallel ranks" in est.source and "one of 2 context ranks" in est.source
        peaks[cpu] = est.peak.total
    assert sim.peak - peaks[0] == 1024, (sim.peak, peaks)
    assert 0 < peaks[0] - peaks[None] <= 8192  # the CPU kernel's float masks, 2 layers of local heads


def test_a_context_rank_computes_its_share_and_blocks_on_the_gathers():
    """Compute per rank is the plain step's / context; the gathers' time is added, not overlapped."""
    text, world = CASES["context 2"]
    st, _ = _predicted(text, world)
    with torch.device("meta"):
        model = llama3.llama_tiny()
    plain = estimate_step_time(planc.compile(planc.loads("unit layers.*\n"), model, world), world=world,
                               input_shape=SHAPE)
    assert st.compute_s == pytest.approx(plain.compute_s / 2)
    assert st.tokens == plain.tokens // 2  # the two ranks of one context group share a batch
    assert any("context parallelism (2 ranks)" in a for a in st.assumptions)
