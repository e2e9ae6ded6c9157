"""`planc import --hf-tp-plan`: a Hugging Face model's own tensor-parallel plan becomes `parallel` statements.

The reference for what Hugging Face's plan means is transformers' own style registry
(`ALL_PARALLEL_STYLES`: each style's input and output layouts and `use_local_output`): every
module the Hugging Face plan names gets, in the compiled program, a `Parallelize` op whose torch
style has those layouts. tests/test_plans_tp_dist.py also runs an imported plan against Hugging
Face's own `apply_tensor_parallelism` on real ranks.
"""

from __future__ import annotations

import fnmatch
import json
import os
import pathlib

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers")

import planc  # noqa: E402
from planc import cli  # noqa: E402
from planc.backends.runtime import torch_style  # noqa: E402
from planc.lang.fmt import format_plan  # noqa: E402
from planc.lower.program import Parallelize  # noqa: E402
from planc.model.build import build_model  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
QWEN3 = f"hf:{ROOT / 'tests' / 'fixtures' / 'qwen3-tiny' / 'config.json'}"
# mixtral-tiny with a tensor-parallel plan naming the fused experts (packed_colwise on
# gate_up_proj, as transformers 5.24's Mixtral plan did; 5.25 dropped the expert entries)
# and the expert-parallel and per-parameter styles planc leaves out
MIXTRAL_TP = f"hf:{ROOT / 'tests' / 'fixtures' / 'mixtral-tp-tiny' / 'config.json'}"


