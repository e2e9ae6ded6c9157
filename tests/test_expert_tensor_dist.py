"""Expert x tensor parallelism on 4 real gloo ranks (shard 2 x tensor 2, expert 2: the expert axis
borrows the tensor ranks, efsdp 2): the zoo's `moe_llama_tiny` (Llama attention, routed MoE,
4 experts top-2), attention tensor-parallel, the experts expert-parallel, fp32, 3 clipped AdamW
steps against one unsharded process.

- Sequence parallel (plans/zoo-llama-tp.plan's rules, loss parallel): each MoE layer runs on its
  rank's sequence shard; through `planc.apply` and through the code `planc emit` prints.
- Replicated residual (no sequence parallelism): each MoE layer cuts the tensor group's tokens
  in two, runs its half, gathers the outputs.
- The fact behind the split (torch accepts it): every rank of a tensor group dispatching the same
  replicated tokens computes the right loss but expert gradients twice too large.
- DCP: a checkpoint saved under expert x tensor loads into 1-D FSDP and back, states equal.
- A meta model sharded then materialised (`reproducible=True`) trains the same.
- The shipped plan's tiny sibling (plans/qwen3-moe-ep-tp-tiny.plan): the memory estimate against
  FSDPMemTracker (and the replicated residual's), the time model's all-to-alls and router all-reduce
  against a recorded step, and examples/train.py under torchrun.

Loss and every gradient within 1e-5; the parameters after 3 AdamW steps within 1e-4 (Adam divides
by the root of the second moment: on expert weights with gradients near its eps, 1e-8 gradient
differences move the update by about 3e-5 at lr 1e-2). Under the gloo lock.
"""

from __future__ import annotations

import pathlib

import pytest
from distributed import lowest_phase, run, train_example
from expert_tensor_workers import train_all

TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(train_all, 4, str(tmp_path_factory.mktemp("eptp")))


@pytest.mark.dist
def test_expert_by_tensor_trains_like_one_process(results):
    for ranks in results:
        for r in ranks[:3]:  # sequence parallel (apply, emitted), replicated residual
            assert r["loss"] < TOL and r["grad"] < TOL and r["param"] < 1e-4, r
            assert r["grads"] == 23  # every parameter compared


@pytest.mark.dist
def test_replicated_tokens_dispatched_twice_train_wrong(results):
    for ranks in results:
        twice = ranks[3]
        assert twice["loss"] < TOL  # the forward is right ...
        assert twice["grad"] > 1e-3  # ... the gradients are not


@pytest.mark.dist
def test_dcp_checkpoint_under_expert_by_tensor_loads_one_d_and_back(results):
    """Saved under expert x tensor, loaded into plain FSDP and saved, loaded back: states equal
    (a fresh model of another seed really differs)."""
    for ranks in results:
        trip = ranks[4]
        assert trip["to_dense"] == 0 and trip["to_ep"] == 0 and trip["fresh"] > 0, trip


ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ROOT / "plans" / "qwen3-moe-ep-tp-tiny.plan"


def _rules(path: pathlib.Path) -> list[str]:
    return [line for line in path.read_text().splitlines()
            if line.strip() and not line.startswith(("#", "model ", "mesh ", "expect "))]


def test_the_shipped_plan_and_its_tiny_sibling_have_the_same_rules():
    big = _rules(ROOT / "plans" / "qwen3-moe-ep-tp.plan")
    assert big == _rules(TINY) and "parallel layers.*.moe.experts expert" in big


@pytest.mark.dist
def test_memory_estimate_equals_the_tracker_under_expert_by_tensor(monkeypatch):
    """The tiny plan at 4 ranks (shard 2 x tensor 2, expert 2 x efsdp 2, sequence parallel, bf16),
    balanced routing in both: the estimate's peak equals FSDPMemTracker's byte for byte (793,876 B, the
    all-gather of layers.0 in the backward of layers.1), its state (sharded parameters, gradients, AdamW
    moments) too, and the forward's highest moment (684,092 B, layers.1's experts).

    Each unit is two FSDP parameter groups (dense 13,056 B, expert 49,152 B gathered in bf16), each
    all-gathered into its own buffer and copied out one after the other, the forward keeping one
    result for all groups (`memory.Gather`). Counted as one buffer of the whole unit, the estimate was
    13,056 B over at both (806,932 and 697,148): the dense group's all-gather output, freed before the
    expert group's copy-out."""
    import expert_memory_workers
    import torch
    from expert_tensor_workers import measure

    import planc
    from planc import zoo
    from planc.estimate import memory
    from planc.zoo import routed

    text = TINY.read_text()
    real = run(measure, 4, text)
    monkeypatch.setattr(routed.Router, "forward", expert_memory_workers.balanced_route)
    with torch.device("meta"):
        model = zoo.moe_llama_tiny()
    est = memory.estimate(planc.compile(planc.loads(text), model, 4), 4, input_shape=expert_memory_workers.SHAPE)
    assert "tensor-parallel" in est.source and "expert ranks" in est.source
    assert [len(u.groups) for u in est.units if u.name.startswith("layers.")] == [2, 2]
    forward = max(m.total for m in est.timeline if m.phase == "forward")
    for rank in real:
        for key in ("sharded_params", "sharded_grads", "optimizer_state"):
            assert est.peak.bytes[key] == rank["breakdown"][key], (key, est.peak.bytes[key], rank["breakdown"][key])
        assert est.peak.total == rank["peak"], (est.peak.label, est.peak.total, rank["moment"], rank["peak"])
        assert forward == lowest_phase(rank, "forward")


