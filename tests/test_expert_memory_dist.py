"""The memory estimate of an expert-parallel plan against FSDPMemTracker on real gloo ranks.

`plans/routed-moe-ep.plan` (expert 2: each rank keeps 2 of the 4 experts of every layer; efsdp
= 1) on the zoo's routed MoE tiny, 2 ranks, two AdamW steps (the second measured), FSDP's
reduce-scatter as all-reduce + slice (what NCCL allocates; tests/test_memory_dist.py). The
estimate traces one expert rank's step with balanced routing (`planc/estimate/expert_local.py`);
the real run's router is made balanced (`expert_memory_workers.balanced_route`, in both) so
that the split sizes are the ones the estimate assumes.

What holds: the step's peak byte for byte (664740 bytes, in the backward of layers.0), its
state (sharded parameters, gradients, AdamW moments of the local experts and the dense shards)
and the rest by category (the tracker files all-gather buffers, reduce-scatter inputs and
unsharded gradients under activations: compared summed), the optimizer step's peak; the same
plan without the expert axis, byte for byte. Each unit holds two FSDP parameter groups (dense
and expert: per-parameter meshes); the experts' group on a 1-rank efsdp mesh all-gathers
nothing (`memory.Gather`), and keeps no forward all-gather result: FSDP2 keeps one for all groups,
so the dense group's is dropped at the expert group's copy-out. The forward's highest moment is exact
too (610932 bytes; counting the dense group's result kept, it was 617836, 1.1% over).

NOTE (flakiness): a CI run (2026-12-04) measured 4096 B more than the estimate in the 4-rank
test, at the experts' backward of layers.1: one all-to-all buffer that gloo's worker thread
released late (`tests/distributed.lowest_peak`). Each plan is now measured twice on every rank and
the lower peak compared; an excess the estimate misses shows in both and still fails.
"""

from __future__ import annotations

import expert_memory_workers as workers
import pytest
import torch
from distributed import lowest_phase, run

import planc
from planc import zoo
from planc.estimate import memory
from planc.zoo import routed

pytestmark = pytest.mark.dist

TEXT = workers.PLAN.read_text()
PLANS = {"expert": TEXT,
         "without expert": TEXT.replace("parallel layers.*.moe.experts expert\n", "").replace(", expert = 2", "")}
STATE = ("sharded_params", "sharded_grads", "optimizer_state", "inputs")
MERGED = ("activations", "unsharded_grads", "reduce_scatter", "all_gather")


@pytest.fixture(scope="module")
def real():
    return run(workers.measure, 2, PLANS)


def estimate(name: str, monkeypatch) -> memory.Estimate:
    monkeypatch.setattr(routed.Router, "forward", workers.balanced_route)
    with torch.device("meta"):
        model = zoo.routed_moe_tiny()  # a new graph: no trace cached across routings
    return memory.estimate(planc.compile(planc.loads(PLANS[name]), model, 2), 2, input_shape=workers.SHAPE)


def test_without_expert_axis_equals_the_tracker(real, monkeypatch):
    est = estimate("without expert", monkeypatch)
    for rank in real:
        assert est.peak.total == rank["without expert"]["peak"]


def test_expert_state_equals_the_tracker(real, monkeypatch):
    est = estimate("expert", monkeypatch)
    assert "one of 2 expert ranks" in est.source and "balanced routing" in est.source
    base = estimate("without expert", monkeypatch)
    for rank in real:
        measured = rank["expert"]
        for key in STATE:
            assert est.peak.bytes[key] == measured["breakdown"][key], key
        optimizer = max(m.total for m in est.timeline if m.label.startswith("optimizer"))
        assert optimizer == lowest_phase(measured, "optimizer")
        assert est.peak.total == measured["peak"], (est.peak.label, measured["moment"])
        merged = sum(est.peak.bytes.get(k, 0) for k in MERGED)
        assert merged == sum(measured["breakdown"].get(k, 0) for k in MERGED)
        forward = max(m.total for m in est.timeline if "forward" in m.label and "backward" not in m.label)
        real_forward = lowest_phase(measured, "forward")
        assert forward == real_forward, (forward, real_forward)
        assert measured["peak"] < rank["without expert"]["peak"]
    # an expert rank gathers 2 of 4 experts: the unsharded layer is smaller than without the axis
    layers = {u.name: u for u in est.units}, {u.name: u for u in base.units}
    assert layers[0]["layers.0"].unsharded < layers[1]["layers.0"].unsharded


def test_expert_x_efsdp_peak_equals_the_tracker(monkeypatch):
    """4 ranks: expert 2 x efsdp 2 (each expert rank's 2 experts FSDP-sharded over 2 ranks, dim 0)."""
    real = run(workers.measure, 4, {"expert": TEXT})
    monkeypatch.setattr(routed.Router, "forward", workers.balanced_route)
    with torch.device("meta"):
        model = zoo.routed_moe_tiny()
    est = memory.estimate(planc.compile(planc.loads(TEXT), model, 4), 4, input_shape=workers.SHAPE)
    for rank in real:
        assert est.peak.total == rank["expert"]["peak"], (est.peak.label, rank["expert"]["moment"])
        for key in STATE:
            assert est.peak.bytes[key] == rank["expert"]["breakdown"][key], key
