"""Hugging Face models sharded by their shipped plans on 2 real gloo ranks train like unsharded.

One launch of 2 ranks runs three cases (each rank builds the model on the CPU with the same
seed, so every rank and the unsharded reference start from identical weights):

* `plans/llama.plan` on hf:llama-tiny in fp32: 3 AdamW steps give the unsharded losses and
  final weights to float32 rounding; every parameter is a DTensor sharded on dim 0;
* the same plan as written (bf16 params, fp32 reduce): FSDP holds the units and policies
  of torchtitan's recipe, and the loss falls;
* `plans/mixtral.plan` on hf:mixtral-tiny in fp32: the fused expert weights are sharded on
  dim 1 (`Shard(1)`), and training matches unsharded too.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

pytest.importorskip("transformers")

from distributed import run  # noqa: E402

pytestmark = pytest.mark.dist

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORLD = 2
STEPS = 3
GLOBAL_BATCH = 4
SEQ = 16
LR = 1e-2
FP32 = "\ndefaults { precision param = fp32, reduce = fp32 }\n"


def build(config: str) -> torch.nn.Module:
    """The model on the CPU, initialised from a fixed seed: the same on every rank."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from planc.hf import build_hf_model
    torch.manual_seed(0)
    return build_hf_model(config, device="cpu")


def batches(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    # counting sequences from random starts: learnable, so the loss visibly falls
    return [(torch.randint(0, vocab, (GLOBAL_BATCH, 1), generator=gen) + torch.arange(SEQ)) % vocab
            for _ in range(STEPS)]


def train(model: torch.nn.Module, rank: int = 0, world: int = 1) -> list[float]:
    """AdamW steps; each rank takes its slice of the global batch; returns the global losses."""
    import torch.distributed as dist
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    per_rank = GLOBAL_BATCH // world
    losses = []
    for tokens in batches(model.config.vocab_size):
        local = tokens[rank * per_rank:(rank + 1) * per_rank]
        loss = model(input_ids=local, labels=local).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(loss)  # gloo has no AVG
            loss /= world
        losses.append(loss.item())
    return losses


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _case(rank: int, world: int, config: str, plan_path: str, extra: str) -> dict:
    import planc
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    model = build(config)
    plan = planc.loads((ROOT / plan_path).read_text() + extra, filename=plan_path)
    applied = planc.apply(model, plan)
    placements, local_shapes, global_shapes = {}, {}, {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        placements[name] = tuple(repr(pl) for pl in p.placements)
        local_shapes[name] = tuple(p.to_local().shape)
        global_shapes[name] = tuple(p.shape)
    losses = train(model, rank, world)
    units = []  # read after training: FSDP fills its param groups at lazy init (first forward)
    for a in applied.units:
        assert all(isinstance(m, FSDPModule) for m in a.modules)
        groups = a.handle._get_fsdp_state()._fsdp_param_groups  # none when it holds no parameter
        units.append({"modules": tuple(a.unit.modules),
                      "groups": [(g.mp_policy.param_dtype, g.mp_policy.reduce_dtype,
                                  g.post_forward_mesh_info is not None) for g in groups]})
    state = full_state(model)  # an all-gather: every rank takes part, rank 0 reports it
    return {"placements": placements, "local": local_shapes, "global": global_shapes, "units": units,
            "losses": losses, "state": state if rank == 0 else None}


def ranks(rank: int, world: int) -> dict:
    return {
        "llama_fp32": _case(rank, world, "llama-tiny", "plans/llama.plan", FP32),
        "llama_bf16": _case(rank, world, "llama-tiny", "plans/llama.plan", ""),
        "mixtral_fp32": _case(rank, world, "mixtral-tiny", "plans/mixtral.plan", FP32),
    }


@pytest.fixture(scope="module")
def results():
    return run(ranks, WORLD, timeout=600)


def _reference(config: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build(config)
    return train(model), full_state(model)


def _dim0_chunk(n: int, rank: int) -> int:
    return len(torch.arange(n).chunk(WORLD)[rank]) if rank < len(torch.arange(n).chunk(WORLD)) else 0


@pytest.mark.parametrize("case,config", [("llama_fp32", "llama-tiny"), ("mixtral_fp32", "mixtral-tiny")])
def test_fp32_training_matches_unsharded(results, case, config):
    losses, state = _reference(config)
    for rank in range(WORLD):
        torch.testing.assert_close(results[rank][case]["losses"], losses, rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0]
    sharded = results[0][case]["state"]
    assert sharded.keys() == state.keys()
    for name in state:
        torch.testing.assert_close(sharded[name], state[name], rtol=1e-4, atol=1e-5, msg=name)


def test_llama_shards_every_parameter_on_dim_0(results):
    for rank in range(WORLD):
        r = results[rank]["llama_fp32"]
        assert set(r["placements"].values()) == {("Shard(dim=0)",)}
        for name, shape in r["global"].items():
            assert r["local"][name] == (_dim0_chunk(shape[0], rank), *shape[1:]), name


def test_llama_as_written_is_torchtitans_recipe(results):
    r = results[0]["llama_bf16"]
    assert [u["modules"] for u in r["units"]] == [("model.embed_tokens",), ("model.layers.0",), ("model.layers.1",),
                                                  ("model.norm", "lm_head"), ("",)]
    # (param dtype, reduce dtype, reshard after forward) of each unit's parameter group; the
    # root holds no parameter of HF Llama (only the rotary buffers), so FSDP gives it no group
    bf16, fp32 = torch.bfloat16, torch.float32
    assert [u["groups"] for u in r["units"]] == [[(bf16, fp32, True)], [(bf16, fp32, True)], [(bf16, fp32, True)],
                                                 [(bf16, fp32, False)], []]
    assert all(torch.isfinite(torch.tensor(r["losses"]))) and r["losses"][-1] < r["losses"][0]
    assert results[0]["llama_bf16"]["losses"] == results[1]["llama_bf16"]["losses"]


def test_mixtral_experts_are_sharded_on_dim_1(results):
    for rank in range(WORLD):
        r = results[rank]["mixtral_fp32"]
        experts = {n for n in r["placements"] if ".mlp.experts." in n}
        assert len(experts) == 4  # gate_up_proj and down_proj in each of 2 layers
        for name, placement in r["placements"].items():
            shape = r["global"][name]
            if name in experts:
                assert placement == ("Shard(dim=1)",)
                assert r["local"][name] == (shape[0], shape[1] // WORLD, *shape[2:])
            else:
                assert placement == ("Shard(dim=0)",)
