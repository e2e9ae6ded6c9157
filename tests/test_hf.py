"""Hugging Face models on meta: shipped configs build offline, shipped plans compile against them.

Also pins the Llama plan to torchtitan's unit structure and checks the "did you mean"
diagnostics for misspelled module paths, class names and config names.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # must hold before transformers is imported
pytest.importorskip("transformers")

import planc  # noqa: E402
from planc import cli  # noqa: E402
from planc.model.build import ModelLoadError, build_model  # noqa: E402
from planc.model.hf import build_hf_model, shipped_configs  # noqa: E402

# plan -> (realistic config, its unit count, tiny config, its unit count)
PLANS = {
    "llama": ("llama-3-8b", 35, "llama-tiny", 5),
    "mixtral": ("mixtral-8x7b", 35, "mixtral-tiny", 5),
    "gpt2": ("gpt2", 14, "gpt2-tiny", 4),
    "t5": ("t5-base", 25, "t5-tiny", 5),
    "bert": ("bert-base", 13, "bert-tiny", 3),
}

# Published parameter counts of the realistic configs (tied weights counted once).
PUBLISHED_NUMEL = {
    "llama-3-8b": 8_030_261_248,
    "mixtral-8x7b": 46_702_792_704,
    "gpt2": 124_439_808,
    "t5-base": 222_903_552,
}


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = build_model(f"hf:{name}")
        return cache[name]
    return get


@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_shipped_config_builds_on_meta(name, models):
    start = time.perf_counter()
    model = models(name)
    params = list(model.parameters())
    assert params and all(p.device.type == "meta" and p.dtype == torch.float32 for p in params)
    assert time.perf_counter() - start < 20  # no weights, no hub: seconds even for 47B params
    if name in PUBLISHED_NUMEL:
        assert sum(p.numel() for p in params) == PUBLISHED_NUMEL[name]


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_plan_checks_clean_against_realistic_and_tiny(plan, root, models, capsys):
    big, big_units, tiny, tiny_units = PLANS[plan]
    path = str(root / "plans" / f"{plan}.plan")
    assert cli.main(["check", path, "--world-size", "8", "64"]) == 0
    assert cli.main(["check", path, "--model", f"hf:{tiny}", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert f"ok ({big_units} units)" in out and f"ok ({tiny_units} units)" in out
    for name, count, world in ((big, big_units, 64), (tiny, tiny_units, 2)):
        compiled = planc.compile(path, models(name), world)
        assert len(compiled.units) == count and compiled.units[-1].is_root
        assert not compiled.diagnostics
        # every parameter is managed by exactly one unit
        owned = [p for u in compiled.units for p in u.params]
        assert sorted(owned) == sorted(compiled.graph.params)


@pytest.mark.parametrize("config,layers", [("llama-3-8b", 32), ("llama-tiny", 2)])
def test_llama_plan_is_torchtitans_recipe(root, models, config, layers):
    compiled = planc.compile(str(root / "plans" / "llama.plan"), models(config), 8)
    expected = ([("model.embed_tokens",)] + [(f"model.layers.{i}",) for i in range(layers)]
                + [("model.norm", "lm_head"), ("",)])
    assert [u.modules for u in compiled.units] == expected
    for unit in compiled.units:
        assert unit.settings["param_dtype"].value == torch.bfloat16
        assert unit.settings["reduce_dtype"].value == torch.float32
        assert unit.settings["cast_inputs"].value is False
        # torchtitan: blocks and embedding reshard; the [norm, output] tail and the root do not
        assert compiled.program.unit(unit.name).policy.reshard_after_forward is (unit.modules[0].startswith("model.embed_tokens")
                                              or unit.modules[0].startswith("model.layers."))
        assert unit.settings["offload"].value is False


def test_mixtral_experts_shard_on_dim_1(root, models):
    model = models("mixtral-8x7b")
    compiled = planc.compile(str(root / "plans" / "mixtral.plan"), model, 64)
    experts = {n: p for n, p in model.named_parameters() if ".mlp.experts." in n}
    assert len(experts) == 2 * 32
    # transformers 5 fuses the experts: (num_experts, out, in); dim 0 is the 8 experts
    assert all(p.shape[0] == 8 and p.shape[1] % 64 == 0 for p in experts.values())
    assert {n: d for n, (d, _) in compiled.resolution.placements.items()} == {n: 1 for n in experts}
    # a shard size that does not divide dim 1 is refused before any job starts
    bad = planc.compile(str(root / "plans" / "mixtral.plan"), models("mixtral-tiny"), 3, strict=False)
    assert "P404" in {d.code for d in bad.errors}


def test_gpt2_tied_embedding_is_one_unit(root, models):
    compiled = planc.compile(str(root / "plans" / "gpt2.plan"), models("gpt2-tiny"), 2)
    group = compiled.unit("[transformer.wte, transformer.ln_f, lm_head]")
    assert "transformer.wte.weight" in group.params
    assert compiled.graph.tied == {"transformer.wte.weight": ["transformer.wte", "lm_head"]}
    split = planc.compile(planc.loads("unit transformer.wte\n"), models("gpt2-tiny"), 2, strict=False)
    assert [d.code for d in split.errors] == ["P301"]


def test_t5_shared_embedding_stays_in_root(root, models):
    compiled = planc.compile(str(root / "plans" / "t5.plan"), models("t5-tiny"), 2)
    assert set(compiled.graph.tied["shared.weight"]) == {"shared", "encoder.embed_tokens",
                                                         "decoder.embed_tokens", "lm_head"}
    assert "shared.weight" in compiled.units[-1].params


def test_misspelled_path_and_class_suggest_the_real_names(tmp_path, capsys):
    plan = tmp_path / "bad.plan"
    plan.write_text("model hf:llama-tiny\nunit model.layer.*\nunit model.layers.* : LLaMADecoderLayer\n")
    assert cli.main(["check", str(plan)]) == 1
    out = capsys.readouterr().out
    assert "error[P201]: selector `model.layer.*` matches no module" in out
    assert "help: did you mean `layers`?" in out
    assert "error[P202]: no module of the model is a `LLaMADecoderLayer`" in out
    assert "help: did you mean `LlamaDecoderLayer`?" in out


def test_misspelled_config_name_suggests_shipped_config(tmp_path, capsys):
    plan = tmp_path / "bad.plan"
    plan.write_text("model hf:lama-tiny\nunit model.layers.*\n")
    assert cli.main(["check", str(plan)]) == 1
    out = capsys.readouterr().out
    assert "error[P106]" in out and "did you mean the shipped config `llama-tiny`?" in out


def test_relative_config_path_starts_at_the_plan(tmp_path, monkeypatch, capsys):
    (tmp_path / "cfg").mkdir()
    shutil.copy(shipped_configs()["llama-tiny"], tmp_path / "cfg" / "config.json")
    (tmp_path / "plans").mkdir()
    plan = tmp_path / "plans" / "mine.plan"
    plan.write_text("model hf:../cfg/config.json\nunit model.layers.*\nexpect units == 3\n")
    monkeypatch.chdir(tmp_path / "cfg")  # anywhere but the plan's folder
    assert cli.main(["check", str(plan)]) == 0
    assert "ok (3 units)" in capsys.readouterr().out
    # a folder holding config.json works too, and an absolute path from anywhere
    assert build_hf_model(str(tmp_path / "cfg")).config.num_hidden_layers == 2


def test_bad_configs_are_load_errors_not_tracebacks(tmp_path):
    bad_json = tmp_path / "a.json"
    bad_json.write_text("{not json")
    no_type = tmp_path / "b.json"
    no_type.write_text(json.dumps({"hidden_size": 8}))
    typo = tmp_path / "c.json"
    typo.write_text(json.dumps({"model_type": "lama"}))
    arch = tmp_path / "d.json"
    arch.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLN"]}))
    messages = {}
    for path in (bad_json, no_type, typo, arch):
        with pytest.raises(ModelLoadError) as err:
            build_hf_model(str(path))
        messages[path.name] = str(err.value)
    assert "cannot read" in messages["a.json"]
    assert "no `model_type`" in messages["b.json"]
    assert "did you mean `llama`?" in messages["c.json"]
    assert "did you mean `LlamaForCausalLM`?" in messages["d.json"]


def test_missing_config_help_says_where_relative_paths_start(tmp_path, capsys):
    """P106 for a missing `hf:` config explains the plan-relative path, not package installs."""
    (tmp_path / "plans").mkdir()
    plan = tmp_path / "plans" / "mine.plan"
    plan.write_text("model hf:cfg/config.json\nunit model.layers.*\n")
    assert cli.main(["check", str(plan)]) == 1
    out = capsys.readouterr().out
    assert "error[P106]" in out and "starts from the plan's own folder" in out and "installed" not in out


def test_the_view_tensor_warning_comes_from_the_gathered_logits():
    """FSDP2's "returned a view tensor" warning on 2-D Hugging Face plans (issue 20): the root returns
    lm_head's output, and `colwise { output replicate }` hands it on through `DTensor.to_local()`,
    a view. A 1-D plan's logits are no view; docs/language.md#parallel explains what to avoid."""
    import warnings

    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from planc.analysis.simulate import fake_step_inputs, init_fake
    from planc.backends.runtime import build_mesh
    seen = {}
    for name in ("llama-tp.plan", "llama.plan"):
        init_fake(4)
        try:
            with torch.device("meta"):
                model = build_model("hf:llama-tiny")
            model.config.use_cache = False
            text = (pathlib.Path(__file__).resolve().parent.parent / "plans" / name).read_text()
            text = text.replace("model hf:llama-3-8b", "model hf:llama-tiny")
            compiled = planc.compile(planc.loads(text), model, 4)
            planc.apply(model, compiled, mesh=build_mesh(compiled.mesh, 4, "cpu"))
            with FakeTensorMode(allow_non_fake_inputs=True) as fake, warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                example = fake_step_inputs(model, lambda m: (torch.randint(0, 64, (2, 16)),), fake)
                logits = model(*example.args).logits
                seen[name] = (logits._base is not None, any("returned a view tensor" in str(x.message) for x in w))
        finally:
            dist.destroy_process_group()
    assert seen == {"llama-tp.plan": (True, True), "llama.plan": (False, False)}
