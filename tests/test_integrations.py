"""planc.integrations without processes: what is refused before anything is sharded."""

from __future__ import annotations

import pytest
from torch import nn

from planc import PlanError
from planc.diagnostics.render import render_text
from planc.integrations.hf import shard_for_trainer


def test_shard_for_trainer_refuses_a_model_the_trainer_would_wrap():
    model = nn.Sequential(nn.Linear(4, 4))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PlanError) as err:
        shard_for_trainer(model, "plans/llama.plan")
    (diag,) = err.value.diagnostics
    assert diag.code == "P605" and "`Sequential`" in diag.message
    assert "help: pass the `PreTrainedModel` itself" in render_text([diag], {})
    # refused before apply: still plain tensors, unchanged
    assert all(type(p) is nn.Parameter and (p == b).all() for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("mesh_line, fsdp, replicas", [
    ("mesh (replicate = 2, shard = *)", 4, 2),
    ("mesh (dp_replicate = 2, fsdp = *)", 4, 2),   # the plan's own axis names (was 1 and 1)
    ("mesh (fsdp = *)", 8, 1),
])
def test_trainer_config_reads_the_axes_by_role(mesh_line, fsdp, replicas):
    """The Trainer's `DistributedConfig` sizes come from the axes' roles, whatever the plan calls them."""
    import torch.distributed as dist

    import planc
    from planc.analysis.simulate import init_fake
    from planc.backends.runtime import build_mesh
    from planc.integrations.hf import distributed_config

    compiled = planc.compile(planc.loads(f"model hf:llama-tiny\n{mesh_line}\nunit model.layers.*\n"), None, 8)
    init_fake(8)
    try:
        config = distributed_config(build_mesh(compiled.mesh, 8, "cpu"), compiled.mesh)
    finally:
        dist.destroy_process_group()
    assert (config.fsdp_size, config.dp_replicate_size) == (fsdp, replicas)


@pytest.mark.parametrize("mesh_line,step,expected", [
    ("mesh (shard = *)", "", {"gradient_accumulation_steps": 1}),
    ("mesh (shard = *)", "step { accumulate 4, sync = last }", {"gradient_accumulation_steps": 4}),
    ("mesh (replicate = 2, shard = *)", "step { accumulate 4 }",
     {"gradient_accumulation_steps": 4, "accelerator_config": {"gradient_accumulation_kwargs": {"sync_each_batch": True}}}),
    ("mesh (replicate = 2, shard = *)", "step { accumulate 4, sync = last }", "P607"),
])
def test_trainer_arguments_follow_the_step_line(mesh_line, step, expected):
    """The Trainer's accumulation from the plan; HSDP with `sync = last` (the Trainer would defer only the
    all-reduce) is refused at the `step` line."""
    import torch.distributed as dist

    import planc
    from planc.analysis.simulate import init_fake
    from planc.backends.runtime import AppliedPlan, build_mesh
    from planc.diagnostics import PlanError
    from planc.integrations.hf import trainer_arguments
    from planc.model.hf import build_hf_model

    text = f"model hf:llama-tiny\n{mesh_line}\n{step}\nunit model.layers.*\n"
    compiled = planc.compile(planc.loads(text, filename="t.plan"), build_hf_model("llama-tiny", device="meta"), 8)
    init_fake(8)
    try:
        applied = AppliedPlan(compiled, build_mesh(compiled.mesh, 8, "cpu"), None)
        if expected == "P607":
            with pytest.raises(PlanError) as err:
                trainer_arguments(applied)
            (diag,) = err.value.diagnostics
            assert diag.code == "P607" and diag.span.line == 3
        else:
            assert trainer_arguments(applied) == expected
    finally:
        dist.destroy_process_group()
