"""Expert parallelism on real gloo ranks: the facts of this torch, and training equal to one process.

Facts (torch 2.13, gloo): `fully_shard` with `shard_placement_fn` returning a
`ShardPlacementResult` holds the experts on their own mesh (two parameter groups in one
call); `torch.nn.utils.clip_grad_norm_` then raises ("All operands in aten.stack.default must
have the same mesh"), and planc's `AppliedPlan.clip_grad_norm_` gives the unsharded norm; the
foreach AdamW steps parameters on both meshes. The experts' gradients, averaged by FSDP over
the experts' smaller FSDP group, come out right because the dispatch scales them by 1 / expert
(`planc/backends/experts.py`).

Proof (through `planc.apply`, and at 4 ranks also through `planc emit`'s code and on a meta
model materialised with `reproducible=True`): the routed
MoE tiny (4 experts, top-2), 3 AdamW steps with clipping, the routing uneven
(ranks get different row counts per expert): loss, every gradient and every updated parameter
equal one unsharded process within 1e-5 (fp32), at expert 2 on 2 ranks (efsdp 1) and at
expert 2 x efsdp 2 on 4 ranks; at 2 ranks also a Hugging Face Qwen3-MoE tiny (its fused 3-D
experts, the token-choice layout). Three launches (the third: DCP), under the gloo lock.
"""

from __future__ import annotations

import pytest
from distributed import run, train_example
from expert_workers import PLAN, dcp_optimizer, dcp_round_trip, train_both, train_two

TOL = 1e-5


def _uneven(results, ep: int) -> bool:
    """Some rank sends different row counts to the expert ranks, or ranks send different totals."""
    sent = [[sum(c[i * len(c) // ep:(i + 1) * len(c) // ep]) for i in range(ep)] for r in results for c in r["counts"]]
    return any(len(set(s)) > 1 for s in sent) and len({tuple(s) for s in sent}) > 1


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_trains_like_one_process(world):
    """2 ranks through `planc.apply`, also Hugging Face's Qwen3-MoE tiny and with `checkpoint
    layers.*`; 4 ranks through
    `planc.apply`, through the emitted code, built on meta, applied and materialised
    (`reproducible=True`), with 2 experts (dim 1), and under HSDP (replicate 2 x shard 2, expert 2)."""
    if world == 2:
        runs = run(train_two, world, PLAN)
        _check([r[0] for r in runs])
        for r in runs:  # Hugging Face's Qwen3-MoE tiny (fused 3-D experts, token-choice layout)
            assert r[1]["loss"] < TOL and r[1]["grad"] < TOL and r[1]["param"] < TOL, r[1]
        _check([r[2] for r in runs])  # with activation checkpointing
        return
    runs = run(train_both, world, PLAN)
    for how in range(len(runs[0])):
        _check([r[how] for r in runs], dim=1 if how == 3 else 0, hsdp=how == 4)


def _check(results, dim: int = 0, hsdp: bool = False):
    for r in results:
        assert r["loss"] < TOL and r["grad"] < TOL and r["param"] < TOL, r
        assert r["grads"] == 19  # every parameter compared
        assert r["groups"] == {2}  # dense and expert parameter groups in one fully_shard call
        assert "must have the same mesh" in r["facts"]["torch_clip"]
        assert r["facts"]["norm_diff"] < TOL
    assert dim == 1 or _uneven(results, 2)  # with 2 experts, top-2 sends every token to both
    placements = results[0]["placements"]
    if hsdp:
        assert placements["layers.0.moe.experts.w1"] == "('replicate', 'efsdp')(Replicate(), Shard(dim=0))"
        assert placements["layers.0.moe.router.gate.weight"] == "('replicate', 'shard')(Replicate(), Shard(dim=0))"
        return
    assert placements["layers.0.moe.experts.w1"] == f"('efsdp',)(Shard(dim={dim}),)"
    assert placements["layers.0.moe.router.gate.weight"] == "('shard',)(Shard(dim=0),)"


@pytest.mark.dist
def test_a_dcp_checkpoint_saved_with_experts_parallel_loads_without_and_back(tmp_path):
    """Saved at expert 2 (experts whole-shaped in the state dict, `planc/backends/experts.py`),
    loaded into plain FSDP, saved again and loaded at expert 2: the states equal what was saved
    (a model with other initial values differs, so the loads did something)."""
    for r in run(dcp_round_trip, 2, str(tmp_path)):
        assert r["to_dense"] == 0.0 and r["to_ep"] == 0.0, r
        assert r["fresh"] > 1e-3
        assert "layers.0.moe.experts.w1" in r["keys"]


@pytest.mark.dist
def test_example_trains_the_shipped_expert_plan_under_torchrun():
    """examples/train.py with plans/routed-moe-ep.plan on 4 gloo ranks (shard 4, expert 2 x efsdp 2):
    built on meta, applied, materialised, clipped with `applied.clip_grad_norm_`; the loss falls."""
    stdout, losses = train_example("--plan", "plans/routed-moe-ep.plan", "--model", "planc.zoo:routed_moe_tiny", "--steps", "4")
    assert len(losses) == 4 and losses[-1] < losses[0], stdout
    assert "experts: 6 parameters on the expert mesh {'efsdp': 2, 'expert': 2}" in stdout  # the summary


@pytest.mark.dist
def test_the_optimizer_state_saved_with_experts_parallel_loads_without(tmp_path):
    """One AdamW step at expert 2, model and optimizer saved by DCP, loaded into plain FSDP:
    moments and parameters equal one process's after the same step (2 ranks)."""
    for r in run(dcp_optimizer, 2, str(tmp_path)):
        assert r["moments"] < 1e-4 * r["scale"] and r["params"] < TOL, r  # exp_avg: 0.1 x the gradient
        assert r["before"] > 1e-2 * r["scale"]  # the plain-FSDP optimizer's own state differed: the load did it
