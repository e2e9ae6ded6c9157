"""The traced step is the training step: the LM loss head, buffers, optimizers, other inputs.

Each figure of the analytic model (`planc.estimate.memory.estimate`) is checked against
`planc.analysis.simulate`: `planc.apply` in a fake process group, FSDPMemTracker over two
real steps (loss, backward, `clip_grad_norm_`, optimizer).
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

import planc
from planc import zoo
from planc.analysis.simulate import simulate, zoo_inputs
from planc.estimate import memory
from planc.estimate.trace import Example

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEED = (ROOT / "plans" / "seed.plan").read_text().split("expect")[0]


def _compiled(builder, text: str, world: int = 8):
    with torch.device("meta"):
        model = builder()
    return planc.compile(planc.loads(text, filename="t.plan"), model, world)


def test_the_lm_loss_head_is_counted():
    """Cross-entropy over fp32 logits: the bf16 logits' fp32 copy, its log-softmax and their
    gradients are alive at once; `output.sum()` has none of them."""
    c = _compiled(zoo.gpt_tiny, (ROOT / "plans" / "gpt.plan").read_text().split("expect")[0])
    shape = (4, 32)
    lm = memory.estimate(c, 8, input_shape=shape)
    summed = memory.estimate(c, 8, input_shape=shape, loss=lambda out, ex: out.sum())
    logits_fp32 = shape[0] * shape[1] * c.graph.model.config.vocab_size * 4
    assert lm.activations >= summed.activations + logits_fp32
    assert "cross-entropy over fp32 logits" in lm.source
    sim = simulate(c.plan, zoo.gpt_tiny, 8, inputs=zoo_inputs(shape))
    assert abs(lm.peak.total / sim.peak - 1) < 0.03


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused", "adam", "sgd"])
def test_optimizers_match_the_measured_step(optimizer):
    c = _compiled(zoo.seed_transformer_tiny, SEED)
    est = memory.estimate(c, 8, input_shape=(2, 16), optimizer=optimizer)
    sim = simulate(c.plan, zoo.seed_transformer_tiny, 8, inputs=zoo_inputs((2, 16)), optimizer=optimizer)
    assert abs(est.peak.total / sim.peak - 1) < 0.03, (est.peak.label, sim.moment)
    assert est.lower_bound <= est.peak.total


def test_buffers_are_counted_whole_on_every_rank():
    pytest.importorskip("torchtitan")
    from planc.model.torchtitan import llama3
    build = lambda: llama3("debugmodel", max_seq_len=256)  # noqa: E731
    c = _compiled(build, (ROOT / "plans" / "torchtitan_llama3.plan").read_text().split("expect")[0])
    rope = 6 * 256 * 8 * 8  # six layers' (max_seq_len, head_dim / 2) complex64 caches
    for world in (8, 64):
        est = memory.estimate(c, world, input_shape=(2, 64))
        assert est.peak.bytes["buffers"] == rope
        sim = simulate(c.plan, build, world, inputs=zoo_inputs((2, 64)))
        assert sim.breakdown["buffers"] == rope
        assert abs(est.peak.total / sim.peak - 1) < 0.03


def test_lower_bound_never_exceeds_the_peak_and_holds_no_absent_gradients():
    for text in (SEED, SEED + "unit transformer_layers[-1:] { offload cpu, pin_memory = false }\n",
                 SEED + "defaults { reshard after_forward = false }\n"):
        c = _compiled(zoo.seed_transformer_tiny, text)
        for shape in (None, (2, 16), (8, 64)):
            est = memory.estimate(c, 8, input_shape=shape)
            assert est.lower_bound <= est.peak.total, (text[-60:], shape)


def test_a_vision_model_is_estimated_through_an_input_factory_and_a_loss():
    from tests.step_inputs import TinyConvNet, image_inputs, mse_loss
    text = "unit blocks.*\n"
    c = _compiled(TinyConvNet, text)
    est = memory.estimate(c, 8, inputs=image_inputs(c.graph.model), loss=mse_loss)
    sim = simulate(c.plan, TinyConvNet, 8, inputs=image_inputs, loss=mse_loss)
    assert est.activations > 4 * 16 * 32 * 32 * 4  # one conv output at least
    assert abs(est.peak.total / sim.peak - 1) < 0.03


def test_keyword_inputs_reach_the_model():
    pytest.importorskip("transformers")
    from planc.model.hf import build_hf_model
    from tests.step_inputs import t5_inputs
    model = build_hf_model("t5-tiny")
    example = Example.of(t5_inputs(model))
    assert set(example.kwargs) == {"input_ids", "decoder_input_ids"} and not example.args


def test_explain_estimates_an_encoder_decoder_through_inputs(capsys, monkeypatch):
    """`planc explain --inputs pkg.module:fn --simulate` on T5 (encoder and decoder ids)."""
    pytest.importorskip("transformers")
    from planc.cli.main import main
    monkeypatch.chdir(ROOT)
    args = ["explain", "plans/t5.plan", "--model", "hf:t5-tiny", "--world-size", "8"]
    assert main(args + ["--inputs", "tests.step_inputs:t5_inputs", "--simulate", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["memory"]["activations_bytes"] > 0
    assert abs(data["simulated"]["estimate_over_measured"] - 1) < 0.03
    assert main(args + ["--inputs", "tests.step_inputs:no_such"]) == 2
    err = capsys.readouterr().err
    assert "--inputs" in err and "no_such" in err and "Traceback" not in err
