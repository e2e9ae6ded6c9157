"""Tensor parallelism on a 2-D mesh in real processes: 4 gloo ranks, 2 data-parallel x 2 tensor-parallel.

Hugging Face Llama tiny (4 query heads, 2 KV heads) trains 3 AdamW steps under a 2-D plan
(TP on attention and MLP, the embedding rowwise, the norms replicated on the tensor axis,
FSDP on the data-parallel axis); its losses equal one unsharded process within 1e-5
relative, and every parameter reads back as a 2-D DTensor with the placements the plan
asks for. The same in each launch: the code `planc emit` prints (identical placements,
bitwise-equal losses), and the plan with loss parallel (logits sharded on the vocabulary,
the loss inside `applied.loss_parallel()`). One launch; all checks read its results.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from distributed import run  # noqa: E402
from training import batches  # noqa: E402

pytestmark = pytest.mark.dist

PLAN = """
model hf:llama-tiny
mesh (shard = *, tensor = 2)

unit model.layers.*
root {}

parallel model.embed_tokens rowwise { input replicate; output replicate }
parallel model.layers.*.self_attn.{q_proj, k_proj, v_proj} colwise
parallel model.layers.*.self_attn.o_proj rowwise
parallel model.layers.*.mlp.{gate_proj, up_proj} colwise
parallel model.layers.*.mlp.down_proj rowwise
parallel lm_head colwise { output replicate }
parallel **.{input_layernorm, post_attention_layernorm} replicate
parallel model.norm replicate
"""


# The same plan with the logits left sharded on the vocabulary: the loss is computed on them
# inside `applied.loss_parallel()` (torch's `loss_parallel()`), as torchtitan's training loop does.
LOSS_PARALLEL_PLAN = PLAN.replace("parallel lm_head colwise { output replicate }", "parallel lm_head colwise { loss_parallel }")
assert LOSS_PARALLEL_PLAN != PLAN


def logits_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy from the logits (what the model's own `loss` computes)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(0, 1))


def build() -> torch.nn.Module:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from planc.model.hf import build_hf_model

    torch.manual_seed(0)
    return build_hf_model("llama-tiny", device="cpu")


def steps(model, data, dp_rank: int, dp: int, world: int, context=None) -> list[float]:
    import torch.distributed as dist

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for tokens in data:
        per = tokens.shape[0] // dp
        local = tokens[dp_rank * per:(dp_rank + 1) * per]
        if context is None:
            loss = model(input_ids=local, labels=local).loss
            loss.backward()
        else:  # loss parallel: the loss and its backward inside the context, on vocabulary-sharded logits
            logits = model(input_ids=local).logits
            with context():
                loss = logits_loss(logits, local)
                loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach()
        value = (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()  # loss parallel: a DTensor
        if world > 1:
            dist.all_reduce(value)  # tensor ranks hold equal losses: the mean over all is the mean over dp
            value /= world
        losses.append(value.item())
    return losses


def _ranks(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor

    import planc

    model = build()
    data = batches(model)
    applied = planc.apply(model, planc.loads(PLAN))
    mesh = applied.mesh
    placements = {n: (tuple(mesh.mesh_dim_names), tuple(str(p) for p in t.placements), tuple(t.to_local().shape))
                  for n, t in model.named_parameters() if isinstance(t, DTensor)}
    plain = [n for n, t in model.named_parameters() if not isinstance(t, DTensor)]
    from planc.analysis.explain import placement_text

    # in the words `planc explain` prints them, to compare with what it derives from the program
    explained = {n: dict(zip(mesh.mesh_dim_names, (placement_text(p) for p in t.placements)))
                 if isinstance(t, DTensor) else {} for n, t in model.named_parameters()}
    dp_rank = mesh["shard"].get_local_rank()
    losses = steps(model, data, dp_rank, 2, world)

    # the code `planc emit` prints for the same plan, run on a fresh copy on the same mesh
    from planc.backends.emit import emit_python
    from planc.model.hf import build_hf_model

    namespace: dict = {}
    exec(emit_python(planc.compile(planc.loads(PLAN), build_hf_model("llama-tiny"), world)), namespace)
    emitted = namespace["apply_plan"](build(), mesh)
    emitted_placements = {n: (tuple(mesh.mesh_dim_names), tuple(str(p) for p in t.placements), tuple(t.to_local().shape))
                          for n, t in emitted.named_parameters() if isinstance(t, DTensor)}
    from planc.estimate.memory import unit_memory

    estimated = sum(m.sharded for m in unit_memory(applied.compiled.program, applied.compiled.graph, world))
    local_bytes = sum(t.to_local().numel() * t.element_size() for t in model.parameters())
    sharded_logits = build()
    lp = planc.apply(sharded_logits, planc.loads(LOSS_PARALLEL_PLAN), mesh=mesh)
    lp_losses = steps(sharded_logits, data, dp_rank, 2, world, context=lp.loss_parallel)
    return {"losses": losses, "placements": placements, "plain": plain, "estimated": estimated, "local": local_bytes,
            "explained": explained,
            "loss_parallel": lp_losses,
            "emitted_losses": steps(emitted, data, dp_rank, 2, world), "emitted_placements": emitted_placements}


@pytest.fixture(scope="module")
def results():
    return run(_ranks, 4, timeout=600)


def test_losses_match_one_unsharded_process(results):
    model = build()
    expected = steps(model, batches(model), 0, 1, 1)
    for r in results:
        assert r["losses"] == pytest.approx(expected, rel=1e-5)
    assert expected[-1] < expected[0]  # it trains


def test_loss_parallel_on_vocabulary_sharded_logits_matches_one_process(results):
    model = build()
    import contextlib

    expected = steps(model, batches(model), 0, 1, 1, context=contextlib.nullcontext)
    for r in results:
        assert r["loss_parallel"] == pytest.approx(expected, rel=1e-5)


def test_emitted_code_shards_identically_and_trains_bitwise_equal(results):
    for r in results:
        assert r["emitted_placements"] == r["placements"]
        assert r["emitted_losses"] == r["losses"]


def test_sharded_bytes_per_rank_equal_the_estimate_with_tensor_parallel_local_shapes(results):
    # every dim of the tiny Llama divides 2 x 2, so each rank holds the same bytes
    for r in results:
        assert r["local"] == r["estimated"]


def test_every_parameter_is_a_2d_dtensor_with_the_planned_placements(results):
    r = results[0]
    assert r["plain"] == []
    dims, q, _ = r["placements"]["model.layers.0.self_attn.q_proj.weight"]
    assert dims == ("shard", "tensor")
    # colwise shards dim 0 over tp; FSDP then shards the same dim over dp, strided (`_S`)
    assert q == ("_S(0, 2)", "S(0)")
    assert r["placements"]["model.layers.0.self_attn.o_proj.weight"][1] == ("S(0)", "S(1)")  # rowwise: dim 1
    assert r["placements"]["model.embed_tokens.weight"][1] == ("_S(0, 2)", "S(0)")  # the vocabulary over tp
    assert r["placements"]["model.norm.weight"][1] == ("S(0)", "R")  # replicated on the tensor axis
    # local shapes: q_proj is 64 x 64: 64 / tp 2 / dp 2 rows, all 64 columns
    assert r["placements"]["model.layers.0.self_attn.q_proj.weight"][2] == (16, 64)


def test_placements_equal_what_planc_explain_prints(results):
    from planc.analysis.explain import parameter_placements
    from planc.model.hf import build_hf_model

    compiled = planc_compile(build_hf_model("llama-tiny"))
    expected = parameter_placements(compiled, 4)
    for r in results:
        assert r["explained"] == expected
    assert expected["model.layers.0.self_attn.q_proj.weight"] == {"shard": "_StridedShard(0, sf=2)", "tensor": "Shard(0)"}


def planc_compile(model):
    import planc

    return planc.compile(planc.loads(PLAN), model, 4)
