"""`planc.backends.runtime` in this process: kwargs per unit, refusals, device choice, materialize.

Multi-rank behaviour (placements, parity with unsharded training) is in test_apply_dist.py.
Tests that shard use a real one-rank gloo process group, made here and torn down after.
"""

from __future__ import annotations

import pathlib
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

import planc
from planc import zoo
from planc.backends.materialize import materialize
from planc.backends.runtime import build_mesh, device_type, fully_shard_kwargs, unit_modules

MOE = """model planc.zoo:moe_transformer
defaults { precision param = bf16, reduce = fp32, output = fp32, cast_inputs = true }
unit tok_embeddings
unit layers.* { offload cpu }
unit [norm, output] { reshard after_forward = false }
place **.experts.w* Shard(1)
ignore layers.0.attention_norm.weight
"""
ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_no_process_group_is_a_diagnostic():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    model = zoo.gpt_tiny()
    ids = [id(p) for p in model.parameters()]
    with pytest.raises(planc.PlanError) as err:
        planc.apply(model, planc.loads("model planc.zoo:gpt\nunit blocks.*\n"))
    assert [d.code for d in err.value.errors] == ["P603"]
    assert [id(p) for p in model.parameters()] == ids


@pytest.fixture(scope="module")
def one_rank():
    """A real gloo process group of one rank (world size 1)."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("plan,full,tiny", [
    ("plans/seed.plan", "seed_transformer", "seed_transformer_tiny"),
    ("plans/seed_hsdp.plan", "seed_transformer", "seed_transformer_tiny"),
    ("plans/gpt.plan", "gpt", "gpt_tiny"),
    ("plans/moe.plan", "moe_transformer", "moe_transformer_tiny")])
def test_zoo_plans_compile_for_full_and_tiny_models(plan, full, tiny):
    for builder, worlds in ((full, (2, 8, 64)), (tiny, (2, 4))):
        with torch.device("meta"):
            model = zoo.ZOO[builder]()
        for world in worlds:
            compiled = planc.compile(ROOT / plan, model, world)  # strict: raises on any error
            assert not [d for d in compiled.diagnostics if d.severity == "warning"], (builder, world)
            assert compiled.units[-1].is_root


def test_device_type_follows_the_backend():
    assert device_type("gloo") == "cpu"
    assert device_type("nccl") == "cuda"
    assert device_type("cpu:gloo,cuda:nccl") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_fully_shard_kwargs_say_what_the_plan_says(one_rank):
    torch.manual_seed(0)
    model = zoo.moe_transformer_tiny()
    compiled = planc.compile(planc.loads(MOE), model, 1)
    mesh = build_mesh(compiled.mesh)
    kwargs = {op.name: fully_shard_kwargs(op, model, mesh) for op in compiled.program.units}
    assert list(kwargs) == ["tok_embeddings", "layers.0", "layers.1", "[norm, output]", "<root>"]
    layer = kwargs["layers.0"]
    assert layer["mesh"] is mesh
    mp = layer["mp_policy"]
    assert (mp.param_dtype, mp.reduce_dtype, mp.output_dtype, mp.cast_forward_inputs) == \
        (torch.bfloat16, torch.float32, torch.float32, True)
    # Offload on a CPU mesh: no pinning (it needs an accelerator).
    assert isinstance(layer["offload_policy"], CPUOffloadPolicy) and not layer["offload_policy"].pin_memory
    assert type(kwargs["tok_embeddings"]["offload_policy"]) is OffloadPolicy
    assert layer["reshard_after_forward"] is None and kwargs["[norm, output]"]["reshard_after_forward"] is False
    # Placements by parameter identity, only for this unit's subtree.
    fn = layer["shard_placement_fn"]
    experts = model.layers[0].moe.experts
    assert fn(experts.w1) == Shard(1) and fn(experts.w3) == Shard(1)
    assert fn(model.layers[0].attention.qkv.weight) is None
    assert kwargs["tok_embeddings"]["shard_placement_fn"] is None
    assert layer["ignored_params"] == {model.layers[0].attention_norm.weight}
    assert kwargs["layers.1"]["ignored_params"] is None
    assert kwargs["<root>"]["ignored_params"] == {model.layers[0].attention_norm.weight}
    assert unit_modules(compiled.unit("[norm, output]"), model) == [model.norm, model.output]
    assert unit_modules(compiled.unit("<root>"), model) == [model]


def test_apply_on_one_rank_and_summary(one_rank):
    torch.manual_seed(0)
    model = zoo.moe_transformer_tiny()
    numel = sum(p.numel() for p in model.parameters())
    applied = planc.apply(model, planc.loads(MOE))
    assert isinstance(model, FSDPModule)
    assert isinstance(applied.handle("layers.1"), FSDPModule)
    assert applied.unit_of_module["norm"] is applied.unit_of_module["output"]
    assert not isinstance(model.layers[0].attention_norm.weight, DTensor)  # ignored
    assert isinstance(model.layers[0].moe.experts.w1, DTensor)
    assert applied.local_param_bytes() == numel * 4  # one rank holds everything, fp32
    text = applied.summary()
    assert "[norm, output]" in text and "ignored (replicated): layers.0.attention_norm.weight" in text
    model(zoo.example_input(model, 2, 8)).float().mean().backward()


def test_mesh_that_does_not_fit_is_refused(one_rank):
    model = zoo.seed_transformer_tiny()
    ids = [id(p) for p in model.parameters()]
    hsdp = "model planc.zoo:seed_transformer\nmesh (replicate = 1, shard = 1)\nunit transformer_layers.*\n"
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(planc.PlanError) as err:
        planc.apply(model, planc.loads(hsdp), mesh=mesh)
    assert [d.code for d in err.value.errors] == ["P602"]
    assert "2-D" not in str(err.value) and "1-D" in str(err.value)
    assert [id(p) for p in model.parameters()] == ids and not isinstance(model, FSDPModule)
    # HSDP needs named dims (FSDP2 asserts without them).
    unnamed = torch.distributed.device_mesh.init_device_mesh("cpu", (1, 1))
    hsdp = "model planc.zoo:seed_transformer\nmesh HYBRID_SHARD (shard = 1)\nunit transformer_layers.*\n"
    with pytest.raises(planc.PlanError) as err:
        planc.apply(model, planc.loads(hsdp), mesh=unnamed)
    assert [d.code for d in err.value.errors] == ["P602"] and "no dimension names" in str(err.value)
    applied = planc.apply(model, planc.loads(hsdp), mesh=mesh)  # the named one fits
    assert applied.mesh is mesh and model.embedding.weight.placements == (Replicate(), Shard(0))


def test_compiled_plan_is_recompiled_for_the_live_model(one_rank):
    # Compiled against the full-size model at world 8; applied to the tiny one at world 1.
    with torch.device("meta"):
        full = zoo.gpt()
    compiled = planc.compile(ROOT / "plans/gpt.plan", full, 8)
    model = zoo.gpt_tiny()
    applied = planc.apply(model, compiled)
    assert [u.name for u in applied.units] == ["blocks.0", "blocks.1", "[wte, ln_f, lm_head]", "<root>"]
    assert applied.compiled.world_size == 1


def test_compiled_plan_for_this_model_is_reused(one_rank):
    model = zoo.gpt_tiny()
    compiled = planc.compile(ROOT / "plans/gpt.plan", model, 1)
    assert compiled.graph.describes(model)
    assert planc.apply(model, compiled).compiled is compiled  # no second compile


def test_compiled_plan_for_a_changed_model_is_recompiled(one_rank):
    model = zoo.gpt_tiny()
    compiled = planc.compile(ROOT / "plans/gpt.plan", model, 1)
    model.lm_head.weight = nn.Parameter(torch.zeros_like(model.lm_head.weight))  # the tie is broken
    assert not compiled.graph.describes(model)
    applied = planc.apply(model, compiled)
    assert applied.compiled is not compiled  # recompiled: the untied copy is now a parameter of its own
    group = "[wte, ln_f, lm_head]"
    assert "lm_head.weight" in applied.compiled.unit(group).params
    assert "lm_head.weight" not in compiled.unit(group).params


def test_checkpoint_already_applied_is_refused(one_rank):
    from torch.distributed._composable import checkpoint
    model = zoo.gpt_tiny()
    checkpoint(model.blocks[0])
    with pytest.raises(planc.PlanError) as err:
        planc.apply(model, ROOT / "plans/gpt.plan")
    assert [d.code for d in err.value.errors] == ["P601"]
    assert "checkpointed modules: `blocks.0`" in str(err.value)


def test_a_plan_compiled_before_sharding_by_hand_is_not_trusted(one_rank):
    # At world size 1 sharding keeps every shape, so only the class swap and the DTensor
    # parameters tell the compiled graph that the model changed under it.
    from torch.distributed.fsdp import fully_shard
    model = zoo.gpt_tiny()
    compiled = planc.compile(ROOT / "plans/gpt.plan", model, 1)
    assert compiled.graph.already_sharded == {"fsdp": [], "dtensor": [], "checkpoint": []}
    fully_shard(model.blocks[1])
    assert not compiled.graph.describes(model)
    with pytest.raises(planc.PlanError) as err:
        planc.apply(model, compiled)
    assert [d.code for d in err.value.errors] == ["P601"]
    assert "FSDP modules: `blocks.1`" in str(err.value)
    assert "DTensor parameters: `blocks.1.ln_1.weight`" in str(err.value)


def test_memory_expects_are_for_check_not_apply(one_rank):
    text = (ROOT / "plans/gpt.plan").read_text() + "expect memory.peak <= 1KiB at world = 1, input = 2x16\n"
    with torch.device("meta"):
        meta = zoo.gpt_tiny()
    assert [d.code for d in planc.compile(planc.loads(text), meta, 1, strict=False).errors] == ["P502"]
    applied = planc.apply(zoo.gpt_tiny(), planc.loads(text))  # the bound is not evaluated here
    assert applied.compiled.ok and not applied.compiled.check_memory


def test_non_contiguous_parameter_is_refused(one_rank):
    model = zoo.gpt_tiny()
    w = model.blocks[0].mlp.w_in.weight
    model.blocks[0].mlp.w_in.weight = nn.Parameter(w.detach().t().contiguous().t())  # same values, transposed strides
    ids = [id(p) for p in model.parameters()]
    with pytest.raises(planc.PlanError) as err:
        planc.apply(model, ROOT / "plans/gpt.plan")
    assert [d.code for d in err.value.errors] == ["P604"]
    assert "`blocks.0.mlp.w_in.weight` of unit `blocks.0`" in str(err.value)
    assert [id(p) for p in model.parameters()] == ids and not isinstance(model, FSDPModule)


def test_checkpoint_and_compile_wrap_the_named_modules_in_place(one_rank):
    from torch.distributed._composable.contract import _get_registry
    model = zoo.seed_transformer_tiny()
    keys = list(model.state_dict())
    text = (ROOT / "plans/seed.plan").read_text() + "checkpoint transformer_layers.1 full\ncompile transformer_layers.*\n"
    planc.apply(model, planc.loads(text))
    checkpointed = [n for n, m in model.named_modules() if "checkpoint" in (_get_registry(m) or {})]
    assert checkpointed == ["transformer_layers.1"]
    compiled = [n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert compiled == ["transformer_layers.0", "transformer_layers.1"]
    assert list(model.state_dict()) == keys  # no wrapper modules, no renamed keys


# ----------------------------------------------------------------------------- materialize


def test_materialize_keeps_offloaded_shards_on_the_cpu(one_rank):
    from planc.backends.materialize import _offloaded_params
    with torch.device("meta"):
        model = zoo.seed_transformer_tiny()
    text = (ROOT / "plans/seed.plan").read_text() + "unit transformer_layers[-1:] { offload cpu, pin_memory = false }\n"
    applied = planc.apply(model, planc.loads(text))
    last = applied.unit("transformer_layers.1").unit
    assert _offloaded_params(model) == {id(model.get_parameter(n)) for n in last.params}
    materialize(model, "cpu")  # the CPU is the only device here; on GPUs the others go there
    assert all(p.to_local().device.type == "cpu" and torch.isfinite(p.to_local()).all() for p in model.parameters())
    model(zoo.example_input(model, 2, 8)).float().mean().backward()



@pytest.mark.parametrize("builder", ["seed_transformer_tiny", "gpt_tiny", "moe_transformer_tiny"])
def test_materialize_initialises_every_parameter_like_the_model_does(builder):
    torch.manual_seed(0)
    reference = dict(zoo.ZOO[builder]().named_parameters())
    with torch.device("meta"):
        model = zoo.ZOO[builder]()
    # Poison fresh memory, so that a parameter left uninitialised cannot pass by being zero.
    materialize(model, "cpu", init=lambda m: [p.fill_(float("nan")) for p in m.parameters()])
    assert all(torch.isnan(p).all() for p in model.parameters())
    materialize(model, "cpu")
    for name, p in model.named_parameters():
        ref = reference[name]
        assert torch.isfinite(p).all(), name
        if ref.std() == 0:  # constants: norms' ones, biases' zeros
            assert torch.equal(p, ref), name
        else:  # random: same distribution (std within 25%)
            assert abs(p.std() - ref.std()) < 0.25 * ref.std(), name
    if hasattr(model, "wte"):
        assert model.wte.weight is model.lm_head.weight  # re-tied, and initialised as wte


def test_materialize_with_own_init():
    with torch.device("meta"):
        model = zoo.gpt_tiny()
    materialize(model, "cpu", init=lambda m: [nn.init.constant_(p, 0.5) for p in m.parameters()])
    assert all(bool((p == 0.5).all()) for p in model.parameters())
    assert model.wte.weight is model.lm_head.weight