def imported(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["import", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _hf_modules(model, key: str) -> list[str]:
    parts = key.split(".")
    return [n for n, _ in model.named_modules() if n and len(n.split(".")) == len(parts)
            and all(fnmatch.fnmatchcase(a, b) for a, b in zip(n.split("."), parts))]


def _layouts(style) -> tuple:
    """(kind, input layout, output layout, use_local_output) of a torch or Hugging Face style object."""
    from torch.distributed.tensor import Replicate, Shard

    name = type(style).__name__
    if name == "EmbeddingParallel":  # HF's embedding styles: token ids replicated, output gathered
        return ("rowwise" if style.shard_dim == 0 else "colwise", Replicate(), Replicate(), style.use_local_output)
    if name == "SequenceParallel":
        dim = style.sequence_sharding[0] if hasattr(style, "sequence_sharding") else Shard(style.sequence_dim)
        return ("sequence", dim, None, style.use_local_output)
    if name in ("ReplicateParallel", "TensorParallelLayer"):
        return ("replicate", None, None, None)

    def one(x):
        return x[0] if isinstance(x, tuple) else x
    kind = "colwise" if "Colwise" in name else "rowwise"
    return (kind, one(style.input_layouts), one(style.output_layouts), style.use_local_output)


@pytest.mark.parametrize("ref", ["hf:llama-tiny", "hf:mixtral-tiny", QWEN3])
def test_imported_plan_means_what_the_hugging_face_plan_means(capsys, tmp_path, ref):
    from torch.distributed.tensor import Shard
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    from planc.importers.hf_tp import STYLES, hf_tp_plan

    out = tmp_path / "tp.plan"
    code, _, err = imported(capsys, "--model", ref, "--hf-tp-plan", "-o", str(out))
    assert code == 0, err
    text = out.read_text()
    assert format_plan(text, str(out)) == text  # already formatted
    assert "mesh (shard = *, tensor = 2)" in text
    model = build_model(ref)
    compiled = planc.compile(planc.load(out), model, 4)
    assert not compiled.errors, compiled.errors
    ops = {op.module: op for op in compiled.program.ops if isinstance(op, Parallelize)}
    for key, style in hf_tp_plan(model).items():
        modules = _hf_modules(model, key)
        if style not in STYLES or not modules:
            assert f"# not imported: {key} {style}" in text  # said so, in the plan
            continue
        for name in modules:
            got = _layouts(torch_style(ops[name].style))
            if style == "replicated_with_grad_allreduce":
                # a replicated weight whose gradient is summed over tp: SequenceParallel on the head dim
                # does that (tests/test_plans_tp_dist.py trains it against one process)
                assert got == ("sequence", Shard(2), None, True), name
            else:
                assert got == _layouts(ALL_PARALLEL_STYLES[style]), (name, style)
    # every parameter ends up on the tensor axis: each module owning one has a style that places it
    placing = {m for m, op in ops.items() if op.style.kind not in ("prepare_input", "prepare_output", "prepare")}
    for pname, _ in model.named_parameters():
        owner = pname.rpartition(".")[0]
        assert any(owner == m or owner.startswith(m + ".") for m in placing), pname


def test_llama_import_is_the_shipped_llama_tp_plan_in_substance(capsys):
    code, text, _ = imported(capsys, "--model", "hf:llama-tiny", "--hf-tp-plan")
    assert code == 0
    ours = planc.compile(planc.loads(text), build_model("hf:llama-tiny"), 4)
    shipped = planc.compile(planc.load(ROOT / "plans" / "llama-tp.plan"), build_model("hf:llama-tiny"), 4)

    def styles(c):
        return {op.module: op.style for op in c.program.ops if isinstance(op, Parallelize)}
    assert styles(ours) == styles(shipped)


def test_unsupported_styles_are_left_out_with_a_located_warning(capsys):
    code, text, err = imported(capsys, "--model", MIXTRAL_TP, "--hf-tp-plan")
    assert code == 0
    assert "warning[P457]: `model.layers.*.mlp.experts.gate_up_proj: packed_colwise` not imported" in err
    line = text.splitlines().index("# not imported: model.layers.*.mlp.experts.gate_up_proj packed_colwise") + 1
    assert f"<imported plan>:{line}:1" in err
    assert "parallel model.layers.*.mlp.{gate,experts} replicate" in text  # experts FSDP-only, on the tensor axis


def test_a_model_without_a_plan_is_an_error(capsys):
    code, text, err = imported(capsys, "--model", "hf:gpt2-tiny", "--hf-tp-plan")
    assert code == 1 and text == ""
    assert "error[P458]: `hf:gpt2-tiny` has no Hugging Face tensor-parallel plan" in err


def test_tied_embeddings_are_warned_about(capsys, tmp_path):
    config = json.loads((ROOT / "planc" / "model" / "configs" / "llama-tiny.json").read_text())
    config["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = imported(capsys, "--model", f"hf:{tmp_path / 'config.json'}", "--hf-tp-plan")
    assert "warning[P459]: `model.embed_tokens.weight` and `lm_head.weight` are tied" in err


def test_with_an_accelerate_config_the_mesh_gains_the_tensor_axis(capsys, tmp_path):
    pytest.importorskip("yaml")
    cfg = tmp_path / "accelerate.yaml"
    cfg.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
                   "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n  fsdp_sharding_strategy: FULL_SHARD\n")
    out = tmp_path / "plan.plan"
    code, _, err = imported(capsys, str(cfg), "--model", "hf:llama-tiny", "--hf-tp-plan", "--tensor", "2", "-o", str(out))
    assert code == 0, err
    text = out.read_text()
    assert "mesh (replicate = 1, shard = *, tensor = 2)" in text and "unit ** : LlamaDecoderLayer" in text
    assert "parallel model.layers.*.self_attn.o_proj rowwise" in text
    assert cli.main(["check", str(out), "--world-size", "8"]) == 0
    # at tensor = 4 the import checks what it wrote and says why it cannot run (2 KV heads)
    code, _, err = imported(capsys, str(cfg), "--model", "hf:llama-tiny", "--hf-tp-plan", "--tensor", "4", "-o", str(out))
    assert code == 1 and "error[P412]" in err


@pytest.mark.parametrize("args", [[], ["--hf-tp-plan"], ["--model", "hf:llama-tiny", "--hf-tp-plan", "--tensor", "0"]])
def test_usage_errors(capsys, args):
    code, _, err = imported(capsys, *args)
    assert code == 2 and "planc: error:" in err and "Traceback" not in err
