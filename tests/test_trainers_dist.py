"""Plans inside training frameworks, on 2 real gloo ranks with real optimizer steps.

* Hugging Face `Trainer` (+ accelerate): hf:llama-tiny sharded by plans/llama.plan (fp32)
  with `planc.integrations.hf.shard_for_trainer`, trained 3 steps by the Trainer itself,
  without and with gradient accumulation: the logged losses and gradient norms equal the
  same Trainer run unsharded in one process on the same global batches, the model is not
  wrapped again (no DDP), and every parameter is a DTensor placed as the plan says.
* Lightning (`lightning` 2.x) `ModelParallelStrategy` on gloo/CPU, the plan applied in
  `configure_model` on Lightning's device mesh (planc.integrations.lightning): 3 AdamW steps
  whose losses, averaged over the ranks, are the unsharded Lightning run's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from distributed import run  # noqa: E402
from trainer_workers import hf_trainer_both, hf_trainer_run, lightning_run  # noqa: E402

pytestmark = pytest.mark.dist

WORLD = 2
REL = 1e-5


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= REL * abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def sharded():
    return run(hf_trainer_both, WORLD)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_trainer_matches_unsharded(sharded, accumulate):
    reference = hf_trainer_run(0, 1, accumulate)
    assert len(reference["losses"]) == 3
    for rank, result in enumerate(sharded):
        got = result[accumulate]
        assert close(got["losses"], reference["losses"]), (rank, got["losses"], reference["losses"])
        assert close(got["grad_norms"], reference["grad_norms"]), (rank, got["grad_norms"], reference["grad_norms"])
    assert reference["losses"][-1] < reference["losses"][0]  # it trains


def test_trainer_keeps_the_plans_sharding(sharded):
    got = sharded[0][1]
    # the Trainer trained the FSDP module planc made, not a DDP wrapper around it
    assert got["wrapped"].startswith("FSDP") and "DistributedDataParallel" not in got["wrapped"]
    # the modules FSDP manages after training are exactly the plan's units (root is "")
    assert got["fsdp"] == got["units"] == ["", "lm_head", "model.embed_tokens", "model.layers.0",
                                           "model.layers.1", "model.norm"]
    # plans/llama.plan places nothing explicitly: every parameter Shard(0) on the `shard` mesh
    assert got["placements"] and all(p == (("shard",), ("S(0)",)) for p in got["placements"].values())


@pytest.fixture(scope="module")
def lightning_sharded():
    pytest.importorskip("lightning")
    return run(lightning_run, WORLD)


def test_lightning_model_parallel_matches_unsharded(lightning_sharded):
    """Lightning's `ModelParallelStrategy` (gloo, CPU) with the plan applied in `configure_model`:
    the mean of the ranks' losses is the unsharded run's loss at every step, on the same tokens."""
    reference = lightning_run(0, 1)
    ranks = lightning_sharded
    for step in range(3):
        assert sorted(ranks[0]["seen"][step] + ranks[1]["seen"][step]) == sorted(reference["seen"][step])
    mean = [sum(r["losses"][i] for r in ranks) / WORLD for i in range(3)]
    assert close(mean, reference["losses"]), (mean, reference["losses"])
    got = ranks[0]
    assert got["fsdp"] == got["units"] == ["", "lm_head", "model.embed_tokens", "model.layers.0",
                                           "model.layers.1", "model.norm"]
    # sharded on Lightning's own mesh: its `data_parallel` dimension, Shard(0) as the plan says
    assert all(p == (("data_parallel",), ("S(0)",)) for p in got["placements"].values())
