"""Expert parallelism before anything runs: the resolved style, the lowered ops, the expert view.

The rules checked: the expert axis borrows shard x context x tensor (it does not multiply into
the world); the expert view is (replicate,) efsdp, expert with efsdp = borrowed / expert; the
experts' FSDP shards dim 0, or dim 1 when efsdp x expert > experts (torchtitan's rule); the
router stays on the dense mesh; with experts each inner unit prefetches the next explicitly,
a plan's own `prefetch` winning; fmt keeps the style.
"""

from __future__ import annotations

import pathlib

import torch

import planc
from planc.lang.fmt import format_plan
from planc.lower.job import EXPERT
from planc.lower.program import DispatchExperts
from planc.zoo import routed_moe_tiny

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLAN = """model planc.zoo:routed_moe_tiny
mesh ({mesh})
unit layers.*
parallel layers.*.moe.experts expert
"""


def _compiled(mesh: str, world: int):
    with torch.device("meta"):
        model = routed_moe_tiny()  # 4 experts
    return planc.compile(planc.loads(PLAN.format(mesh=mesh)), model, world)


def test_the_expert_view_and_the_experts_placements():
    c = _compiled("shard = *, expert = 2", 4)
    view = c.job.view(EXPERT)
    assert [(a.name, a.size) for a in view.axes] == [("efsdp", 2), ("expert", 2)]
    assert [a.name for a in c.job.view().axes] == ["shard"]  # the dense view has no expert axis
    ops = c.program.of_type(DispatchExperts)
    assert [op.module for op in ops] == ["layers.0.moe.experts", "layers.1.moe.experts"]
    assert ops[0].experts == 4 and ops[0].axis == "expert"
    layer = c.program.unit("layers.0")
    assert layer.experts == tuple((f"layers.0.moe.experts.{w}", 0) for w in ("w1", "w2", "w3"))
    assert layer.expert_axes == ("efsdp",) and layer.axes == ("shard",)
    assert "layers.0.moe.router.gate.weight" in layer.params  # the router: dense
    assert c.program.unit("<root>").experts == ()


def test_experts_shard_dim_1_when_efsdp_times_expert_exceeds_the_experts():
    c = _compiled("replicate = 2, shard = *, expert = 2", 16)  # efsdp 4 x expert 2 = 8 > 4 experts
    assert [(a.name, a.size) for a in c.job.view(EXPERT).axes] == [("replicate", 2), ("efsdp", 4), ("expert", 2)]
    assert {d for _, d in c.program.unit("layers.0").experts} == {1}
    assert c.program.unit("layers.0").expert_axes == ("replicate", "efsdp")


def test_expert_parallelism_prefetches_explicitly_unless_the_plan_says():
    c = _compiled("shard = *, expert = 2", 2)
    assert c.program.prefetch("forward") == {"layers.0": ("layers.1",)}
    assert c.program.prefetch("backward") == {"layers.1": ("layers.0",)}
    with torch.device("meta"):
        model = routed_moe_tiny()
    text = PLAN.format(mesh="shard = *, expert = 2") + "unit output\nunit layers.1 { prefetch backward = [layers.0, output] }\n"
    own = planc.compile(planc.loads(text), model, 2)
    assert own.program.prefetch("backward")["layers.1"] == ("layers.0", "output")  # the plan's list wins


def test_the_expert_axis_borrows_its_ranks_and_fmt_keeps_the_style():
    c = _compiled("shard = *, ep = 2", 8)
    assert c.mesh.sizes(8) == {"replicate": 1, "shard": 8, "expert": 2}
    assert c.job.view(EXPERT).axes[-1].name == "ep"
    text = "model planc.zoo:routed_moe_tiny\nmesh (shard=*,ep=2)\nparallel   layers.*.moe.experts    expert\n"
    assert "parallel layers.*.moe.experts expert" in format_plan(text)


def test_a_fake_group_step_issues_the_collectives_the_time_model_predicts():
    """`planc/analysis/comms.py` records one step of plans/routed-moe-ep.plan on a fake process
    group (the dispatch under balanced routing: `experts.balanced_routing`) at 2 ranks (efsdp 1)
    and 4 (efsdp 2): FSDP's collectives per unit, and the all-to-alls (4 per MoE layer: dispatch
    and combine, forward and backward, on the expert axis), equal the step-time model's. The
    recorder does not attribute an all-to-all to its layer (it files it under "tensor"), so those
    are compared as a multiset; the count is the layers' 4 each."""
    from collections import Counter

    from planc.analysis import comms
    from planc.analysis.simulate import zoo_inputs
    from planc.estimate import time
    from planc.zoo import ROUTED_MOE_TINY_CONFIG as CONFIG

    text = (ROOT / "plans" / "routed-moe-ep.plan").read_text()
    for world in (2, 4):
        found = comms.record_collectives(planc.loads(text), routed_moe_tiny, world, inputs=zoo_inputs((2, 16)))
        with torch.device("meta"):
            model = routed_moe_tiny()
        step = time.estimate_step_time(planc.compile(planc.loads(text), model, world), world=world, input_shape=(2, 16))
        fsdp = Counter((u.name, c.kind, c.bytes, c.ranks, c.phase) for u in step.per_unit for c in u.collectives
                       if c.kind != "all_to_all")
        assert Counter((r.unit, r.kind, r.bytes, r.ranks, r.phase) for r in found if r.kind != "all_to_all") == fsdp
        a2a = Counter((c.kind, c.bytes, c.ranks, c.phase) for u in step.per_unit for c in u.collectives
                      if c.kind == "all_to_all")
        assert Counter((r.kind, r.bytes, r.ranks, r.phase) for r in found if r.kind == "all_to_all") == a2a
        assert sum(a2a.values()) == 4 * CONFIG.n_layers


def test_a_divide_factor_turns_the_experts_gradient_scaling_off():
    """FSDP averages by default: the dispatch scales the experts' gradients by 1 / expert
    (`averaged`); a unit with `reduction divide_factor` divides dense and expert sums alike, so
    nothing is scaled, and the emitted code says so (tests/test_expert_torchtitan_dist.py holds
    that to torchtitan bit for bit)."""
    from planc.backends.emit import emit_python

    averaged = _compiled("shard = *, expert = 2", 4)
    assert all(op.averaged for op in averaged.program.of_type(DispatchExperts))
    assert "averaged=False" not in emit_python(averaged)
    text = PLAN.format(mesh="shard = *, expert = 2") + "defaults { reduction divide_factor = 1.0, force_sum = true }\n"
    with torch.device("meta"):
        summed = planc.compile(planc.loads(text), routed_moe_tiny(), 4)
    assert not any(op.averaged for op in summed.program.of_type(DispatchExperts))
    assert "dispatch_experts(block.moe.experts, expert_mesh, 'expert', averaged=False)" in emit_python(summed)
