"""Context parallelism on real gloo ranks equals one unsharded process, through the plan.

Each rank holds a head-tail shard (2 of 2 x cp sequence chunks), gathers K/V over the context
axis, masks by global positions (planc/backends/context.py). The attention core is checked
against plain causal attention on the full sequence in one process (float64); the zoo Llama
is trained through `planc.apply` with a context plan and `applied.shard_batch` (no hand
wiring, the plain per-rank mean loss) against one unsharded process over 3 AdamW steps.
Two launches (2 and 4 ranks) run every case; each test reads its part.
"""

from __future__ import annotations

import context_workers
import pytest
import torch
from distributed import run, train_example

from planc.backends import context


def test_head_tail_positions_cover_the_sequence_once():
    parts = [context.shard_positions(16, 4, r) for r in range(4)]
    assert parts[0].tolist() == [0, 1, 14, 15]
    assert parts[3].tolist() == [6, 7, 8, 9]
    assert sorted(torch.cat(parts).tolist()) == list(range(16))


def test_sequence_must_divide_into_two_chunks_per_rank():
    with pytest.raises(ValueError, match="2 x context = 8"):
        context.shard_positions(12, 4, 0)


@pytest.fixture(scope="module")
def two():
    return run(context_workers.launch_two, 2)


@pytest.fixture(scope="module")
def four():
    return run(context_workers.launch_four, 4)


@pytest.fixture(scope="module")
def tensor():
    return run(context_workers.launch_tensor, 4)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_attention_and_grads_equal_one_process(world, request):
    for rank, result in enumerate(request.getfixturevalue({2: "two", 4: "four"}[world])):
        result = result["attention"]
        assert result["out"] < 1e-10, rank
        assert result["unsharded"] < 1e-10, rank
        assert max(result["grads"]) < 1e-10, (rank, result["grads"])
        assert result["grad_norm"] > 1e-3, rank  # the gradients checked are not all zero


@pytest.mark.dist
def test_grouped_query_attention_gathers_the_kv_heads_and_equals_one_process(two):
    """4 query heads over 2 KV heads: the style gathers the 2 KV heads (then repeats them locally) and
    reduce-scatters their gradients; output and dq/dk/dv equal the unsharded computation."""
    for rank, result in enumerate(two):
        result = result["gqa"]
        assert result["gathered_heads"] == [2, 2], rank  # K and V, n_kv_heads each: before the repeat
        assert result["out"] < 1e-10 and max(result["grads"]) < 1e-10, (rank, result)
        assert result["grad_norm"] > 1e-3, rank


@pytest.mark.dist
def test_fact_gloo_reduce_scatters_and_its_single_tensor_form_copies(two):
    """Why the runtime's gloo path reduce-scatters with the list form (`context.Collectives`): on this
    torch both forms sum right on gloo, but `reduce_scatter_single` does work of its own after the
    collective (a `copy_` into the output from a buffer of its own) where the list form does none."""
    for rank, result in enumerate(two):
        facts = result["reduce_scatter"]
        assert facts["single"]["error"] == 0 and facts["list"]["error"] == 0, rank
        assert facts["list"]["ops"] == ["c10d.reduce_scatter_.default"], rank
        assert facts["single"]["ops"][0] == "c10d._reduce_scatter_base_.default", rank
        assert "aten.copy_.default" in facts["single"]["ops"][1:], rank


@pytest.mark.dist
def test_fact_fsdp_on_the_2d_mesh_is_silently_hsdp(four):
    """torch accepts the 2-D (shard, context) mesh and replicates over its first axis (HSDP): each
    rank then holds half the weight, not a quarter. Only the flattened mesh shards over all 4,
    which is why the plan's FSDP ops name the flattened axis (`Mesh.flattened`)."""
    from torch.distributed.tensor import Replicate, Shard

    for result in four:
        assert result["fsdp_mesh"]["two_d"] == ((Replicate(), Shard(0)), (4, 8))
        assert result["fsdp_mesh"]["flat"] == ((Shard(0),), (2, 8))


def _trains_like_one_process(results, name, dp):
    for rank, result in enumerate(results):
        result = result[name]
        assert result["cp"] == pytest.approx(result["ref"], abs=1e-5), rank
        assert max(result["grad"]) < 1e-5, (rank, result["grad"])  # AdamW would hide a gradient scale error
        # NOTE: the weights after 3 AdamW steps differ by up to ~3e-5 although every gradient is
        # within 3e-7: where a gradient is itself ~1e-7, AdamW's m / sqrt(v) turns rounding into
        # an O(lr) step. The gradients (checked each step, after the previous updates) are the test.
        assert result["params"] < 1e-4, rank
        assert result["unshard"] < 1e-5, rank  # applied.unshard_sequence puts the logits back in order
        assert result["dp"][1] == dp, rank


@pytest.mark.dist
def test_llama_tiny_context_2_plan_trains_like_one_process(two):
    """2 ranks, `mesh (shard = *, context = 2)`: FSDP over the flattened 2 ranks, head-tail batches."""
    _trains_like_one_process(two, "context", 1)
    assert all(r["context"]["placements"] == "(Shard(dim=0),)" for r in two)
    assert all(r["context"]["mesh"] == (("shard_context",), (2,)) for r in two)


@pytest.mark.dist
def test_llama_tiny_context_with_checkpointing_trains_like_one_process(two):
    """`checkpoint layers.*` recomputes each block, attention included, in backward: the K/V
    gathers run again inside the recomputation and the result is the same."""
    _trains_like_one_process(two, "context + checkpoint", 1)


