"""Pipeline jobs trained through `planc.apply` on real gloo ranks equal one unsharded process.

Two launches (tests/pipeline_workers.py): 2 ranks run each of torch's seven schedules on the
zoo Llama tiny (fp32, 3 AdamW steps, 4 microbatches; GPipe and 1F1B one stage per rank, the
others two, loop or V placement), and three of them again as hand-written torchtitan-style
code (deep copy per stage, the rest deleted, `PipelineStage` + the schedule class); 4 ranks
run PP x FSDP (2 x 2) under 1F1B, Interleaved1F1B and ZBVZeroBubble and PP x TP (2 x 2,
sequence parallel) under 1F1B. The oracle is one process over the same global batch, with
the same microbatches and loss reduction (the mean of the microbatches' mean losses, FSDP's
average over the data-parallel ranks).
"""

from __future__ import annotations

import pipeline_workers as workers
import pytest
import torch
from distributed import run, train_example

from planc.lower.schedules import SCHEDULES

TOL = 1e-5  # relative: |a - b| / |b| for a loss, ||a - b|| / ||b|| for a gradient or parameter tensor


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run(workers.launch_two, 2, str(tmp_path_factory.mktemp("dcp")), timeout=400)


@pytest.fixture(scope="module")
def four():
    return run(workers.launch_four, 4, timeout=400)


def _equal_to_one_process(results, *, later_steps: float = TOL):
    """Each rank's results of one run: the loss on the rank holding the last stage only, equal to
    the oracle; every gradient of its stages (each step) and every parameter after 3 steps."""
    held = {s for r in results for s in r["stages"]}
    assert held == set(range(len(held))) and len(held) in (2, 4)
    for rank, r in enumerate(results):
        assert r["holds_loss"] == bool(r["losses"]), rank
        for got, want in r["losses"]:
            assert got == pytest.approx(want, rel=TOL), rank
        assert r["grad_err"][0] < TOL, (rank, r["grad_err"], r["worst"])
        assert max(r["grad_err"]) < later_steps, (rank, r["grad_err"], r["worst"])
        assert r["param_err"] < later_steps, (rank, r["param_err"])
        # `clip_grad_norm_`'s total norm (over the pipeline, data-parallel and tensor axes) is the
        # one process's: the whole model's gradients; with dp > 1 the oracle's is the mean gradient's
        (norm, want), *later = r["norms"]
        assert norm == pytest.approx(want, rel=TOL), (rank, r["norms"])
        assert all(n == pytest.approx(w, rel=later_steps) for n, w in later), (rank, r["norms"])
    assert sum(len(r["losses"]) for r in results) == len(results) // 2 * workers.STEPS  # one loss rank per dp rank


@pytest.mark.dist
@pytest.mark.parametrize("name", SCHEDULES)
def test_each_schedule_trains_like_one_process(two, name):
    results = [r[name] for r in two]
    _equal_to_one_process(results)
    # every parameter of the model trains on exactly one pipeline rank
    names = [n for r in results for n in r["names"]]
    assert sorted(names) == sorted(n for n, _ in workers.llama_tiny().named_parameters())
    # each rank holds the bytes of its own stages' parameters only (fp32, no data-parallel sharding)
    assert sum(r["bytes"] for r in results) == 4 * sum(p.numel() for p in workers.llama_tiny().parameters())
    loss_rank = 0 if name in ("ZBVZeroBubble", "DualPipeV") else 1  # V placement: rank 0 holds the last stage
    assert [r["holds_loss"] for r in results] == [rank == loss_rank for rank in range(2)]
    assert all(r["loss_rank"] == loss_rank for r in results)


@pytest.mark.dist
@pytest.mark.parametrize("code", ["handwritten", "emitted"])
@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B", "DualPipeV"])
def test_same_as_handwritten_torchtitan_style_code_and_emitted_code(two, name, code):
    """Same split, same schedule, no planc (hand-written: deep copy per stage, the rest replaced
    by `nn.Identity`), or the code `planc emit` prints, run: identical parameters per stage,
    bitwise equal losses."""
    for rank, r in enumerate(two):
        planc_run, hand = r[name], r[(code, name)]
        assert [got for got, _ in planc_run["losses"]] == [v.item() for v in hand["losses"]], rank
        assert planc_run["names"] == sorted(hand["params"]), rank
        for n, p in hand["params"].items():
            assert torch.equal(planc_run["params"][n], p), (rank, n)


