"""The pipeline runtime's pieces that need no process group: what it refuses, and the code
`planc emit` prints for a pipeline job (run for real in
tests/test_pipeline_dist.py)."""

from __future__ import annotations

import dataclasses

import pipeline_workers as workers
import pytest
import torch

from planc.backends import emit_pipeline, pipelining
from planc.backends.emit import emit_python
from planc.lower.job import UnknownKind
from planc.zoo import llama_tiny


@pytest.fixture(scope="module")
def meta_llama():
    with torch.device("meta"):
        return llama_tiny()


def test_loss_parallel_under_a_pipeline_is_read_and_printed(meta_llama):
    plan = workers.TP_PLAN.replace("output replicate", "loss_parallel")
    compiled = workers.pipeline_compiled(plan, meta_llama, 4, "1F1B", 2, 4)
    pipelining.READER.job(compiled.job)
    emit_pipeline.READER.job(compiled.job)
    assert "inside `torch.distributed.tensor.parallel.loss_parallel()`" in emit_python(compiled)


@pytest.mark.parametrize("name, held", [("Interleaved1F1B", "((0, 2), (1, 3))"), ("DualPipeV", "((0, 3), (1, 2))"),
                                        ("GPipe", "((0,), (1,))")])
def test_emit_prints_each_stage_and_the_schedule(meta_llama, name, held):
    source = emit_python(workers.pipeline_compiled(workers.FSDP_PLAN, meta_llama, 4, name, 2, 4))
    compile(source, "emitted.py", "exec")
    n = 2 if name == "GPipe" else 4
    assert [f"def apply_stage_{s}(model, mesh):" in source for s in range(n)] == [True] * n
    assert f"HELD = {held}" in source
    assert f"Schedule{name}({'stages[0]' if n == 2 else 'stages'}, n_microbatches=4" in source
    assert "scale_grads=True" in source and "reshard_after_forward=False" in source
    assert "reshard_after_forward=True" not in source


@dataclasses.dataclass(frozen=True)
class NewOp:
    """An op kind the lowering might add one day."""

    module: str


def test_an_op_kind_a_stage_does_not_know_is_refused(meta_llama):
    compiled = workers.pipeline_compiled(workers.FSDP_PLAN, meta_llama, 4, "Interleaved1F1B", 2, 4)
    job = compiled.job
    part = job.parts[2]
    parts = job.parts[:2] + (dataclasses.replace(part, program=dataclasses.replace(
        part.program, ops=part.program.ops + (NewOp("layers.1"),))),) + job.parts[3:]
    compiled.__dict__["job"] = dataclasses.replace(job, parts=parts)
    for reader in (pipelining.READER, emit_pipeline.READER):
        with pytest.raises(UnknownKind, match="NewOp"):
            reader.job(compiled.job)
    with pytest.raises(UnknownKind, match="NewOp"):
        emit_python(compiled)


def test_reproducible_materialize_is_refused_under_a_pipeline():
    import planc

    applied = pipelining.PipelinedPlan(compiled=None, mesh=None, model=None)
    with pytest.raises(ValueError, match="whole model's order"):
        planc.materialize(applied, "cpu", reproducible=True)
