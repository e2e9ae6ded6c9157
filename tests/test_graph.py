"""The model graph: order, subtrees, tied parameters, sizes (no values read; meta models)."""

from __future__ import annotations

import torch
from torch import nn

from planc import zoo
from planc.model.graph import ModelGraph


def gpt() -> ModelGraph:
    return ModelGraph.from_module(zoo.gpt_tiny())


def test_modules_in_registration_preorder():
    g = gpt()
    model = zoo.gpt_tiny()
    assert list(g.modules) == [n for n, _ in model.named_modules()]
    assert g.modules[0] == "" and len(g) == len(g.modules)


def test_children_and_names():
    g = gpt()
    assert g.children("") == ["wte", "wpe", "blocks", "ln_f", "lm_head"]
    assert g.child_names("blocks") == ["0", "1"]
    assert g.children("blocks.0.mlp") == ["blocks.0.mlp.w_in", "blocks.0.mlp.act", "blocks.0.mlp.w_out"]


def test_tied_weight_is_one_node_with_two_owners():
    g = gpt()
    assert "lm_head.weight" not in g.params
    assert g.aliases["lm_head.weight"] == "wte.weight"
    assert g.owners("wte.weight") == ["wte", "lm_head"]
    assert g.tied == {"wte.weight": ["wte", "lm_head"]}
    assert g.own_params("lm_head") == [("weight", "wte.weight")]


def test_subtree_numel_counts_tied_once():
    g = gpt()
    model = zoo.gpt_tiny()
    assert g.subtree_numel[""] == sum(p.numel() for p in model.parameters()) == g.numel
    assert g.subtree_numel["lm_head"] == g.params["wte.weight"].numel
    assert g.subtree_numel["blocks"] == sum(p.numel() for p in model.blocks.parameters())


def test_subtree_and_params():
    g = gpt()
    assert list(g.subtree("blocks.0.attn")) == ["blocks.0.attn", "blocks.0.attn.qkv", "blocks.0.attn.proj"]
    assert g.subtree_size("blocks") == 1 + 2 * 10  # a GPTBlock is 10 modules
    assert g.subtree_params("blocks.1.attn") == {"blocks.1.attn.qkv.weight", "blocks.1.attn.qkv.bias",
                                                 "blocks.1.attn.proj.weight", "blocks.1.attn.proj.bias"}
    assert g.subtree_params("") == set(g.params)
    assert g.is_within("blocks.1.mlp.w_in", "blocks.1") and not g.is_within("blocks.1", "blocks.1.mlp")
    assert g.is_within("blocks", "blocks") and g.is_within("lm_head", "")


def test_post_order_is_children_first():
    g = gpt()
    for m in g.modules:
        for c in g.children(m):
            assert g.post(c) < g.post(m)
    assert g.post("") == len(g) - 1
    assert sorted(g.modules, key=g.post)[:2] == ["wte", "wpe"]


def test_containers_have_no_forward():
    g = gpt()
    assert not g.has_forward("blocks") and g.has_forward("blocks.0") and g.cls("blocks") == "ModuleList"
    assert g.qualname("blocks.0") == "planc.zoo.gpt.GPTBlock"


def test_ancestors_nearest_first():
    assert list(gpt().ancestors("blocks.0.mlp.w_in")) == ["blocks.0.mlp", "blocks.0", "blocks", ""]


def test_param_info_shapes_on_meta():
    with torch.device("meta"):
        g = ModelGraph.from_module(zoo.moe_transformer_tiny())
    w1 = g.params["layers.0.moe.experts.w1"]
    assert w1.shape == (4, 32, 64) and w1.numel == 4 * 32 * 64 and w1.nbytes == 4 * w1.numel
    assert w1.dtype == torch.float32 and w1.contiguous and w1.requires_grad


def test_shared_module_registered_twice_is_listed_once():
    shared = nn.Linear(2, 2)
    root = nn.Sequential(shared, nn.ReLU(), shared)
    g = ModelGraph.from_module(root)
    assert list(g.modules) == ["", "0", "1"]  # named_modules() drops the duplicate
    assert set(g.params) == {"0.weight", "0.bias"}


def test_networkx_view_is_the_same_tree():
    g = gpt()
    nxg = g.g
    modules = [n for n, d in nxg.nodes(data=True) if d["kind"] == "module"]
    assert modules == list(g.modules)
    assert {n[1] for n, d in nxg.nodes(data=True) if d["kind"] == "param"} == set(g.params)
    for path in g.modules:
        assert [c for c in nxg.successors(path) if isinstance(c, str)] == g.children(path)
        assert nxg.nodes[path]["post"] == g.post(path) and nxg.nodes[path]["cls"] == g.cls(path)
    assert sorted(nxg.predecessors(("param", "wte.weight")), key=g.pre) == g.owners("wte.weight")
    assert nxg.edges["lm_head", ("param", "wte.weight")]["name"] == "weight"
    assert "blocks.0.mlp" in g and "blocks.9" not in g and ("param", "wte.weight") not in g
