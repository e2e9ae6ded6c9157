"""The static rules for the silent-wrong tensor-parallel holes (planc/checks/tensor_holes.py), on the
tiny Hugging Face configs: P423 (replicate on per-head weights), P424 (colwise on a fused projection)
and P418's fix read from the layout chain. What torch really computes for each is in
tests/test_holes_dist.py (2 gloo ranks against one process)."""

from __future__ import annotations

import pathlib
import re

import pytest

import planc
from planc.checks.fused import first_uses
from planc.model.graph import ModelGraph
from planc.model.hf import build_hf_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
P423_PLAN = (ROOT / "tests/ui/p423_replicate_head_norm.plan").read_text()
P424_PLAN = (ROOT / "tests/ui/p424_fused_colwise.plan").read_text()
REDUCING = "sequence { sequence_dim 2; local_output true }"


@pytest.fixture(scope="module")
def graphs():
    return {name: ModelGraph.from_module(build_hf_model(name))
            for name in ("qwen3-tiny", "phi3-tiny", "gpt-neox-tiny", "llama-tiny")}


def _diags(text: str, graph):
    compiled = planc.compile(planc.loads(text, filename="t.plan"), graph, strict=False, check_memory=False)
    return compiled.diagnostics


def _codes(text: str, graph) -> list[str]:
    return [d.code for d in _diags(text, graph)]


def _line(text: str, d) -> str:
    return text.splitlines()[d.span.line - 1]


# ----------------------------------------------------------------- P423


def test_p423_replicate_on_qwen3_per_head_norms(graphs):
    found = _diags(P423_PLAN, graphs["qwen3-tiny"])
    assert [d.code for d in found] == ["P423"]
    assert "{q_norm,k_norm} replicate" in _line(P423_PLAN, found[0])
    assert "not reduced over the tensor axis" in found[0].message
    assert f"`parallel model.layers.*.self_attn.{{q_norm,k_norm}} {REDUCING}`" in found[0].help[0]


def test_p423_silent_for_the_reducing_sequence_form(graphs):
    fixed = P423_PLAN.replace("self_attn.{q_norm,k_norm} replicate", f"self_attn.{{q_norm,k_norm}} {REDUCING}")
    assert _codes(fixed, graphs["qwen3-tiny"]) == []


def test_p423_silent_for_block_norms_outside_a_split_region(graphs):
    # the decoder layer's norms sit beside `self_attn` and `mlp`, not beside a colwise layer
    assert "P423" not in _codes((ROOT / "plans/llama-tp.plan").read_text(), graphs["llama-tiny"])


def test_p423_from_a_replicate_covering_the_attention(graphs):
    # `replicate` on the whole attention covers the norms too: located on that line
    text = P423_PLAN.replace("parallel model.layers.*.self_attn.{q_norm,k_norm} replicate\n",
                             "parallel model.layers.*.self_attn replicate\n")
    text += ("parallel model.layers.*.self_attn.{q_proj,k_proj,v_proj} colwise\n"
             "parallel model.layers.*.self_attn.o_proj rowwise\n")
    found = [d for d in _diags(text, graphs["qwen3-tiny"]) if d.code == "P423"]
    assert len(found) == 1 and _line(text, found[0]) == "parallel model.layers.*.self_attn replicate"


def test_p423_silent_for_a_module_before_the_colwise_layer():
    # torchtitan's root: `norm` is registered (and runs) before the `output` projection left Shard(-1)
    from ui_models import tp_net

    text = (ROOT / "tests/fixtures/tp/tp_net.plan").read_text()
    text = text.replace("parallel norm sequence", "parallel norm replicate")
    text = text.replace("output colwise { input shard(1); loss_parallel }", "output colwise { input shard(1) }")
    assert "P423" not in _codes(text, ModelGraph.from_module(tp_net()))


# ----------------------------------------------------------------- P424


def test_p424_colwise_on_phi3_fused_projections(graphs):
    found = _diags(P424_PLAN, graphs["phi3-tiny"])
    assert [d.code for d in found] == ["P424", "P424"]
    lines = [_line(P424_PLAN, d) for d in found]
    assert lines == ["parallel model.layers.*.self_attn.qkv_proj colwise", "parallel model.layers.*.mlp.gate_up_proj colwise"]
    assert "aten.split.Tensor" in found[1].message and "256 output features" in found[1].message
    assert "`parallel model.layers.*.mlp.down_proj rowwise { input replicate }`" in found[1].help[0]


