"""Traced steps with runs of identical blocks written out (planc/estimate/repeat.py).

A restored trace must equal the full trace event for event: every live byte, gradient byte,
unit, module name and reduce-scattered parameter list. Checked on planc's Llama, GPT and
MoE models, a Hugging Face Llama, with mixed checkpointing, mixed precision, tensor
parallelism and a model whose forward indexes its blocks by position (traced in full).
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
from torch import nn

import planc
from planc import zoo
from planc.compiler import CompiledPlan
from planc.estimate import repeat
from planc.estimate.trace import default_input, fake_trace
from planc.model.graph import ModelGraph

ROOT = pathlib.Path(__file__).resolve().parent.parent


def both(model: nn.Module, text: str, shape=(2, 16), world=8, tp=1):
    graph = ModelGraph.from_module(model)
    compiled = CompiledPlan(planc.loads(text), graph, world, check_memory=False)
    assert not [d for d in compiled.diagnostics if d.severity == "error"]
    inputs = default_input(model, shape)
    return compiled, fake_trace(compiled, inputs, tp=tp), fake_trace(compiled, inputs, tp=tp, repeat=True)


def llama(n=7):
    return zoo.llama(dataclasses.replace(zoo.LLAMA_TINY_CONFIG, n_layers=n))


BF16 = "defaults {\n  precision param = bf16, reduce = fp32\n}\n"


@pytest.mark.parametrize("body", [
    "unit layers.*\n",
    BF16 + "unit tok_embeddings\nunit layers.*\nunit [norm, output]\n",
    BF16 + "unit layers.*\ncheckpoint layers[0:6] full\ncheckpoint layers[8:14] selective\n",
    "unit layers.*\ncheckpoint layers.* full\n",
])
def test_restored_trace_equals_the_full_trace(body):
    compiled, full, short = both(llama(14), "model planc.zoo:llama\nmesh (shard = *)\n" + body)
    assert repeat.find_runs(compiled), "the test must exercise a run"
    assert short.events == full.events


def test_runs_split_where_blocks_differ():
    text = "model planc.zoo:llama\nmesh (shard = *)\nunit layers.*\ncheckpoint layers[0:6] full\n"
    compiled, full, short = both(llama(13), text)
    runs = repeat.find_runs(compiled)
    assert [len(r.keys) for r in runs] == [6, 7]  # checkpointed and not: two runs
    assert short.events == full.events


@pytest.mark.parametrize("make,body", [
    (lambda: zoo.gpt(dataclasses.replace(zoo.GPT_TINY_CONFIG, n_layers=6)), "unit blocks.*\n"),
    (lambda: zoo.moe_transformer(dataclasses.replace(zoo.MOE_TINY_CONFIG, n_layers=6)), "unit layers.*\n"),
])
def test_other_zoo_models(make, body):
    compiled, full, short = both(make(), "model x:y\nmesh (shard = *)\n" + body)
    assert repeat.find_runs(compiled)
    assert short.events == full.events


def hf_llama(layers: int) -> nn.Module:
    """transformers' LlamaForCausalLM at the shipped tiny config with `layers` decoder layers, on meta."""
    pytest.importorskip("transformers")
    from planc.model import hf
    config = hf.load_config(hf.config_path("llama-tiny"))
    config.num_hidden_layers = layers
    with torch.device("meta"):
        return hf.model_class(config)._from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def test_hugging_face_llama():
    model = hf_llama(6)
    compiled, full, short = both(model, planc.load(ROOT / "plans" / "llama.plan").sources[0][1])
    assert repeat.find_runs(compiled)
    assert short.events == full.events


def test_tensor_parallel_step():
    text = (ROOT / "plans" / "zoo-llama-tp.plan").read_text()
    compiled, full, short = both(llama(6), text, world=8, tp=2)
    assert repeat.find_runs(compiled)
    assert short.events == full.events


class Indexed(nn.Module):
    """A forward that indexes its blocks by position: the short container breaks it."""

    def __init__(self, n=6):
        super().__init__()
        self.n = n
        self.emb = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(n))

    def forward(self, x):
        h = self.emb(x)
        for i in range(self.n):
            h = self.layers[i](h)
        return h


def test_a_forward_that_indexes_its_blocks_is_traced_in_full():
    compiled, full, short = both(Indexed(), "model x:y\nmesh (shard = *)\nunit layers.*\n")
    assert repeat.find_runs(compiled)
    assert short.events == full.events


def test_short_runs_and_merged_units_are_not_cut():
    graph = ModelGraph.from_module(llama(4))
    compiled = CompiledPlan(planc.loads("model x:y\nmesh (shard = *)\nunit layers.*\n"), graph, 8, check_memory=False)
    assert repeat.find_runs(compiled) == []  # 4 blocks: nothing to write out
    graph = ModelGraph.from_module(llama(10))
    text = "model x:y\nmesh (shard = *)\nunit [layers.0, layers.1]\nunit [layers.2, layers.3]\nunit layers[4:]\n"
    compiled = CompiledPlan(planc.loads(text), graph, 8, check_memory=False)
    assert [r.keys for r in repeat.find_runs(compiled)] == [tuple(str(i) for i in range(4, 10))]


def test_blocks_that_are_not_copies_are_traced_in_full(monkeypatch):
    """A fault injected into the short step (one op of the third traced block 4 bytes larger):
    `restore` refuses it and the step is traced in full, equal to the full trace."""
    restore, seen = repeat.restore, []

    def faulty(events, runs, units):
        name = units[runs[0].units[-2]].name
        k = next(i for i, e in enumerate(events) if e.kind == "op" and e.where == name)
        events[k] = dataclasses.replace(events[k], live=events[k].live + 4)
        seen.append(restore(events, runs, units))
        return seen[-1]
    monkeypatch.setattr(repeat, "restore", faulty)
    compiled, full, short = both(llama(7), "model x:y\nmesh (shard = *)\nunit layers.*\n")
    assert seen == [None]
    assert short.events == full.events


# ----------------------------------------------------------------- the compute profile
def profiles(model, shape=(2, 16)):
    from planc.estimate.flops import _PROFILES, step_profile
    graph = ModelGraph.from_module(model)
    full = step_profile(graph, input_shape=shape, dtype=torch.bfloat16)
    _PROFILES.pop(graph)
    return graph, full, step_profile(graph, input_shape=shape, dtype=torch.bfloat16, repeat=True)


@pytest.mark.parametrize("make", [
    lambda: llama(9),
    lambda: zoo.gpt(dataclasses.replace(zoo.GPT_TINY_CONFIG, n_layers=6)),
    lambda: zoo.moe_transformer(dataclasses.replace(zoo.MOE_TINY_CONFIG, n_layers=6)),
    lambda: Indexed(),
], ids=["llama", "gpt", "moe", "indexed"])
def test_restored_profile_equals_the_full_profile(make):
    graph, full, short = profiles(make())
    assert repeat.module_runs(graph.model, graph.aliases)
    assert short == full


def test_restored_profile_of_hugging_face_llama():
    model = hf_llama(6)
    graph, full, short = profiles(model)
    # FlopCounterMode's module tracker gives every layer's attention backward to the last
    # layer's attention here, so the blocks differ and the profile is taken in full
    assert full.backward["model.layers.5.self_attn"] != full.backward.get("model.layers.4.self_attn", 0)
    assert short == full
