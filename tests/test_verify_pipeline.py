"""`planc check --verify` on pipeline plans (planc/analysis/verify_pipeline.py).

The oracle is one process training the unsharded twin with the same microbatching. A plan
that trains right passes at its stages rewritten for the twin; InterleavedZeroBubble with FSDP
resharding after forward (refused statically by P465: torch's wrong gradients) fails here too,
located on the unit that reshards: the static rule and the oracle agree.
"""

from __future__ import annotations

import pathlib

import pytest

import planc
from planc.analysis import verify
from planc.analysis.verify_pipeline import pipeline_world, twin_stages
from planc.model.build import build_model
from planc.zoo import llama_tiny

ROOT = pathlib.Path(__file__).resolve().parent.parent
STAGES_PLAN = ROOT / "tests" / "fixtures" / "verify" / "llama_pp_stages.plan"


def _compiled(path: pathlib.Path, strict: bool = True):
    plan = planc.load(path)
    return planc.compile(plan, build_model(plan.model_ref, device="meta", base=path.parent), strict=strict)


def _full(n: int) -> list[str]:
    return ["", "tok_embeddings", "layers", *(f"layers.{i}" for i in range(n)), "norm", "output"]


def test_stage_lines_are_rewritten_for_the_twin_in_proportion():
    twin = llama_tiny()  # 2 blocks
    cut = (("tok_embeddings", *(f"layers.{i}" for i in range(9))), (*(f"layers.{i}" for i in range(9, 16)), "norm", "output"))
    assert twin_stages(cut, _full(16), twin) == [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    # the embedding alone in stage 0: every stage holding blocks keeps one
    cut = (("tok_embeddings",), ("layers.0",), tuple(f"layers.{i}" for i in range(1, 16)) + ("norm", "output"))
    assert twin_stages(cut, _full(16), twin) == [["tok_embeddings"], ["layers.0"], ["layers.1", "norm", "output"]]


def test_a_twin_with_fewer_blocks_than_the_stages_is_refused():
    cut = tuple((f"layers.{i}",) for i in range(3))
    with pytest.raises(ValueError, match="has 2 blocks, fewer than the 4 stages"):
        twin_stages((("tok_embeddings", "layers.0"), *cut[1:], ("layers.3", "norm", "output")), _full(4), llama_tiny())


def test_the_world_keeps_the_pipeline_and_a_star_axis_when_it_fits():
    mesh = _compiled(ROOT / "plans" / "zoo-llama-pp.plan").mesh  # pipeline 4 x shard *
    assert pipeline_world(mesh, 4) == 4
    assert pipeline_world(_compiled(STAGES_PLAN).mesh, 4) == 4  # pipeline 2 x shard 2


@pytest.mark.dist
def test_explicit_stages_train_like_one_process():
    compiled = _compiled(STAGES_PLAN)
    verdict = verify.verify(compiled, base=str(STAGES_PLAN.parent))
    assert verdict.ok, [d.message for d in verify.diagnostics(compiled, verdict)]
    assert verdict.world == 4 and verdict.sizes["pipeline"] == 2 and verdict.sizes["shard"] == 2
    assert verdict.stage_of["tok_embeddings.weight"] == 0 and verdict.stage_of["output.weight"] == 1
    assert "tok_embeddings, layers.0 | layers.1, norm, output" in verdict.summary()
    assert verdict.seconds < 120


@pytest.mark.dist
def test_resharding_under_a_split_backward_schedule_fails_on_its_unit():
    """InterleavedZeroBubble with `reshard after_forward = true` on the blocks (P465 statically): the
    first step's gradients of exactly those blocks differ (by tens of percent), P425 on that unit,
    naming the stages that hold them."""
    path = ROOT / "tests" / "fixtures" / "verify" / "izb_reshard.plan"
    compiled = _compiled(path, strict=False)
    assert [d.code for d in compiled.diagnostics if d.is_error] == ["P465"]
    verdict = verify.verify(compiled, base=str(path.parent), allow=frozenset({"P465"}))
    assert not verdict.ok
    first = min(m.step for m in verdict.mismatches)
    assert first == 1 and all(m.param.startswith("layers.") for m in verdict.mismatches if m.step == first)
    (found,) = verify.diagnostics(compiled, verdict)
    assert found.code == "P425" and found.span.line == 9, (found.span.line, found.message)
    assert "in pipeline stage 1, 2 of the twin" in found.notes
