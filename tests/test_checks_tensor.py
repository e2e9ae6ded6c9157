"""Static tensor-parallel checks (planc/checks/tensor.py): each check alone on a context, the
plans that must stay clean, and the cascades the checks must not produce.

The goldens in tests/ui/p41*.plan and p42*.plan show the rendered diagnostics; these tests
pin what each check decides (code, severity, which modules, which line) on small variations
of one plan, so a wrong decision fails here with a readable diff.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch import nn
from ui_models import TPNet, tp_net

import planc
from planc.checks import tensor
from planc.checks.context import Context
from planc.model.graph import ModelGraph
from planc.model.hf import build_hf_model
from planc.resolve.resolver import resolve

ROOT = pathlib.Path(__file__).resolve().parent.parent
TP_NET_PLAN = (ROOT / "tests/fixtures/tp/tp_net.plan").read_text()
TP_NET_BODY = TP_NET_PLAN.split("\n", 2)[2]  # without the comment and the model line
LLAMA_TP = (ROOT / "plans/llama-tp.plan").read_text()


@pytest.fixture(scope="module")
def llama_graph():
    return ModelGraph.from_module(build_hf_model("llama-tiny"))


def _diags(text: str, model, world: int | None = None):
    graph = model if isinstance(model, ModelGraph) else ModelGraph.from_module(model)
    compiled = planc.compile(planc.loads(text, filename="t.plan"), graph, world_size=world, strict=False,
                             check_memory=False)
    return compiled.diagnostics


def _codes(text: str, model, world: int | None = None) -> list[str]:
    return [d.code for d in _diags(text, model, world)]


def _line(text: str, d) -> str:
    """The plan line a diagnostic points at."""
    return text.splitlines()[d.span.line - 1]


def _context(text: str, model, world: int | None = None) -> Context:
    plan = planc.loads(text, filename="t.plan")
    graph = ModelGraph.from_module(model)
    res, _ = resolve(plan, graph)
    return Context(plan, graph, res, world)


# ----------------------------------------------------------------- plans that must stay clean


def test_shipped_llama_tp_plan_is_clean(llama_graph):
    assert _diags(LLAMA_TP, llama_graph) == []


def test_torchtitan_llama3_tp_plan_is_clean():
    # torchtitan's own apply_tp recipe (sequence + loss parallel) on torchtitan 0.3.0's Llama 3
    from planc.model.torchtitan import llama3_debugmodel
    with torch.device("meta"):
        model = llama3_debugmodel()
    compiled = planc.compile(ROOT / "tests/fixtures/tp/torchtitan_llama3_tp.plan", model, check_memory=False)
    assert compiled.diagnostics == []
    assert {s.value.kind for s in compiled.resolution.parallel.values()} == {
        "rowwise", "colwise", "sequence", "prepare_input"}


def test_torchtitan_heads_behind_the_fused_qkv_projection():
    # torchtitan 0.3.0 splits q, k, v in one `qkv_linear.wqkv`; the heads are its GQAttention's
    from planc.model.torchtitan import llama3_debugmodel
    with torch.device("meta"):
        model = llama3_debugmodel()  # 16 heads, 16 KV heads
    text = (ROOT / "tests/fixtures/tp/torchtitan_llama3_tp.plan").read_text().replace("tensor = 2", "tensor = 32")
    found = [d for d in _diags(text, model) if d.code in ("P411", "P412")]
    assert [(d.code, "`layers.*.attention`" in d.message) for d in found] == [("P411", True), ("P412", True)]
    assert _line(text, found[0]) == "parallel layers.*.attention.qkv_linear.wqkv colwise"


def test_torchtitan_style_plan_on_the_ui_net_is_clean():
    assert _diags(TP_NET_PLAN, tp_net()) == []


# ----------------------------------------------------------------- P410


def test_p410_tensor_written_first_is_an_error_with_the_reordered_mesh():
    text = TP_NET_PLAN.replace("mesh (shard = *, tensor = 2)", "mesh (tp = 2, fsdp = *)")
    (d,) = [d for d in _diags(text, tp_net()) if d.code == "P410"]
    assert d.is_error and d.span.line == 4
    assert "`mesh (fsdp = *, tp = 2)`" in d.help[0]


def test_p410_needs_no_model():
    ctx = _context("mesh (tensor = 2, replicate = 2, shard = *)\n", nn.Linear(2, 2))
    assert [d.code for d in tensor.check_tensor_last(ctx)] == ["P410"]
    ctx = _context("mesh (replicate = 2, shard = *, tensor = 2)\n", nn.Linear(2, 2))
    assert list(tensor.check_tensor_last(ctx)) == []


# ----------------------------------------------------------------- P411 / P412


def test_heads_come_from_torchtitan_attributes_and_the_hf_config(llama_graph):
    assert tensor.attention_heads(llama_graph.module("model.layers.0.self_attn")) == (4, 2)
    assert tensor.attention_heads(TPNet(n_heads=6, n_kv_heads=3, dim=24).layers[0].attention) == (6, 3)
    assert tensor.attention_heads(nn.MultiheadAttention(8, 2)) == (2, 2)
    assert tensor.attention_heads(nn.Linear(2, 2)) is None


class _BareAttention(nn.Module):
    """Keeps only `head_dim` (and optionally `num_key_value_groups`), as some HF modules do."""

    def __init__(self, groups: int | None = None) -> None:
        super().__init__()
        self.head_dim = 4
        if groups:
            self.num_heads, self.num_key_value_groups = 8, groups
        self.q_proj, self.k_proj = nn.Linear(32, 32), nn.Linear(32, 8)


def test_heads_from_head_dim_and_groups():
    assert tensor.attention_heads(_BareAttention()) == (8, 2)      # 32 / 4 and 8 / 4
    assert tensor.attention_heads(_BareAttention(groups=4)) == (8, 2)  # 8 heads, 4 queries a KV head


@pytest.mark.parametrize("tp,codes", [(2, []), (4, ["P412"]), (8, ["P411", "P412"])])
def test_heads_divisible_by_tp_on_hf_llama(llama_graph, tp, codes):
    found = _codes(LLAMA_TP.replace("tensor = 2", f"tensor = {tp}"), llama_graph)
    assert found == codes  # P413 is not repeated for the attention projections


def test_heads_use_the_tensor_size_filled_from_the_world():
    text = TP_NET_PLAN.replace("mesh (shard = *, tensor = 2)", "mesh (shard = 2, tensor = *)")
    model = TPNet(n_heads=6, n_kv_heads=6, dim=24, hidden=48, vocab=48)
    assert _codes(text, model, world=6) == []
    assert _codes(text, model, world=8) == ["P411", "P412"]
    assert _codes(text, model) == []  # tensor size unknown: nothing to divide


# ----------------------------------------------------------------- P413 / P414 / P419 / P420


def test_p413_uneven_mlp_is_an_error_on_both_layers():
    text = TP_NET_PLAN.replace("tensor = 2", "tensor = 4").replace("loss_parallel", "output replicate")
    found = [d for d in _diags(text, TPNet(n_kv_heads=4, hidden=42, vocab=50)) if d.code == "P413"]
    assert [d.is_error for d in found] == [True, True]
    assert [_line(text, d) for d in found] == ["parallel layers.*.feed_forward.{w1, w3} colwise",
                                               "parallel layers.*.feed_forward.w2 rowwise { output shard(1) }"]
    assert {("out-features (42)" in d.message, "in-features (42)" in d.message) for d in found} == {
        (True, False), (False, True)}
    # the embedding's vocabulary 50 rowwise and the gathered output are uneven too, and fine
    assert not any("vocabulary" in d.message for d in found)
    # colwise outputs kept as DTensors (`local_output false`) know their global shape: no from_local
    kept = text.replace("feed_forward.{w1, w3} colwise", "feed_forward.{w1, w3} colwise { local_output false }")
    assert not any(d.code == "P413" for d in _diags(kept, TPNet(n_kv_heads=4, hidden=42, vocab=50)))


def test_p414_uneven_vocabulary_under_loss_parallel_is_a_warning():
    (d,) = _diags(TP_NET_PLAN.replace("tensor = 2", "tensor = 4"), TPNet(n_kv_heads=4, vocab=50))
    assert (d.code, d.severity) == ("P414", "warning")
    assert len(d.help) == 1 and d.help[0].startswith("pad the vocabulary to a multiple of 4")  # one sentence


def test_p412_names_the_one_size_a_prime_head_count_allows(llama_graph):
    """2 KV heads at tensor = 4: the fix is `tensor = 2`, not "a size that divides 2 (2)"."""
    [d] = [d for d in _diags(LLAMA_TP.replace("tensor = 2", "tensor = 4"), llama_graph) if d.code == "P412"]
    assert d.help[0].startswith("use tensor = 2;") and "divides 2 (2)" not in d.help[0]


def test_p419_loss_parallel_off_the_logits():
    text = TP_NET_PLAN.replace("feed_forward.{w1, w3} colwise",
                               "feed_forward.w1 colwise { loss_parallel }\nparallel layers.*.feed_forward.w3 colwise")
    (d,) = _diags(text, TPNet(hidden=48))
    assert d.code == "P419" and "`layers.*.feed_forward.w1`" in d.message and "(64, the size of `tok_embeddings`)" \
        in d.message


def test_p420_colwise_on_a_block_and_no_cascade():
    text = TP_NET_PLAN.replace("parallel layers.*.feed_forward.{w1, w3} colwise",
                               "parallel layers.*.attention_norm colwise")
    text = text.replace("parallel layers.*.{attention_norm, ffn_norm} sequence", "parallel layers.*.ffn_norm sequence")
    found = _diags(text, tp_net())
    assert [d.code for d in found if d.code == "P420"] == ["P420"]
    assert "RMSNorm" in next(d.message for d in found if d.code == "P420")
    # the norm's weight is not reported again as left out of the plan
    assert not any("attention_norm" in d.message for d in found if d.code == "P418")


# ----------------------------------------------------------------- P415


def test_p415_sequence_length_under_sequence_parallel():
    text = TP_NET_PLAN + "expect memory.peak <= 1GiB at world = 4, input = 2x31\n"
    (d,) = _diags(text, tp_net())
    assert d.code == "P415" and d.is_error and "(30 or 32)" in d.help[0]
    assert _line(text, d).startswith("parallel tok_embeddings rowwise") and d.related[0][0].line == text.count("\n")
    assert _codes(text.replace("2x31", "2x32"), tp_net()) == []


def test_p415_needs_sequence_parallel_and_an_input():
    plain = LLAMA_TP + "expect memory.peak <= 1GiB at world = 4, input = 2x31\n"  # no Shard(1) anywhere
    ctx = _context(plain, build_hf_model("llama-tiny"))
    assert list(tensor.check_sequence_length(ctx)) == []
    ctx = _context(TP_NET_PLAN, tp_net())  # sequence parallel, no input shape: nothing to check
    assert list(tensor.check_sequence_length(ctx)) == []


# ----------------------------------------------------------------- P416 / P417


def test_p416_logits_left_sharded(llama_graph):
    (d,) = _diags(LLAMA_TP.replace("parallel lm_head colwise { output replicate }", "parallel lm_head colwise"),
                  llama_graph)
    assert (d.code, d.severity) == ("P416", "warning") and "logits" in d.message
    # with local_output false, still no loss parallel: still left sharded
    (d,) = _diags(LLAMA_TP.replace("{ output replicate }", "{ local_output false }"), llama_graph)
    assert d.code == "P416"


def test_p416_colwise_followed_by_a_non_consumer(llama_graph):
    found = _diags(LLAMA_TP.replace("mlp.down_proj rowwise", "mlp.down_proj replicate"), llama_graph)
    (d,) = [d for d in found if d.code == "P416"]
    assert "`model.layers.*.mlp.down_proj`, is `replicate`" in d.message


def test_p416_consumer_registered_before_the_producer_counts():
    # torchtitan registers w1, w2, w3: w3's consumer w2 comes first in module order
    ctx = _context(TP_NET_PLAN, tp_net())
    assert list(tensor.check_colwise_consumed(ctx)) == []


def test_p422_rowwise_without_a_colwise_producer(llama_graph):
    found = _diags(LLAMA_TP.replace("{q_proj,k_proj,v_proj} colwise", "{q_proj,k_proj,v_proj} replicate"), llama_graph)
    assert [(d.code, d.severity, "`model.layers.*.self_attn.o_proj`" in d.message) for d in found] == [
        ("P422", "warning", True)]
    # an explicit whole input is fine, and so is torchtitan's w2 after w1 (registered before w3)
    assert _codes(LLAMA_TP.replace("{q_proj,k_proj,v_proj} colwise", "{q_proj,k_proj,v_proj} replicate")
                  .replace("self_attn.o_proj rowwise", "self_attn.o_proj rowwise { input replicate }"), llama_graph) == []
    assert list(tensor.check_rowwise_fed(_context(TP_NET_PLAN, tp_net()))) == []


def test_p417_norms_between_sequence_shards():
    text = TP_NET_PLAN.replace("parallel norm sequence", "parallel norm replicate").replace(
        "{attention_norm, ffn_norm} sequence", "attention_norm sequence")
    found = [d for d in _diags(text, tp_net()) if d.code == "P417"]
    assert [(d.is_error, "`norm`" in d.message, "`layers.*.ffn_norm`" in d.message) for d in found] == [
        (True, True, False), (True, False, True)]
    # the replicated norm is pointed at its own line; the unstyled one at the region's line
    assert _line(text, found[0]) == "parallel norm replicate"
    assert _line(text, found[1]).startswith("parallel layers.*.attention prepare_input")
    assert not any(d.code == "P418" for d in _diags(text, tp_net()))


def test_p417_not_for_norms_inside_attention():
    # a Qwen3-style q_norm next to the rowwise `wo { output shard(1) }`: it sees whole tokens
    model = tp_net()
    for layer in model.layers:
        layer.attention.q_norm = nn.RMSNorm(layer.attention.head_dim)
    text = TP_NET_PLAN + "parallel layers.*.attention.q_norm replicate\n"
    # not P417; but it sees 1/tp of the heads (after the colwise wq), and `replicate` would not
    # reduce its gradient: P423 (tests/test_holes_dist.py), fixed by the reducing `sequence` form
    assert _codes(text, model) == ["P423"]
    fixed = TP_NET_PLAN + "parallel layers.*.attention.q_norm sequence { sequence_dim 2; local_output true }\n"
    assert _codes(fixed, model) == []


# ----------------------------------------------------------------- P418 / P421


def test_p418_left_out_norms_suggest_replicate(llama_graph):
    text = "\n".join(ln for ln in LLAMA_TP.splitlines() if "norm" not in ln) + "\n"
    found = _diags(text, llama_graph)
    assert [d.code for d in found] == ["P418", "P418"]
    helps = " ".join(d.help[0] for d in found)
    assert "`parallel model.norm replicate`" in helps
    assert "`parallel model.layers.*.input_layernorm replicate`" in helps


def test_p418_ignores_frozen_and_ignored_parameters(llama_graph):
    text = "\n".join(ln for ln in LLAMA_TP.splitlines() if "model.norm" not in ln) + "\nignore model.norm.weight\n"
    assert _codes(text, llama_graph) == []
    with torch.device("meta"):
        model = build_hf_model("llama-tiny")
    model.model.norm.weight.requires_grad_(False)
    text = "\n".join(ln for ln in LLAMA_TP.splitlines() if "model.norm" not in ln) + "\n"
    assert _codes(text, model) == []


def test_p421_tied_weights_need_one_placement():
    tied = TP_NET_PLAN.replace("parallel output colwise { input shard(1); loss_parallel }", "parallel output rowwise")
    (d,) = _diags(tied, TPNet(tied=True))
    assert d.code == "P421" and "Shard(0)" in d.message and "Shard(1)" in d.message
    # embedding rowwise + output colwise both split the vocabulary: fine
    assert _codes(TP_NET_PLAN, TPNet(tied=True)) == []


# ----------------------------------------------------------------- cascades


def test_no_p109_cascade_on_an_invalid_mesh():
    text = ("model hf:llama-tiny\nmesh (shard = *, tensor = *)\nunit model.layers.*\n"
            "parallel model.layers.*.self_attn.q_proj colwise\nparallel lm_head colwise\n")
    assert _codes(text, build_hf_model("llama-tiny")) == ["P405"]
    text = "model hf:llama-tiny\nmesh (shard = *)\nunit model.layers.*\nparallel lm_head colwise\n"
    assert _codes(text, build_hf_model("llama-tiny")) == ["P109"]


def test_no_tensor_checks_when_the_mesh_does_not_fit_the_world(llama_graph):
    text = LLAMA_TP.replace("tensor = 2", "tensor = 8")
    assert _codes(text, llama_graph, world=12) == ["P401"]
    assert _codes(text, llama_graph, world=16) == ["P411", "P412"]


def test_p412_on_qwen3_vl_text_attention_at_tp_8():
    # transformers#48307: Qwen3-VL's text attention, 4 KV heads (8 query heads here), loads at
    # tp = 8 and crashes in forward; the heads come from the text sub-config the module keeps
    model = build_hf_model(str(ROOT / "tests/fixtures/tp/qwen3-vl-tiny.json"))
    text = ("mesh (shard = *, tensor = 8)\nunit model.language_model.layers.*\n"
            "parallel model.language_model.layers.*.self_attn.{q_proj, k_proj, v_proj} colwise\n"
            "parallel model.language_model.layers.*.self_attn.o_proj rowwise\n"
            "parallel model.language_model.layers.*.mlp.{gate_proj, up_proj} colwise\n"
            "parallel model.language_model.layers.*.mlp.down_proj rowwise\n")
    found = [d for d in _diags(text, model) if d.code in ("P411", "P412")]
    assert [(d.code, d.span.line) for d in found] == [("P412", 3)]
    assert "the 4 key/value heads of `model.language_model.layers.*.self_attn` (8 query heads)" in found[0].message
    assert _codes(text.replace("tensor = 8", "tensor = 4"), model).count("P412") == 0


def test_p418_root_parameters_cannot_take_a_style():
    from ui_models import fixture_net
    text = ("mesh (shard = *, tensor = 2)\nunit [tok_embeddings, output]\nparallel tok_embeddings rowwise\n"
            "parallel output colwise { output replicate }\nparallel layers.*.attn.{wq, wk, wv} colwise\n"
            "parallel layers.*.attn.wo rowwise\nparallel layers.*.norm replicate\nparallel norm replicate\n"
            "parallel layers.*.{mlp, experts} replicate\n")
    (d,) = _diags(text, fixture_net())
    assert d.code == "P418" and "`<root>`" in d.message and "(`scale`)" in d.help[0] and "parallel  " not in d.help[0]


def test_loss_parallel_variant_of_the_shipped_plan_is_clean(llama_graph):
    # tests/test_tp_dist.py trains this one on 4 gloo ranks
    assert _diags(LLAMA_TP.replace("parallel lm_head colwise { output replicate }",
                                   "parallel lm_head colwise { loss_parallel }"), llama_graph) == []


HF_SEQUENCE_PARALLEL = """
mesh (shard = *, tensor = 2)
unit model.layers.*
parallel model.embed_tokens rowwise { input replicate; output shard(1) }
parallel model.layers.*.{input_layernorm, post_attention_layernorm} sequence
parallel model.layers.*.self_attn prepare_input {
  input_kwargs hidden_states = shard(1)
  desired_input_kwargs hidden_states = replicate
}
parallel model.layers.*.self_attn.{q_proj, k_proj, v_proj} colwise
parallel model.layers.*.self_attn.o_proj rowwise { output shard(1) }
parallel model.layers.*.mlp prepare_input { input shard(1); desired_input replicate }
parallel model.layers.*.mlp.{gate_proj, up_proj} colwise
parallel model.layers.*.mlp.down_proj rowwise { output shard(1) }
parallel model.norm sequence
parallel lm_head colwise { input shard(1); output replicate }
"""


def test_hf_layout_sequence_parallel_plan(llama_graph):
    # statically sound (HF's Llama derives positions from the embedding output's length, so
    # this is not a plan to train); the attention's input arrives as a keyword
    assert _diags(HF_SEQUENCE_PARALLEL, llama_graph) == []
    found = _diags(HF_SEQUENCE_PARALLEL.replace("model.norm sequence", "model.norm replicate"), llama_graph)
    assert [(d.code, "`model.norm`" in d.message) for d in found] == [("P417", True)]
