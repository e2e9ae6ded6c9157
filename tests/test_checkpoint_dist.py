"""DCP checkpoints lose nothing across plans: save under one plan, load under another.

One AdamW step under plans/torchtitan.plan on 2 gloo ranks, saved with
`torch.distributed.checkpoint` from `get_state_dict`; then loaded with `set_state_dict` into
fresh, differently seeded models under plan B (other units, fp32 instead of bf16 compute,
one weight sharded on dim 1) on 2 ranks and on 1 rank, and finally read back with no process
group at all. Every model and optimizer entry must come back bit for bit, and a fresh model
resumed from the checkpoint takes the next step exactly as the uninterrupted one does.
"""

from __future__ import annotations

import proof_workers
import pytest
import torch
from distributed import run
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import Shard


def assert_identical(actual, expected, where: str = "") -> None:
    """Nested dicts/lists of tensors and plain values, equal bit for bit (dtype included)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            assert_identical(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for k, (a, e) in enumerate(zip(actual, expected)):
            assert_identical(a, e, f"{where}[{k}]")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), where
    else:
        assert actual == expected, where


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Path of the checkpoint and rank 0's result of saving under A and loading under B."""
    path = str(tmp_path_factory.mktemp("dcp") / "step1")
    return path, run(proof_workers.checkpoint_save_load_worker, 2, path)[0]


@pytest.mark.dist
def test_saved_state_is_complete(checkpoint):
    _, result = checkpoint
    saved = result["saved"]
    model_keys = set(saved["model"])
    assert "transformer_layers.1.mlp.w_out.weight" in model_keys and "output.weight" in model_keys
    # AdamW state for every parameter after one step.
    assert set(saved["optim"]["state"]) == model_keys
    for state in saved["optim"]["state"].values():
        assert float(state["step"]) == 1.0 and state["exp_avg"].abs().sum() > 0


@pytest.mark.dist
def test_plan_b_really_is_another_sharding(checkpoint):
    _, result = checkpoint
    assert result["units_a"] != result["units_b"]
    assert ("transformer_layers.0.mlp",) in result["units_b"]
    assert result["placements_b"]["transformer_layers.0.mlp.w_out.weight"] == (Shard(1),)
    assert result["placements_b"]["transformer_layers.0.mlp.w_in.weight"] == (Shard(0),)


@pytest.mark.dist
def test_two_ranks_plan_b_loads_everything(checkpoint):
    _, result = checkpoint
    assert_identical(result["loaded"]["model"], result["saved"]["model"], "model")
    assert_identical(result["loaded"]["optim"], result["saved"]["optim"], "optim")


@pytest.mark.dist
def test_resuming_continues_exactly(checkpoint):
    """Loaded into a fresh model, the second step is bit for bit the uninterrupted one."""
    _, result = checkpoint
    assert len(result["resumed_losses"]) == 1
    assert result["resumed_losses"] == result["uninterrupted_losses"]
    assert_identical(result["resumed_params"], result["uninterrupted_params"], "params")
    # The second step moved the weights away from the checkpoint.
    name = "transformer_layers.0.mlp.w_in.weight"
    assert not torch.equal(result["resumed_params"][name], result["saved"]["model"][name])


@pytest.mark.dist
def test_one_rank_plan_b_loads_everything(checkpoint):
    path, result = checkpoint
    loaded = run(proof_workers.checkpoint_load_worker, 1, path)[0]["loaded"]
    assert_identical(loaded["model"], result["saved"]["model"], "model")
    assert_identical(loaded["optim"], result["saved"]["optim"], "optim")


@pytest.mark.dist
def test_unsharded_load_without_a_process_group(checkpoint, tmp_path):
    """DCP's own converter reads the sharded checkpoint into one plain state dict."""
    path, result = checkpoint
    plain = tmp_path / "full.pt"
    dcp_to_torch_save(path, plain)
    full = torch.load(plain, weights_only=False)
    assert_identical(full["model"], result["saved"]["model"], "model")
    assert_identical(full["optim"]["state"], result["saved"]["optim"]["state"], "optim/state")

    # And a plain nn.Module takes the model part as it is.
    from planc import zoo
    model = zoo.seed_transformer_tiny()
    model.load_state_dict(full["model"])
    assert_identical(model.state_dict(), result["saved"]["model"], "nn.Module")
