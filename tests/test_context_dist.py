"""Context-parallel attention on real gloo ranks equals one unsharded process (planc/backends/context.py).

Each rank holds a head-tail shard (2 of 2 x cp sequence chunks), gathers K/V over the context
axis, masks by global positions; the oracle is plain causal attention on the full sequence in
one process (float64, so any mismatch is a real one, not rounding).
"""

from __future__ import annotations

import context_workers
import pytest
import torch
from distributed import run

from planc.backends import context


def test_head_tail_positions_cover_the_sequence_once():
    parts = [context.shard_positions(16, 4, r) for r in range(4)]
    assert parts[0].tolist() == [0, 1, 14, 15]
    assert parts[3].tolist() == [6, 7, 8, 9]
    assert sorted(torch.cat(parts).tolist()) == list(range(16))


def test_sequence_must_divide_into_two_chunks_per_rank():
    with pytest.raises(ValueError, match="2 x context = 8"):
        context.shard_positions(12, 4, 0)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_attention_and_grads_equal_one_process(world):
    for rank, result in enumerate(run(context_workers.attention_worker, world, 16)):
        assert result["out"] < 1e-10, rank
        assert result["unsharded"] < 1e-10, rank
        assert max(result["grads"]) < 1e-10, (rank, result["grads"])
        assert result["grad_norm"] > 1e-3, rank  # the gradients checked are not all zero


@pytest.mark.dist
def test_fact_fsdp_on_the_2d_mesh_is_silently_hsdp():
    """torch accepts the 2-D (shard, context) mesh and replicates over its first axis (HSDP): each
    rank then holds half the weight, not a quarter. Only the flattened mesh shards over all 4."""
    from torch.distributed.tensor import Replicate, Shard

    for result in run(context_workers.fsdp_mesh_worker, 4):
        assert result["two_d"] == ((Replicate(), Shard(0)), (4, 8))
        assert result["flat"] == ((Shard(0),), (2, 8))


@pytest.mark.dist
def test_llama_tiny_context_2_trains_like_one_process():
    """2 ranks, context=2, head-tail: losses and gradients equal one process over 3 AdamW steps."""
    for rank, result in enumerate(run(context_workers.llama_worker, 2, 3)):
        assert result["cp"] == pytest.approx(result["ref"], abs=1e-5), rank
        assert max(result["grad"]) < 1e-5, (rank, result["grad"])


@pytest.mark.dist
def test_llama_tiny_context_x_fsdp_trains_like_one_process():
    """4 ranks, (shard=2, context=2), FSDP over the flattened axes: losses and weights after 3 AdamW steps equal one process."""
    for rank, result in enumerate(run(context_workers.llama_fsdp_worker, 4, 3)):
        assert result["cp"] == pytest.approx(result["ref"], abs=1e-5), rank
        assert result["params"] < 1e-5, rank
        assert max(result["grad"]) < 1e-5, (rank, result["grad"])  # AdamW would hide a gradient scale error
