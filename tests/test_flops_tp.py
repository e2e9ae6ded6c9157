"""Per-rank FLOPs under tensor parallelism: the time model against one real tensor rank's kernels.

The oracle applies the plan for real (`planc.apply`: torch's DTensor styles and FSDP2) on a
fake 2 x 2 process group and runs one training step of the tiny model under torch's
`DebugMode`, which records every plain-tensor kernel a rank runs, the ones DTensor runs on
local shards included; their FLOPs, by FlopCounterMode's own formulas, are what the rank
computes. (FlopCounterMode alone counts a DTensor matmul at its global shape.) FLOPs depend on
shapes only, so a fake process group (whose collectives move no data) gives the same count as
real ranks. planc's figure is `StepTime.model_flops`, counted on its emulated tensor rank.

The plans leave modules whole on every tensor rank (`replicate`: seed-tp's attention,
mixtral-tp's mixture-of-experts block), which a division of every module's FLOPs by the tensor
degree under-counted (issue 19, bug 2); zoo-llama-tp splits everything, with sequence parallelism.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

import planc
from planc.estimate.flops import flop_mapping, step_profile
from planc.estimate.time import estimate_step_time
from planc.estimate.trace import Example, default_loss
from planc.model.build import build_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORLD, SHAPE = 4, (2, 16)
CASES = {
    "seed-tp": ("plans/seed-tp.plan", "planc.zoo:seed_transformer_tiny"),
    "mixtral-tp": ("plans/mixtral-tp.plan", "hf:mixtral-tiny"),
    "zoo-llama-tp": ("plans/zoo-llama-tp.plan", "planc.zoo:llama_tiny"),
}


def rank_flops(model, applied, tokens) -> int:
    """FLOPs of the plain-tensor kernels one rank runs in one forward, loss and backward."""
    from torch.utils._debug_mode import DebugMode
    from torch.utils._debug_mode._calls import _OpCall
    from torch.utils.flop_counter import FlopCounterMode

    registry = FlopCounterMode(display=False, custom_mapping=flop_mapping()).flop_registry
    example = Example.of((tokens,))
    with DebugMode(record_realtensor=True, store_original_args=True) as debug:
        out = model(tokens)
        with applied.loss_parallel():
            default_loss(model, tp=2)(out, example).backward()
    total = 0
    for call in debug.operators:
        if not isinstance(call, _OpCall) or call.op.overloadpacket not in registry:
            continue
        leaves = tree_flatten((call.args, call.kwargs))[0]
        if any(isinstance(t, DTensor) for t in leaves):
            continue  # the DTensor-level call; its local kernels are recorded beneath it
        total += registry[call.op.overloadpacket](*call.args, **call.kwargs, out_val=None)
    return total


@pytest.mark.parametrize("case", sorted(CASES))
def test_model_flops_equal_one_tensor_ranks_kernels(case):
    from planc.analysis.simulate import init_fake

    path, ref = CASES[case]
    if ref.startswith("hf:"):
        pytest.importorskip("transformers")
    plan = planc.load(ROOT / path)
    compiled = planc.compile(plan, build_model(ref, device="meta"), WORLD)
    estimated = estimate_step_time(compiled, world=WORLD, input_shape=SHAPE).model_flops

    torch.manual_seed(0)
    model = build_model(ref, device="cpu")
    tokens = torch.randint(0, model.config.vocab_size, SHAPE)
    init_fake(WORLD)
    try:
        applied = planc.apply(model, plan)
        measured = rank_flops(model, applied, tokens)
    finally:
        dist.destroy_process_group()
    assert estimated == measured, f"{case}: planc {estimated} vs one tensor rank {measured}"
    if case != "zoo-llama-tp":  # modules left whole: the global count / tensor degree is not a rank's
        assert measured > step_profile(compiled.graph, input_shape=SHAPE, dtype=torch.bfloat16).total // 2
