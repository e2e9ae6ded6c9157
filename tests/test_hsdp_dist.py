"""HSDP on a 2x2 mesh (4 gloo ranks): placements, local shards, and parity with plain training.

`mesh (replicate = 2, shard = *)` on 4 ranks makes 2 replica groups of 2 shards. Each rank
trains on its own batch; the reference is one unsharded model trained on all 4 batches at
once, which is what data parallelism promises to reproduce (up to float32 rounding).
"""

from __future__ import annotations

import proof_workers
import pytest
import torch
from distributed import run
from torch.distributed.tensor import Replicate, Shard

STEPS = 2
WORLD = 4


@pytest.fixture(scope="module")
def ranks():
    return run(proof_workers.hsdp_worker, WORLD, STEPS)


@pytest.mark.dist
def test_placements_are_replicate_then_shard(ranks):
    for result in ranks:
        for name, shard in result["shards"].items():
            assert shard["mesh"] == (2, 2), name
            assert shard["placements"] == (Replicate(), Shard(0)), name


@pytest.mark.dist
def test_every_rank_has_its_own_mesh_coordinate(ranks):
    coordinates = {next(iter(r["shards"].values()))["coordinate"] for r in ranks}
    assert coordinates == {(0, 0), (0, 1), (1, 0), (1, 1)}


@pytest.mark.dist
def test_local_shard_shapes(ranks):
    """Dim 0 is split in two over the shard dimension, as `torch.chunk` splits it."""
    for result in ranks:
        for name, shard in result["shards"].items():
            full = shard["full_shape"]
            chunks = torch.empty(full[0]).chunk(2)
            index = shard["coordinate"][1]
            rows = chunks[index].numel() if index < len(chunks) else 0
            assert shard["local_shape"] == (rows, *full[1:]), name


@pytest.mark.dist
def test_replicas_hold_the_same_shards_and_shards_differ(ranks):
    by_coordinate = {next(iter(r["shards"].values()))["coordinate"]: r["shards"] for r in ranks}
    for name in by_coordinate[(0, 0)]:
        for shard_index in (0, 1):
            a = by_coordinate[(0, shard_index)][name]["local"]
            b = by_coordinate[(1, shard_index)][name]["local"]
            assert torch.equal(a, b), name  # replicas stay bitwise in sync after training
    weight = "transformer_layers.0.mlp.w_in.weight"
    assert not torch.equal(by_coordinate[(0, 0)][weight]["local"], by_coordinate[(0, 1)][weight]["local"])


@pytest.mark.dist
def test_losses_and_gradients_match_unsharded_training(ranks):
    """Same global loss and same reduced gradient at every step, to float32 rounding.

    Gradients rather than final weights: AdamW divides by the root of the squared gradient,
    so a gradient that is zero in exact arithmetic (the attention key bias: softmax ignores a
    shift) turns rounding noise into full-size updates, and weights would differ by ~lr there.
    """
    for result in ranks:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["reference_losses"]),
                                   rtol=1e-5, atol=1e-5)
        assert len(result["grads"]) == STEPS
        for step, (grads, reference) in enumerate(zip(result["grads"], result["reference_grads"])):
            assert grads.keys() == reference.keys()
            for name, value in reference.items():
                torch.testing.assert_close(grads[name], value, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"step {step}, {name}: {m}")
    # The steps changed something: losses moved between steps.
    assert ranks[0]["losses"][0] != ranks[0]["losses"][1]