@pytest.mark.dist
@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_pp_x_fsdp_trains_like_one_process(four, name):
    _equal_to_one_process([r[("fsdp", name)] for r in four])


@pytest.mark.dist
@pytest.mark.parametrize("case", ["1F1B", "loss_parallel"])
def test_pp_x_tp_trains_like_one_process(four, case):
    # NOTE: the first step's gradients are within 4.2e-7; after AdamW steps the parameters differ
    # by rounding that AdamW's m / sqrt(v) turns into an O(lr) step where a gradient is tiny,
    # and the later gradients (at those parameters) by up to 2.2e-5 (the same effect as in
    # tests/test_context_dist.py). The losses stay bitwise equal.
    # `loss_parallel`: the last stage's logits stay sharded on the vocabulary, the schedule runs
    # inside `loss_parallel()` (torchtitan's 405B recipe, plans/llama3-405b-pp.plan)
    _equal_to_one_process([r[("tp", case)] for r in four], later_steps=1e-4)


@pytest.mark.dist
def test_meta_build_materializes_each_stage_and_checkpoints_across_plans(two):
    """Built on meta and applied, `planc.materialize(applied, device)` allocates and initialises this rank's
    stages only; a DCP checkpoint saved under the pipeline loads under a 1-D FSDP plan, and one
    saved under the 1-D plan loads back under the pipeline: every parameter equal bit for bit."""
    results = [r["meta_and_checkpoint"] for r in two]
    for rank, r in enumerate(results):
        assert not r["stage_meta"] and r["finite"], rank
        assert r["others_meta"] == [], (rank, r["others_meta"])  # the other rank's stages: not allocated here
        assert r["pp_to_1d"] and r["1d_to_pp"] and r["changed"], (rank, r)
    assert results[0]["loss"] is None and results[1]["loss"] > 0  # 1F1B: the last rank holds the loss
    assert results[0]["summary"].startswith("planc: pipeline rank 0 of 2 holds stage 0 of 2 (1F1B, 4 microbatches, "
                                            "scale_grads=True); the loss is on pipeline rank 1\n"), results[0]["summary"]


@pytest.mark.dist
def test_a_hugging_face_llama_trains_like_one_process(two):
    """`LlamaForCausalLM` cut by pass-throughs (its forward loops over `self.layers[:n]` and builds
    the mask from the hidden state), 1F1B on 2 ranks, equal to one process."""
    results = [r["hf"] for r in two]
    _equal_to_one_process(results)
    assert [r["holds_loss"] for r in results] == [False, True]


@pytest.mark.dist
def test_checkpointing_under_a_pipeline_trains_like_one_process(two):
    """Each stage's program runs on it: `checkpoint layers.* full` under Interleaved1F1B."""
    _equal_to_one_process([r["checkpoint"] for r in two])


@pytest.mark.dist
def test_step_without_a_pipeline_is_the_same_loop(two):
    """`applied.step(inputs, targets, loss_fn)` also runs a plan without a pipeline (its
    `step { accumulate 4 }` microbatches): every rank holds the loss, equal to one process."""
    for rank, r in enumerate(two):
        r = r["without_pipeline"]
        assert r["holds_loss"] and len(r["losses"]) == workers.STEPS, rank
        for got, want in r["losses"]:
            assert got == pytest.approx(want, rel=TOL), rank
        assert r["grad_err"] < TOL, rank


@pytest.mark.dist
def test_example_trains_the_shipped_pipeline_plan_under_torchrun():
    """examples/train.py with plans/zoo-llama-pp.plan (4 stages, 1F1B, 8 microbatches, FSDP and
    checkpointing per stage) on 4 gloo ranks: `applied.step` in the loop, the loss falls."""
    stdout, losses = train_example("--plan", "plans/zoo-llama-pp.plan", "--model", "planc.zoo:llama_tiny", "--steps", "4")
    assert len(losses) == 4 and losses[-1] < losses[0], stdout
    assert "holds stage 0 of 4 (1F1B, 8 microbatches" in stdout and "'pipeline': 4" in stdout