@pytest.mark.dist
def test_memory_estimate_of_the_replicated_form_equals_the_tracker(monkeypatch):
    """The replicated residual (no sequence parallelism, fp32) at 4 ranks, balanced routing: each MoE
    layer cuts the tensor group's tokens in two and gathers the outputs (`TakeRows`, `GatherRows`);
    the estimate traces that cut and gather on one rank: its peak equals FSDPMemTracker's (1,104,500 B,
    the backward of layers.1's experts; dispatching the whole group's tokens, it was 1,189,892)."""
    import expert_memory_workers
    import torch
    from expert_tensor_workers import REPLICATED_PLAN, measure

    import planc
    from planc import zoo
    from planc.estimate import memory
    from planc.zoo import routed

    real = run(measure, 4, REPLICATED_PLAN)
    monkeypatch.setattr(routed.Router, "forward", expert_memory_workers.balanced_route)
    with torch.device("meta"):
        model = zoo.moe_llama_tiny()
    est = memory.estimate(planc.compile(planc.loads(REPLICATED_PLAN), model, 4), 4,
                          input_shape=expert_memory_workers.SHAPE)
    for rank in real:
        assert est.peak.total == rank["peak"], (est.peak.label, est.peak.total, rank["moment"], rank["peak"])


@pytest.mark.dist
def test_example_trains_the_tiny_sibling_under_torchrun():
    """examples/train.py with plans/qwen3-moe-ep-tp-tiny.plan on 4 gloo ranks (bf16, loss parallel,
    `applied.clip_grad_norm_` across the meshes): the loss falls."""
    stdout, losses = train_example("--plan", str(TINY), "--steps", "4", "--seq", "32")
    assert len(losses) == 4 and losses[-1] < losses[0], stdout


@pytest.mark.dist
def test_time_model_collectives_equal_a_recorded_step():
    """One forward and backward of the tiny plan on 4 real gloo ranks (a fake group cannot fill the
    dispatch's split sizes), balanced routing: the all-to-alls per MoE layer (tokens / tensor x top_k
    x dim bf16 each: the layer runs on its sequence shard) and the router's gradient all-reduce over
    the tensor axis are those `collectives.expert_all_to_alls` predicts."""
    from collections import Counter

    import expert_memory_workers
    import torch
    from expert_tensor_workers import record

    import planc
    from planc import zoo
    from planc.estimate import collectives

    text = TINY.read_text()
    recorded = run(record, 4, text)
    with torch.device("meta"):
        model = zoo.moe_llama_tiny()
    compiled = planc.compile(planc.loads(text), model, 4)
    tokens = expert_memory_workers.SHAPE[0] * expert_memory_workers.SHAPE[1]
    per_layer = collectives.expert_all_to_alls(compiled.program, compiled.graph, 4, tokens)
    want = Counter((c.kind, c.bytes, c.ranks, c.phase) for cs in per_layer.values() for c in cs)
    assert want[("all_to_all", tokens // 2 * 2 * 64 * 2, 2, "forward")] == 4  # 2 layers x dispatch and combine
    assert want[("all_reduce", 4 * 64 * 2, 2, "backward")] == 2  # each layer's router gate, bf16
    for found in recorded:
        a2a = Counter((k, b, r, p) for k, u, b, r, p in found if k == "all_to_all")
        assert a2a == Counter({k: v for k, v in want.items() if k[0] == "all_to_all"})
        routers = sum(1 for k, u, b, r, p in found if (k, b, r, p) == ("all_reduce", 512, 2, "backward"))
        assert routers >= 2, found


@pytest.mark.dist
def test_materialized_meta_model_trains_like_one_process():
    """Built on meta, sharded under expert x tensor, `planc.materialize(reproducible=True)`: the one-process
    initial values (every expert initialised, each rank keeps its own), then equal training."""
    from expert_tensor_workers import train_meta

    for r in run(train_meta, 4):
        assert r["loss"] < TOL and r["grad"] < TOL and r["param"] < 1e-4, r
