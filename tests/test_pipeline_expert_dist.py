"""Expert parallelism inside pipeline stages (DeepSeek-V3's PP x EP) on real gloo ranks.

One 4-rank launch (tests/pipeline_expert_workers.py): the routed MoE tiny under pipeline 2 x
(shard 2, expert 2 borrowing it) trains 3 AdamW steps (fp32, 4 microbatches, uneven token splits)
under 1F1B, GPipe and Interleaved1F1B (two stages per rank, two of them without experts) with
losses, every gradient, the clipping norm and the final parameters equal to one unsharded process
(test_pipeline_dist's oracle); a DCP checkpoint of the stages loads under a 1-D plan and back;
built on meta, each stage materializes (its experts only) and trains a step; the code
`planc emit` prints trains as one process; examples/train.py trains the shipped tiny sibling.
"""

from __future__ import annotations

import pipeline_expert_workers as workers
import pytest
from distributed import run, train_example
from test_pipeline_dist import _equal_to_one_process

from planc.zoo import routed_moe_tiny


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run(workers.launch, 4, str(tmp_path_factory.mktemp("dcp")), timeout=400)


@pytest.mark.dist
@pytest.mark.parametrize("name", workers.SCHEDULES)
def test_pipeline_with_experts_trains_like_one_process(four, name):
    results = [r[name] for r in four]
    _equal_to_one_process(results)
    # every parameter, experts included, trains on the two ranks of its stage
    names = sorted(n for r in results for n in r["names"])
    assert names == sorted(2 * [n for n, _ in routed_moe_tiny().named_parameters()])


@pytest.mark.dist
def test_checkpoint_loads_under_a_one_dimensional_plan_and_back(four):
    for rank, r in enumerate(four):
        dcp = r["dcp"]
        assert dcp["to_dense"] == 0.0 and dcp["to_ep"] == 0.0, (rank, dcp)
        assert dcp["fresh"] > 1e-3, (rank, dcp)  # a model that loaded nothing differs: the comparison can fail
        assert any(".experts." in k for k in dcp["keys"]), rank


@pytest.mark.dist
def test_materialized_stages_hold_their_experts_and_train(four):
    names = sorted(n for r in four for n in r["materialized"]["names"])
    assert names == sorted(2 * [n for n, _ in routed_moe_tiny().named_parameters()])
    for rank, r in enumerate(four):
        m = r["materialized"]
        assert not m["meta"] and m["finite"] and m["others_meta"], (rank, m)
        assert m["experts"] == [(rank % 2, 2)], (rank, m)  # expert rank = shard rank inside the stage
        assert (m["loss"] is not None) == (rank >= 2) and (m["loss"] is None or m["loss"] > 0), (rank, m)


@pytest.mark.dist
def test_emitted_code_trains_like_one_process(four):
    """The code `planc emit` prints (`build_pipeline` builds the stage's expert view on every rank):
    the loss ranks' losses equal one process on the same batch."""
    held = [r["emitted"] for r in four if r["emitted"]]
    assert len(held) == 2, [len(r["emitted"]) for r in four]
    for losses in held:
        assert [v.item() for v in losses] == pytest.approx(four[0]["emitted_oracle"], rel=1e-5)


@pytest.mark.dist
def test_example_trains_the_tiny_sibling_under_torchrun():
    """examples/train.py with plans/qwen3-moe-pp-ep-tiny.plan (pipeline 2 x shard 2, expert 2, bf16)
    on 4 gloo ranks: `applied.step` and `applied.clip_grad_norm_` across the stage's meshes, the loss falls."""
    out, losses = train_example("--plan", "plans/qwen3-moe-pp-ep-tiny.plan", "--steps", "4", "--seq", "32")
    assert len(losses) == 4 and losses[-1] < losses[0], out
    assert "holds stage 0 of 2 (1F1B, 2 microbatches" in out, out