@pytest.mark.dist
def test_llama_tiny_context_with_accumulation_trains_like_one_process(two):
    """`step { accumulate 2, sync = last }`: `applied.accumulate` splits each rank's batch, `shard_batch`
    cuts each microbatch along the sequence; the step equals one process on the whole batch."""
    _trains_like_one_process(two, "context + accumulate", 1)


@pytest.mark.dist
def test_llama_tiny_shard_x_context_plan_trains_like_one_process(four):
    """4 ranks, (shard = 2, context = 2): FSDP shards over all 4 ranks (flattened), not HSDP."""
    _trains_like_one_process(four, "shard x context", 2)
    assert all(r["shard x context"]["placements"] == "(Shard(dim=0),)" for r in four)
    assert all(r["shard x context"]["mesh"] == (("shard_context",), (4,)) for r in four)


@pytest.mark.dist
def test_llama_tiny_replicate_x_context_plan_trains_like_one_process(four):
    """4 ranks, (replicate = 2, shard = 1, cp = 2): HSDP over replicate x the flattened shard x context."""
    _trains_like_one_process(four, "replicate x context", 2)
    assert all(r["replicate x context"]["placements"] == "(Replicate(), Shard(dim=0))" for r in four)
    assert all(r["replicate x context"]["mesh"] == (("replicate", "shard_cp"), (2, 2)) for r in four)


@pytest.mark.dist
@pytest.mark.parametrize("name", ["context x tensor", "context x sequence parallel"])
def test_llama_tiny_context_x_tensor_plan_trains_like_one_process(tensor, name):
    """4 ranks, (shard = 1, context = 2, tensor = 2): attention heads split over the tensor axis
    (colwise q/k/v, rowwise o: each rank gathers its own heads' K/V over the context axis),
    the sequence over the context axis, FSDP over the flattened shard x context; also with
    sequence parallelism (each rank holds 1 / tensor of its sequence shard between blocks)."""
    _trains_like_one_process(tensor, name, 1)
    assert all(r[name]["mesh"] == (("shard_context", "tensor"), (2, 2)) for r in tensor)
    # `planc explain` predicts the embedding's placements on the flattened axis and the tensor axis
    import planc
    from planc.analysis.explain import parameter_placements
    from planc.zoo import llama3
    with torch.device("meta"):
        compiled = planc.compile(planc.loads(context_workers.PLANS[name]), llama3.llama_tiny(), 4)
    predicted = parameter_placements(compiled, 4)["tok_embeddings.weight"]
    shown = {"Shard(0)": "Shard(dim=0)", "Replicate()": "Replicate()", "_StridedShard(0, sf=2)": "_StridedShard(dim=0, sf=2)"}
    assert all(r[name]["placements"] == "(" + ", ".join(shown[predicted[a]] for a in ("shard_context", "tensor")) + ")"
               for r in tensor), (predicted, tensor[0][name]["placements"])


@pytest.mark.dist
def test_llama_tiny_emitted_code_trains_like_one_process(four):
    """The code `planc emit` prints (`apply_plan`, `shard_batch`) for the shard x context and the
    replicate x context plans trains the same, on the same meshes as `planc.apply`."""
    _trains_like_one_process(four, "emitted shard x context", 2)
    assert all(r["emitted shard x context"]["mesh"] == (("shard_context",), (4,)) for r in four)
    _trains_like_one_process(four, "emitted replicate x context", 2)
    assert all(r["emitted replicate x context"]["mesh"] == (("replicate", "shard_cp"), (2, 2)) for r in four)


@pytest.mark.dist
@pytest.mark.parametrize("plan,model,mesh", [
    ("plans/zoo-llama-context.plan", ["--model", "planc.zoo:llama_tiny"], "'shard': 2, 'context': 2"),
    ("plans/llama3-8b-long-context-tiny.plan", [], "'context': 2, 'tensor': 2"),
])
def test_example_trains_the_shipped_context_plans_under_torchrun(plan, model, mesh):
    """examples/train.py with a shipped context plan on 4 gloo ranks: shard 2 x context 2, and the
    long-context plan's tiny sibling (context 2 x tensor 2, sequence and loss parallel, bf16):
    `applied.shard_batch` in the loop, the loss falls."""
    stdout, losses = train_example("--plan", plan, *model, "--steps", "4", "--seq", "64")
    assert len(losses) == 4 and losses[-1] < losses[0], stdout
    assert mesh in stdout and "applied.shard_batch" in stdout  # the summary


@pytest.mark.dist
def test_dcp_saved_under_context_loads_without_it(tmp_path):
    """A DCP checkpoint saved under shard x context (FSDP over the flattened 4 ranks) loads into a
    fresh model and optimizer under a plan without the context axis: every entry bit for bit."""
    from test_checkpoint_dist import assert_identical

    results = run(context_workers.dcp_case, 4, str(tmp_path / "ckpt"))
    result = results[0]
    assert result["mesh"] != ("shard_context",)  # really another sharding
    assert_identical(result["loaded"]["model"], result["saved"]["model"], "model")
    assert_identical(result["loaded"]["optim"]["state"], result["saved"]["optim"]["state"], "optim/state")
    assert any(not torch.equal(result["before"]["model"][k], v) for k, v in result["saved"]["model"].items())
