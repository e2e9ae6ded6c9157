"""The memory estimate of a context plan against FSDPMemTracker on real gloo ranks, through the plan.

The estimate traces one context rank's step on fake tensors (`planc/estimate/context_local.py`:
its `seq / cp` tokens and their positions; each styled attention gathers K and V over the
context axis with the runtime's allocations, the gathered K/V kept for backward) and replays
FSDP2 over the flattened shard x context axis. The oracle is torch's FSDPMemTracker in a real
step of the same plan (`planc.apply`, `applied.shard_batch`, 2 AdamW steps, the second
measured), with FSDP's reduce-scatter done as all-reduce + slice (what NCCL allocates; stock
gloo clones its input, see tests/test_memory_dist.py). zoo Llama tiny, fp32, batch 2 x 64.
"""

from __future__ import annotations

import context_memory_workers as workers
import pytest
import torch
from distributed import run

import planc
from planc.estimate import memory
from planc.zoo import llama3

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def two():
    return run(workers.measure, 2, ("context", "context + checkpoint", "without context"))


@pytest.fixture(scope="module")
def four():
    return run(workers.measure, 4, ("shard x context",))


def estimate(name: str, world: int) -> memory.Estimate:
    with torch.device("meta"):
        model = llama3.llama_tiny()
    return memory.estimate(planc.compile(planc.loads(workers.PLANS[name]), model, world), world,
                           input_shape=workers.SHAPE)


MERGED = ("activations", "unsharded_grads", "reduce_scatter")


def _merged(breakdown: dict) -> dict:
    out = {k: v for k, v in breakdown.items() if v and k not in MERGED}
    out["activations"] = sum(breakdown.get(k, 0) for k in MERGED)
    return out


def _equal(results, name, world):
    est = estimate(name, world)
    assert "one of 2 context ranks" in est.source
    for rank, result in enumerate(results):
        real = result[name]
        assert est.peak.total == real["peak"], (rank, est.peak.label, est.peak.bytes, real)
        # the same moment, by category: the tracker files unsharded gradients (and the all-reduce +
        # slice's reduce-scatter input) under activations; every other category is equal
        ours, theirs = _merged(est.peak.bytes), _merged(real["breakdown"])
        assert ours == theirs, (rank, est.peak.label, real["moment"])
        assert est.peak.bytes["inputs"] == real["breakdown"]["inputs"], rank  # seq / cp tokens + positions


def test_context_2_estimate_equals_the_tracker(two):
    _equal(two, "context", 2)


def test_context_with_checkpointing_estimate_equals_the_tracker(two):
    _equal(two, "context + checkpoint", 2)


def test_shard_x_context_estimate_equals_the_tracker(four):
    _equal(four, "shard x context", 4)


def test_context_divides_activations(two):
    """The same plan without the context axis holds the whole sequence on each rank: more activations."""
    est, base = estimate("context", 2), estimate("without context", 2)
    real, real_base = two[0]["context"]["breakdown"]["activations"], two[0]["without context"]["breakdown"]["activations"]
    assert base.peak.total == two[0]["without context"]["peak"]
    assert est.activations < 0.8 * base.activations
    assert real < 0.8 * real_base
