"""The collectives of an expert-parallel step against those a real gloo step issues.

`plans/routed-moe-ep.plan` (expert 2, efsdp 1) on the zoo's routed MoE tiny, 2 ranks, balanced
routing (`expert_memory_workers.balanced_route`), one forward and backward recorded by
`planc/analysis/comms.py`'s recorder on a real process group (the dispatch's split sizes from
the counts' all-to-all; on a fake group the recorder runs it under balanced routing instead:
tests/test_expert_plan.py).
`collectives.unit_collectives` (the dense parameter group of each unit; the expert group has
none on a 1-rank efsdp mesh) and `collectives.expert_collectives` (2 all-to-alls per MoE layer
forward, 2 backward, tokens x top_k x dim bf16 each) equal it per unit, kind, bytes, group size
and phase, and the step-time estimate carries exactly these; at 4 ranks (expert 2 x efsdp 2) the
experts' own all-gathers and reduce-scatters too. Not counted: the counts' all-to-all
(`c10d.alltoall_base_`, `experts` int64 values), neither recorded nor estimated.
"""

from __future__ import annotations

from collections import Counter

import expert_memory_workers as workers
import pytest
import torch
from distributed import run

import planc
from planc import zoo
from planc.estimate import collectives
from planc.zoo import ROUTED_MOE_TINY_CONFIG as CONFIG

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def recorded():
    return run(workers.record, 2)


def _compiled():
    with torch.device("meta"):
        model = zoo.routed_moe_tiny()
    return planc.compile(planc.loads(workers.PLAN.read_text()), model, 2)


def test_unit_collectives_equal_the_recorded(recorded):
    compiled = _compiled()
    units = collectives.unit_collectives(compiled.program, compiled.graph, 2)
    for found in recorded:
        for op, cs in zip(compiled.program.units, units):
            want = Counter((c.kind, c.bytes, c.ranks, c.phase) for c in cs)
            got = Counter((k, b, r, p) for k, u, b, r, p in found if u == op.name)
            assert got == want, op.name


def test_all_to_alls_equal_the_recorded(recorded):
    compiled = _compiled()
    tokens = workers.SHAPE[0] * workers.SHAPE[1]
    per_layer = collectives.expert_collectives(compiled.program, compiled.graph, 2, tokens, CONFIG.top_k, CONFIG.dim)
    assert sorted(per_layer) == [f"layers.{i}.moe.experts" for i in range(CONFIG.n_layers)]
    want = Counter((c.kind, c.bytes, c.ranks, c.phase) for cs in per_layer.values() for c in cs)
    assert want[("all_to_all", tokens * CONFIG.top_k * CONFIG.dim * 2, 2, "forward")] == 2 * CONFIG.n_layers
    for found in recorded:
        assert Counter((k, b, r, p) for k, u, b, r, p in found if k == "all_to_all") == want


def test_step_time_model_schedules_the_recorded_collectives(recorded):
    """The step-time estimate's collectives (per unit: FSDP's, and its MoE layer's all-to-alls on the
    expert axis, blocking) are the recorded ones."""
    from planc.estimate import time

    compiled = _compiled()
    step = time.estimate_step_time(compiled, world=2, input_shape=workers.SHAPE)
    for found in recorded:
        for unit in step.per_unit:
            fsdp = Counter((c.kind, c.bytes, c.ranks, c.phase) for c in unit.collectives if c.kind != "all_to_all")
            assert fsdp == Counter((k, b, r, p) for k, u, b, r, p in found if u == unit.name), unit.name
        a2a = Counter((c.kind, c.bytes, c.ranks, c.phase) for u in step.per_unit for c in u.collectives
                      if c.kind == "all_to_all" and c.axis == "expert")
        assert a2a == Counter((k, b, r, p) for k, u, b, r, p in found if k == "all_to_all")
    assert {u.name: u.bytes("all_to_all") for u in step.per_unit if u.bytes("all_to_all")} == \
        {f"layers.{i}": 4 * workers.SHAPE[0] * workers.SHAPE[1] * CONFIG.top_k * CONFIG.dim * 2
         for i in range(CONFIG.n_layers)}


def test_expert_x_efsdp_collectives_equal_the_recorded():
    """4 ranks: expert 2 x efsdp 2: the experts' own all-gathers and reduce-scatters on 2 ranks too."""
    from planc.estimate import time

    found = run(workers.record, 4)
    with torch.device("meta"):
        model = zoo.routed_moe_tiny()
    step = time.estimate_step_time(planc.compile(planc.loads(workers.PLAN.read_text()), model, 4), world=4,
                                   input_shape=workers.SHAPE)
    want = Counter((c.kind, c.bytes, c.ranks, c.phase) for u in step.per_unit for c in u.collectives)
    # the experts' group: all-gather forward and backward, reduce-scatter, per layer, over efsdp's 2 ranks
    assert sum(1 for u in step.per_unit for c in u.collectives if c.axis == "efsdp") == 3 * CONFIG.n_layers
    for rank in found:
        assert Counter((k, b, r, p) for k, u, b, r, p in rank) == want
