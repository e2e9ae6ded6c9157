"""`planc import --hf-ep-plan`: a Hugging Face MoE's own expert-parallel plan becomes `parallel ... expert`.

transformers ships `base_model_ep_plan` with its MoE configs; the experts container it marks
`ep_dispatch_experts` gets planc's `expert` style, the experts' own weights (`grouped_gemm`) are
covered by it, an expert axis is added. The imported plan checks clean; `planc check --verify`
trains it like one process (run here for plans/mixtral-ep.plan, the Mixtral line this writes,
by tests/test_verify.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import planc  # noqa: E402
from planc.cli.main import main as planc_main  # noqa: E402


@pytest.mark.parametrize("ref", ["hf:qwen3-moe-tiny", "hf:mixtral-tiny"])
def test_the_experts_container_gets_the_expert_style(ref, tmp_path, capsys):
    out = tmp_path / "moe.plan"
    assert planc_main(["import", "--hf-ep-plan", "--model", ref, "--expert", "2", "-o", str(out)]) == 0
    text = out.read_text()
    assert "mesh (shard = *, expert = 2)" in text
    assert "parallel model.layers.*.mlp.experts expert" in text
    assert "grouped_gemm" not in text  # the experts' weights: covered by the style
    compiled = planc.compile(planc.load(out), None, 4, strict=False)
    assert not [d for d in compiled.diagnostics if d.is_error]


def test_a_model_without_an_expert_plan_is_an_error(capsys):
    assert planc_main(["import", "--hf-ep-plan", "--model", "hf:llama-tiny"]) == 1
    assert "no Hugging Face expert-parallel plan" in capsys.readouterr().err


def test_the_expert_plan_joins_a_tensor_free_imported_plan(capsys):
    assert planc_main(["import", "--hf-ep-plan", "--model", "hf:qwen3-moe-tiny", "--expert", "4"]) == 0
    text = capsys.readouterr().out
    assert text.count("parallel ") == 1 and "expert = 4" in text
