"""Cutting a lowered program into pipeline stages (planc/lower/pipeline.py).

Oracle: the plan's own program. Every parameter FSDP manages is managed by exactly one stage's
units, every non-FSDP op lands in the stage that holds its module, and nothing crosses stages.
"""

from __future__ import annotations

import pytest

import planc
from planc.lower.job import Job
from planc.lower.pipeline import StageError, inside, pipeline_job, stage_program
from planc.lower.program import Checkpoint, FullyShard, SetPrefetch
from planc.lower.schedules import schedule
from planc.zoo import llama_tiny

PLAN = """model planc.zoo:llama_tiny
mesh (shard = *)
unit tok_embeddings
unit layers.* { prefetch forward = 1 }
unit [norm, output] { reshard after_forward = false }
root { reshard after_forward = false }
checkpoint layers.* full
"""

STAGES = [("tok_embeddings", "layers.0"), ("layers.1", "norm", "output")]


def _job() -> Job:
    return planc.compile(planc.loads(PLAN, filename="pp.plan"), llama_tiny(), 4).job


def test_inside():
    assert inside("layers.1.attention", ["layers.1"]) and not inside("layers.10", ["layers.1"])
    assert inside("anything", [""]) and not inside("", ["layers.1"])


def test_stages_partition_the_units_and_ops():
    job = _job()
    split = pipeline_job(job, STAGES, schedule("1F1B", 2, 4))
    assert [p.modules for p in split.parts] == STAGES
    managed = [p for part in split.parts for u in part.program.units for p in u.params]
    assert sorted(managed) == sorted(p for u in job.program.units for p in u.params)
    first, last = (p.program for p in split.parts)
    assert [u.name for u in first.units] == ["tok_embeddings", "layers.0", "<root>"]
    assert [u.name for u in last.units] == ["layers.1", "[norm, output]", "<root>"]
    assert [c.module for c in first.of_type(Checkpoint)] == ["layers.0"]
    assert [c.module for c in last.of_type(Checkpoint)] == ["layers.1"]
    # layers.0 prefetched layers.1 (on the other rank): dropped; layers.1's target is in its stage
    assert not first.of_type(SetPrefetch)
    assert [(p.unit, p.targets) for p in last.of_type(SetPrefetch)] == [("layers.1", ("[norm, output]",))]
    assert split.schedule.stages == ((0,), (1,))


def test_a_unit_across_stages_is_refused():
    job = _job()
    with pytest.raises(StageError, match=r"\[norm, output\] spans stage 1"):
        stage_program(job.program, ("layers.1", "norm"), 1)


def test_the_schedule_must_place_every_stage():
    with pytest.raises(StageError, match="places stages"):
        pipeline_job(_job(), STAGES + [("nothing",)], schedule("1F1B", 2, 4))
    four = [("tok_embeddings",), ("layers.0",), ("layers.1",), ("norm", "output")]
    split = pipeline_job(_job(), four, schedule("Interleaved1F1B", 2, 4, 2))
    assert split.schedule.stages == ((0, 2), (1, 3))
    assert all(isinstance(u, FullyShard) for p in split.parts for u in p.program.units)


def test_experts_inside_stages_live_on_the_stage_submesh_of_one_expert_view():
    """Pipeline x expert (plans/qwen3-moe-pp-ep-tiny.plan at 4 ranks): the expert view has the pipeline
    axis outermost (one root mesh), each stage dispatches its own MoE layer's experts with FSDP on
    the view's efsdp axis (not the pipeline's), and the emitted `build_pipeline` builds that view
    once on every rank and hands it to each stage (tests/test_pipeline_expert_dist.py runs it)."""
    import pathlib

    from planc.backends.emit import emit_python
    from planc.lower.program import DispatchExperts
    from planc.zoo import moe_llama_tiny

    path = pathlib.Path(__file__).resolve().parent.parent / "plans" / "qwen3-moe-pp-ep-tiny.plan"
    compiled = planc.compile(planc.load(path), moe_llama_tiny(), 4)
    compiled.raise_for_errors()
    view = compiled.job.view("expert")
    assert [(a.name, a.size) for a in view.axes] == [("pipeline", 2), ("efsdp", 1), ("expert", 2)]
    for stage, part in enumerate(compiled.job.parts):
        assert [op.module for op in part.program.of_type(DispatchExperts)] == [f"layers.{stage}.moe.experts"]
        assert {u.expert_axes for u in part.program.units if u.expert_axes} == {("efsdp",)}
    text = emit_python(compiled)
    assert text.count("expert_mesh_of(") == 1  # build_pipeline's one call, on every rank
    assert "expert_mesh = expert_mesh_of(mesh, 2, ('efsdp', 'expert'), pipeline='pipeline')" in text
    assert "def apply_stage_0(model, mesh, expert_mesh):" in text
    assert "APPLY_STAGE[s](split(model, STAGES[s]), mesh, expert_mesh)" in text
