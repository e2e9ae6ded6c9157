"""`planc check --verify`: plans trained on local gloo processes against one unsharded process.

The oracle is one process training the same twin on the whole batches (planc/analysis/verify.py).
Every shipped plan must pass; a plan the static rules refuse for training silently wrong
(P423, a replicated per-head norm) must fail here too, located on the same line: the static
rule and the dynamic oracle agree.
"""

from __future__ import annotations

import pathlib

import pytest

import planc
from planc.analysis import verify
from planc.cli.main import main as planc_main
from planc.model.build import build_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLANS = sorted((ROOT / "plans").glob("*.plan"))


def _compiled(path: pathlib.Path, strict: bool = True):
    plan = planc.load(path)
    return planc.compile(plan, build_model(plan.model_ref, device="meta", base=path.parent), strict=strict)


def test_twins_are_the_small_siblings():
    assert verify.twin_reference("hf:llama-3-8b") == "hf:llama-tiny"
    assert verify.twin_reference("hf:qwen3-tiny") == "hf:qwen3-tiny"
    assert verify.twin_reference("planc.zoo:seed_transformer") == "planc.zoo:seed_transformer_tiny"
    assert verify.twin_reference("planc.zoo:gpt_tiny") == "planc.zoo:gpt_tiny"
    with pytest.raises(verify.VerifyError, match="--verify-model"):
        verify.twin_reference("hf:no-such-model")


@pytest.mark.dist
@pytest.mark.parametrize("path", PLANS, ids=[p.stem for p in PLANS])
def test_every_shipped_plan_trains_like_one_process(path):
    import shipped
    if shipped.not_verified(path):
        pytest.skip(shipped.not_verified(path))
    compiled = _compiled(path)
    verdict = verify.verify(compiled, base=str(path.parent))
    assert verdict.ok, [d.message for d in verify.diagnostics(compiled, verdict)]
    assert verdict.compared > 10
    ones = {a.role.value for a in compiled.mesh.axes if a.size == 1}  # axes the plan itself sets to 1
    if 2 * verdict.world > verify.MAX_PROCESSES:
        ones |= {a.role.value for a in compiled.mesh.axes if a.size is None}  # `*` at 1: 2 needs too many ranks
    assert all(size > 1 for axis, size in verdict.sizes.items() if axis not in ones), verdict.sizes


@pytest.mark.dist
def test_a_replicated_head_norm_fails_on_its_own_line():
    """Qwen3's q_norm/k_norm under `replicate` after colwise q/k projections (P423 statically): the
    first step's gradients of exactly those norms differ, by tens of percent, located on that line."""
    path = ROOT / "tests" / "ui" / "p423_replicate_head_norm.plan"
    compiled = _compiled(path, strict=False)
    assert [d.code for d in compiled.diagnostics if d.is_error] == ["P423"]
    verdict = verify.verify(compiled, base=str(path.parent), allow=frozenset({"P423"}))
    assert not verdict.ok
    (diag,) = verify.diagnostics(compiled, verdict)
    assert diag.code == "P425" and diag.span.line == 14  # `parallel ...{q_norm,k_norm} replicate`
    assert "q_norm.weight" in diag.message and "gradient (step 1)" in diag.message
    worst = max(m.error / m.scale for m in verdict.mismatches if m.step == 1)
    assert worst > 0.2
    assert "does not reduce its gradient over the tensor axis" in diag.notes[0]


@pytest.mark.dist
def test_a_split_fused_projection_fails_on_its_colwise_line():
    """Phi-3's fused gate_up_proj under plain colwise (P424 statically): every shape chains, the forward
    computes another function; the first module whose output differs is the rowwise down_proj, and the
    diagnostic lands on the first rule around it, the colwise gate_up_proj line."""
    path = ROOT / "tests" / "fixtures" / "verify" / "phi3_fused_gate_up.plan"
    compiled = _compiled(path, strict=False)
    assert [d.code for d in compiled.diagnostics if d.is_error] == ["P424"]
    verdict = verify.verify(compiled, base=str(path.parent), allow=frozenset({"P424"}))
    assert verdict.first_output is not None and verdict.first_output[0] == "model.layers.0.mlp.down_proj"
    (diag,) = verify.diagnostics(compiled, verdict)
    assert diag.code == "P425" and diag.span.line == 9  # `parallel model.layers.*.mlp.gate_up_proj colwise`
    assert "forward computes another function" in diag.message and "down_proj` rowwise (line 10)" in diag.notes[0]


def test_a_mesh_too_large_for_this_machine_is_not_verified(capsys):
    path = ROOT / "tests" / "ui" / "verify_too_many_ranks.plan"
    assert planc_main(["check", str(path.relative_to(ROOT)), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "error[P426]: the plan was not verified: the mesh needs 8 processes" in out


def test_verify_model_needs_verify(capsys):
    assert planc_main(["check", "plans/seed.plan", "--verify-model", "planc.zoo:seed_transformer_tiny"]) == 2
    assert "add --verify" in capsys.readouterr().err


def test_a_config_without_a_tiny_sibling_is_shrunk_keeping_what_plans_depend_on():
    import json

    raw = json.loads((ROOT / "planc" / "model" / "configs" / "mixtral-8x7b.json").read_text())
    twin = verify.shrink_config(raw)
    for kept in ("num_attention_heads", "num_key_value_heads", "num_local_experts", "num_experts_per_tok",
                 "tie_word_embeddings", "architectures", "model_type"):
        assert twin[kept] == raw[kept], kept
    assert twin["num_hidden_layers"] == 2 and twin["hidden_size"] == 32 * 16 and twin["vocab_size"] == 256
    assert twin["intermediate_size"] % 4 == 0


@pytest.mark.dist
def test_a_plan_for_a_full_size_config_is_verified_on_its_shrunk_twin(tmp_path):
    """plans/llama-tp.plan's rules on the full Llama 3 8B config (copied, so no shipped sibling is
    found): verified on the config shrunk to 2 layers at 2 x 2 ranks."""
    (tmp_path / "config.json").write_text((ROOT / "planc" / "model" / "configs" / "llama-3-8b.json").read_text())
    text = (ROOT / "plans" / "llama-tp.plan").read_text().replace("model hf:llama-tiny", "model hf:config.json")
    (tmp_path / "big.plan").write_text(text)
    compiled = _compiled(tmp_path / "big.plan")
    verdict = verify.verify(compiled, base=str(tmp_path))
    assert verdict.ok and (verdict.sizes["shard"], verdict.sizes["tensor"]) == (2, 2)
    assert "shrunk to 2 layers" in verdict.twin


@pytest.mark.dist
def test_a_full_size_model_given_with_model_runs_its_twin(capsys):
    """`--model planc.zoo:seed_transformer` (1.4B) names the model the plan is for; verify runs its tiny
    twin (it once ran the model given, a full-size build on every rank)."""
    code = planc_main(["check", "plans/seed.plan", "--model", "planc.zoo:seed_transformer", "--verify"])
    out = capsys.readouterr().out
    assert code == 0 and "against one process on `planc.zoo:seed_transformer_tiny`" in out
