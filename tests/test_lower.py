"""The lowered program: ops in the order that works, each unit's effective policy resolved once."""

from __future__ import annotations

import inspect

import torch

import planc
from planc.lower.program import (
    CPU_OFFLOAD_DEFAULTS,
    FULLY_SHARD_DEFAULTS,
    MP_DEFAULTS,
    Checkpoint,
    Compile,
    FullyShard,
    SetPrefetch,
    UnitMethod,
)
from planc.model.build import build_model

MOE = "tests/golden/emit/moe_everything.plan"


def _compiled(text: str, ref: str = "planc.zoo:moe_transformer_tiny"):
    return planc.compile(planc.loads(text), build_model(ref))


def test_fsdp_defaults_are_those_of_the_installed_torch():
    # the printed code leaves out arguments equal to these, so they must be torch's own
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy()
    assert {k: getattr(mp, k) for k in MP_DEFAULTS} == dict(MP_DEFAULTS)
    assert CPUOffloadPolicy().pin_memory is CPU_OFFLOAD_DEFAULTS["pin_memory"]
    params = inspect.signature(fully_shard).parameters
    assert {k: params[k].default for k in FULLY_SHARD_DEFAULTS} == dict(FULLY_SHARD_DEFAULTS)


def test_ops_come_in_the_order_that_works():
    text = open(MOE).read() + "\ndefaults { reduction force_sum = true }\n"
    program = _compiled(text).program
    kinds = [type(op).__name__ for op in program.ops]
    order = ["Checkpoint", "Compile", "FullyShard", "SetPrefetch", "UnitMethod"]
    assert sorted(kinds, key=order.index) == kinds  # transforms, then shards bottom-up, then knobs
    assert [op.module for op in program.of_type(Checkpoint)] == ["layers.0", "layers.1"]
    assert [op.module for op in program.of_type(Compile)] == ["layers.0.attention", "layers.1.attention"]
    assert program.units[-1].is_root and [u.name for u in program.units] == [u.name for u in
                                                                            _compiled(text).units]
    fwd = [op for op in program.of_type(SetPrefetch) if op.direction == "forward"]
    assert fwd[0] == SetPrefetch("layers.0", "forward", ("[norm, output]",))
    assert {op.method for op in program.of_type(UnitMethod)} == {"set_force_sum_reduction_for_comms"}


def test_each_unit_policy_has_every_default_resolved():
    program = _compiled(open(MOE).read()).program
    moe = program.unit("layers.0.moe")
    assert moe.policy.reshard_after_forward == 2 and moe.policy.reshard_argument == 2
    root = program.unit("<root>")
    assert root.policy.reshard_after_forward is False
    # a unit that sets nothing reshards (FSDP2's default for inner units), passing None
    plain = _compiled("model planc.zoo:seed_transformer_tiny\nunit transformer_layers.*\n",
                      "planc.zoo:seed_transformer_tiny").program
    block, root = plain.unit("transformer_layers.0"), plain.unit("<root>")
    assert (block.policy.reshard_after_forward, block.policy.reshard_argument) == (True, None)
    assert (root.policy.reshard_after_forward, root.policy.reshard_argument) == (False, None)
    p = block.policy.precision
    assert p.compute_dtype(torch.float32) == torch.float32 and p.reduce(torch.float32) == torch.float32
    p = moe.policy.precision  # defaults: bf16 params, fp32 reduce
    assert p.compute_dtype(torch.float32) == torch.bfloat16 and p.reduce(torch.float32) == torch.float32
    assert not p.casts_inputs and p.changed() == {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32,
                                                   "cast_forward_inputs": False}
    # provenance is kept: each setting says which line set it
    assert moe.policy.origins["reshard_after_forward"].rule == "unit layers.*.moe"


def test_placements_and_ignores_are_named_by_parameter():
    program = _compiled(open(MOE).read()).program
    moe = program.unit("layers.0.moe")
    assert dict(moe.placements) == {"layers.0.moe.experts.w1": 1, "layers.0.moe.experts.w2": 1,
                                    "layers.0.moe.experts.w3": 1}
    layer = program.unit("layers.0")
    assert layer.ignored == ("layers.0.attention_norm.weight",)
    assert "layers.0.attention_norm.weight" not in layer.params
    assert isinstance(layer, FullyShard) and layer.axes == ("shard",)


def test_mesh_dimension_names_reach_every_unit():
    program = _compiled("model planc.zoo:seed_transformer_tiny\nmesh (dp_replicate = 2, fsdp = *)\n"
                        "unit transformer_layers.*\n", "planc.zoo:seed_transformer_tiny").program
    assert {op.axes for op in program.units} == {("dp_replicate", "fsdp")}


def test_checkpoint_modes_reach_the_program():
    text = ("model planc.zoo:seed_transformer_tiny\nunit transformer_layers.* { checkpoint selective }\n"
            "checkpoint embedding\n")
    program = _compiled(text, "planc.zoo:seed_transformer_tiny").program
    assert {op.module: op.mode for op in program.of_type(Checkpoint)} == {
        "transformer_layers.0": "selective", "transformer_layers.1": "selective", "embedding": "full"}


def test_checkpoint_every_nth_unit_of_a_rule():
    # torchtitan's `selective_ac_option = "2"`: the 2nd, 4th, ... block of those a rule checkpoints
    text = "model planc.zoo:seed_transformer\nunit transformer_layers.* { checkpoint selective, every = 2 }\n"
    program = _compiled(text, "planc.zoo:seed_transformer").program
    assert [op.module for op in program.of_type(Checkpoint)] == [f"transformer_layers.{i}" for i in range(1, 24, 2)]
    assert {op.mode for op in program.of_type(Checkpoint)} == {"selective"}
    diags = planc.compile(planc.loads("model planc.zoo:seed_transformer\nunit transformer_layers.* "
                                      "{ checkpoint every = 0 }\n"), build_model("planc.zoo:seed_transformer"),
                          strict=False).errors
    assert [d.code for d in diags] == ["P103"] and "at least 1" in diags[0].message


def test_torchtitan_reshard_policy_names_and_compile_backend():
    # torchtitan's `reshard_after_forward_policy` words, and `compile backend = ...`
    text = ("model planc.zoo:seed_transformer_tiny\nunit embedding { reshard after_forward = never }\n"
            "unit transformer_layers.* { reshard always; compile backend = aot_eager, fullgraph = true }\n"
            "root { reshard default }\n")
    program = _compiled(text, "planc.zoo:seed_transformer_tiny").program
    got = {u.name: (u.policy.reshard_argument, u.policy.reshard_after_forward) for u in program.units}
    assert got["embedding"] == (False, False) and got["transformer_layers.0"] == (True, True)
    assert got["<root>"] == (None, False)  # `default`: FSDP2's own (false for the root)
    assert {op.options for op in program.of_type(Compile)} == {(("backend", "aot_eager"), ("fullgraph", True))}
