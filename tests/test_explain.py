"""`planc explain`: golden text and JSON, usage errors, --simulate, --plot.

Goldens: tests/golden/explain/<case>.txt and .json are what `planc explain` prints for each
case in CASES (NO_COLOR). Rewrite them after an intended change with

    PLANC_UPDATE_GOLDENS=1 pytest tests/test_explain.py

and review the diff.
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib

import pytest
import torch
from torch import nn

from planc import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "explain"
from goldens import check_golden  # noqa: E402

# case -> explain arguments (run from the repository root)
CASES = {
    "seed_w8_activations": ["plans/seed.plan", "--model", "planc.zoo:seed_transformer_tiny", "--world-size", "8",
                            "--input-shape", "2x16"],
    "gpt_w4_no_input": ["plans/gpt.plan", "--model", "planc.zoo:gpt_tiny", "--world-size", "4"],
    "moe_w2_sgd": ["plans/moe.plan", "--model", "planc.zoo:moe_transformer_tiny", "--world-size", "2",
                   "--optimizer", "sgd", "--input-shape", "2x16"],
    "seed_hsdp_w4": ["plans/seed_hsdp.plan", "--model", "planc.zoo:seed_transformer_tiny", "--world-size", "4"],
    "llama_tp_w16": ["plans/llama-tp.plan", "--world-size", "16", "--input-shape", "2x16"],  # 2-D: placements per axis
}


def explain(args: list[str], monkeypatch) -> tuple[int, str, str]:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("NO_COLOR", "1")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["explain", *args])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("case", sorted(CASES))
def test_text_golden(case, monkeypatch):
    code, out, err = explain(CASES[case], monkeypatch)
    assert code == 0, err
    assert "\x1b[" not in out  # NO_COLOR
    check_golden(GOLDEN / f"{case}.txt", out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_json_golden(case, monkeypatch):
    code, out, err = explain(CASES[case] + ["--format", "json"], monkeypatch)
    assert code == 0, err
    data = json.loads(out)
    check_golden(GOLDEN / f"{case}.json", out)
    # the JSON agrees with itself: unit bytes add up to the totals, the peak to its breakdown
    units = data["units"]
    assert data["totals"]["units"] == len(units)
    assert data["totals"]["params"] == sum(u["params"] for u in units)
    assert data["memory"]["peak_bytes"] == sum(data["memory"]["breakdown"].values())
    for u in units:
        for key, s in u["settings"].items():
            assert (s["line"] is None) == (s["set_by"] == "default"), (u["name"], key)


def test_every_setting_names_its_plan_line(monkeypatch):
    code, out, _ = explain(CASES["seed_w8_activations"] + ["--format", "json"], monkeypatch)
    units = {u["name"]: u for u in json.loads(out)["units"]}
    lines = (ROOT / "plans" / "seed.plan").read_text().splitlines()

    def line_of(text: str) -> str:
        return f"plans/seed.plan:{next(i for i, line in enumerate(lines, 1) if line.startswith(text))}"
    tail = units["[norm, output]"]["settings"]["reshard_after_forward"]
    assert (tail["value"], tail["set_by"], tail["line"]) == ("false", "unit [norm, output]",
                                                            line_of("unit [norm, output]"))
    block = units["transformer_layers.0"]["settings"]["param_dtype"]
    assert (block["value"], block["set_by"], block["line"]) == ("bf16", "defaults", line_of("  precision param"))


def test_simulate_reports_measured_next_to_estimate(monkeypatch):
    args = ["plans/seed.plan", "--model", "planc.zoo:seed_transformer_tiny", "--world-size", "16",
            "--simulate", "--rank", "3", "--format", "json"]
    code, out, err = explain(args, monkeypatch)
    assert code == 0, err
    data = json.loads(out)
    sim = data["simulated"]
    assert sim["rank"] == 3 and data["input_shape"] == [2, 16]
    assert abs(sim["estimate_over_measured"] - 1) <= 0.10
    assert sim["breakdown"]["sharded_params"] == data["memory"]["breakdown"]["sharded_params"]


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_plot_writes_a_figure(suffix, monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / f"step.{suffix}"
    code, _, err = explain(CASES["seed_w8_activations"] + ["--plot", str(target)], monkeypatch)
    assert code == 0, err
    head = target.read_bytes()[:200]
    assert head.startswith(b"\x89PNG") if suffix == "png" else b"<svg" in target.read_bytes()


@pytest.mark.parametrize("args,message", [
    (["--input-shape", "2xq"], "--input-shape 2xq"),
    (["--rank", "9"], "--rank 9"),
    (["--plot", "out.pdf"], ".png or .svg"),
])
def test_usage_errors_exit_2_without_traceback(args, message, monkeypatch):
    base = ["plans/seed.plan", "--model", "planc.zoo:seed_transformer_tiny", "--world-size", "8"]
    code, out, err = explain(base + args, monkeypatch)
    assert code == 2 and message in err and "Traceback" not in err


def test_plan_errors_exit_1(monkeypatch, tmp_path):
    bad = tmp_path / "bad.plan"
    bad.write_text("model planc.zoo:seed_transformer_tiny\nunit transformer_layerz.*\n")
    code, out, err = explain([str(bad), "--world-size", "2"], monkeypatch)
    assert code == 1 and "P" in err and out == ""


def test_failed_expect_still_explains_exit_1(monkeypatch, tmp_path):
    # P502 sends people to `planc explain` for the breakdown, so a failed bound must not stop it
    plan = tmp_path / "tight.plan"
    plan.write_text("model planc.zoo:gpt_tiny\nunit blocks.*\nexpect memory.peak <= 1MiB at world = 8, input = 8x64\n")
    code, out, err = explain([str(plan), "--world-size", "8", "--input-shape", "8x64"], monkeypatch)
    assert code == 1 and "error[P502]" in err and "--input-shape 8x64" in err
    # 2.98 MiB (= FSDPMemTracker's): the LM loss head (cross-entropy over fp32 logits) is part of the step;
    # it was 3.03 MiB while the root's pre-backward (and its prefetch) was replayed before the loss's backward
    assert "memory per rank, one training step: peak 2.98 MiB" in out and "activations" in out


class TwoInputs(nn.Module):
    """A model that token ids alone cannot drive (like an encoder-decoder)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.proj(x.float() + y)


def two_inputs() -> nn.Module:
    return TwoInputs()


def test_a_model_that_cannot_run_on_token_ids_is_a_usage_error(monkeypatch, tmp_path):
    plan = tmp_path / "two.plan"
    plan.write_text("model test_explain:two_inputs\n")
    code, out, err = explain([str(plan), "--world-size", "2", "--input-shape", "2x4"], monkeypatch)
    assert code == 2 and "did not run on inputs of shape 2x4" in err and "Traceback" not in err
    code, out, err = explain([str(plan), "--world-size", "2"], monkeypatch)  # without activations: fine
    assert code == 0, err


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path):
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: import fails
    code, _, err = explain(CASES["seed_hsdp_w4"] + ["--plot", str(tmp_path / "x.png")], monkeypatch)
    assert code == 2 and 'pip install "planc[plot]"' in err and not (tmp_path / "x.png").exists()


def test_sharded_and_unsharded_columns_say_their_dtypes(capsys):
    """At world 2 an fp32 shard and a bf16 gathered unit are the same bytes: the table says why."""
    from planc import cli
    assert cli.main(["explain", "plans/gpt.plan", "--model", "planc.zoo:gpt_tiny", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "sharded/rank is the shard each rank keeps, in fp32; unsharded is the whole unit as all-gathered for " \
           "compute, in bf16" in out
