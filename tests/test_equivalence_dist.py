"""plans/torchtitan.plan against torchtitan's `apply_fsdp` written by hand: same units, same losses.

The hand-written side is `proof_workers.torchtitan_fsdp` (the `fully_shard` calls torchtitan
makes). Both models start from one seed, see the same per-rank data and take the same AdamW
steps on 2 gloo ranks; the structure FSDP2 actually built is read back from its own state.
"""

from __future__ import annotations

import proof_workers
import pytest
import torch
from distributed import run

import planc
from planc import zoo

STEPS = 3


def test_torchtitan_plan_resolves_to_the_recipe():
    """At full size on meta: embedding, every block, [norm, output], root; bf16/fp32, no cast."""
    with torch.device("meta"):
        model = zoo.seed_transformer()
    compiled = planc.compile(proof_workers.TORCHTITAN_PLAN, model, world_size=8)
    blocks = [(f"transformer_layers.{i}",) for i in range(model.config.n_layers)]
    assert [u.modules for u in compiled.units] == [("embedding",), *blocks, ("norm", "output"), ("",)]
    for unit in compiled.units:
        assert (unit["param_dtype"], unit["reduce_dtype"], unit["cast_inputs"]) == \
            (torch.bfloat16, torch.float32, False)
        # torchtitan: blocks and embedding reshard; [norm, output] and the root do not.
        assert compiled.program.unit(unit.name).policy.reshard_after_forward is (unit.modules not in (("norm", "output"), ("",)))


@pytest.fixture(scope="module")
def ranks():
    return run(proof_workers.equivalence_worker, 2, STEPS)


@pytest.mark.dist
def test_same_units_as_hand_written(ranks):
    for result in ranks:
        assert result["planned_fsdp_modules"] == result["by_hand_fsdp_modules"] == [
            "", "embedding", "transformer_layers.0", "transformer_layers.1", "norm", "output"]
        planned, by_hand = result["planned_units"], result["by_hand_units"]
        assert set(planned) == set(by_hand) == {
            ("",), ("embedding",), ("transformer_layers.0",), ("transformer_layers.1",), ("norm", "output")}
        for key in by_hand:
            # params managed, MixedPrecisionPolicy fields, effective reshard, offload, mesh shape
            # and every parameter's placement.
            assert planned[key] == by_hand[key], key
        assert by_hand[("norm", "output")]["reshard_after_forward"] is False
        assert by_hand[("embedding",)]["mp"] == (torch.bfloat16, torch.float32, None, False)
        # Every parameter is managed by exactly one unit.
        managed = [p for unit in planned.values() for p in unit["params"]]
        assert sorted(managed) == sorted(result["planned_params"])


@pytest.mark.dist
def test_bitwise_identical_losses_and_parameters(ranks):
    for result in ranks:
        assert len(result["planned_losses"]) == STEPS
        assert result["planned_losses"] == result["by_hand_losses"]  # exact float equality
        for name, value in result["by_hand_params"].items():
            assert torch.equal(result["planned_params"][name], value), name
    # The ranks saw different data: equal losses above are not a coincidence of inputs.
    assert ranks[0]["planned_losses"] != ranks[1]["planned_losses"]
    # Training moved the weights identically on both ranks (FSDP kept them in sync).
    for name, value in ranks[0]["planned_params"].items():
        assert torch.equal(ranks[1]["planned_params"][name], value), name


@pytest.mark.dist
def test_precision_matters_to_the_losses(ranks):
    """Control: the same recipe in fp32 gives other losses, so bitwise equality has teeth."""
    for result in ranks:
        assert result["fp32_losses"] != result["by_hand_losses"]