def test_p424_silent_for_the_gathered_form(graphs):
    fixed = P424_PLAN.replace("qkv_proj colwise", "qkv_proj colwise { output replicate }")
    fixed = fixed.replace("gate_up_proj colwise", "gate_up_proj colwise { output replicate }")
    fixed = fixed.replace("o_proj rowwise", "o_proj rowwise { input replicate }")
    fixed = fixed.replace("down_proj rowwise", "down_proj rowwise { input replicate }")
    assert _codes(fixed, graphs["phi3-tiny"]) == []


def test_p424_silent_for_gpt_neox_per_head_fused_qkv(graphs):
    # query_key_value is viewed as (heads, 3 x head_dim) first: a colwise split keeps whole heads
    text = (pathlib.Path(__file__).resolve().parent / "fixtures" / "tp" / "gpt-neox-tiny.plan").read_text()
    assert _codes(text, graphs["gpt-neox-tiny"]) == []


def test_first_uses_reads_the_forward(graphs):
    uses = first_uses(graphs["phi3-tiny"].model, ["model.layers.0.mlp.gate_up_proj", "model.layers.0.self_attn.qkv_proj"])
    assert uses["model.layers.0.mlp.gate_up_proj"].cut and uses["model.layers.0.self_attn.qkv_proj"].cut
    uses = first_uses(graphs["gpt-neox-tiny"].model, ["gpt_neox.layers.0.attention.query_key_value"])
    assert uses["gpt_neox.layers.0.attention.query_key_value"].op == "view.default"
    assert not uses["gpt_neox.layers.0.attention.query_key_value"].cut


# ----------------------------------------------------------------- P418: the fix from the layout chain


def _without(text: str, pattern: str) -> str:
    return "\n".join(ln for ln in text.splitlines() if not re.search(pattern, ln)) + "\n"


def test_p418_forgotten_rowwise_partner_gets_rowwise(graphs):
    text = _without((ROOT / "plans/llama-tp.plan").read_text(), r"o_proj rowwise")
    found = [d for d in _diags(text, graphs["llama-tiny"]) if d.code == "P418"]
    assert len(found) == 1 and "`parallel model.layers.*.self_attn.o_proj rowwise`" in found[0].help[0]
    assert "o_proj replicate`" not in found[0].help[0]


def test_p418_forgotten_projection_beside_split_ones_gets_colwise(graphs):
    text = (ROOT / "plans/llama-tp.plan").read_text().replace("{q_proj,k_proj,v_proj} colwise", "{q_proj,k_proj} colwise")
    found = [d for d in _diags(text, graphs["llama-tiny"]) if d.code == "P418"]
    assert len(found) == 1 and "`parallel model.layers.*.self_attn.v_proj colwise`" in found[0].help[0]


def test_p418_forgotten_per_head_norm_gets_the_reducing_form(graphs):
    text = _without(P423_PLAN, r"q_norm")
    found = [d for d in _diags(text, graphs["qwen3-tiny"]) if d.code == "P418"]
    assert len(found) == 1
    assert f"`parallel model.layers.*.self_attn.{{q_norm,k_norm}} {REDUCING}`" in found[0].help[0]
    assert "q_norm replicate`" not in found[0].help[0]


def test_p418_silent_for_a_module_whose_own_rule_has_an_error(graphs):
    fixed = P423_PLAN.replace("self_attn.{q_norm,k_norm} replicate", "self_attn.{q_norm,k_norm} sequense")
    assert _codes(fixed, graphs["qwen3-tiny"]) == ["P107"]  # the typo, and nothing that contradicts its fix
    fixed = P423_PLAN.replace("self_attn.{q_norm,k_norm} replicate", "self_attn.{q_norm,k_norm} sequence { sequence_dim x }")
    assert _codes(fixed, graphs["qwen3-tiny"]) == ["P108"]


def test_p418_block_norms_still_get_replicate(graphs):
    text = _without((ROOT / "plans/llama-tp.plan").read_text(), r"norm")
    helps = " ".join(d.help[0] for d in _diags(text, graphs["llama-tiny"]) if d.code == "P418")
    assert "`parallel model.norm replicate`" in helps
    assert "`parallel model.layers.*.input_layernorm replicate`" in helps
