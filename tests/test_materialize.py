"""`planc.materialize`: the model's own initialiser, rebuilt buffers, and P606 for the rest.

Every shipped model (zoo, Hugging Face configs in planc/model/configs, torchtitan's Llama 3
debug model when torchtitan is installed) is built on meta, materialized with the default
initialiser, and trained one real AdamW step: the loss and every parameter stay finite, and
parameters have the distribution an eager build gives them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planc import zoo
from planc.backends.materialize import materialize
from planc.diagnostics import PlanError

HF_CONFIGS = ["gpt2-tiny", "bert-tiny", "llama-tiny", "mixtral-tiny", "t5-tiny"]


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _one_step(model: nn.Module, inputs: dict) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logits = _logits(model(**inputs)).float()
    loss = nn.functional.cross_entropy(logits.flatten(0, -2), torch.randint(0, logits.shape[-1], logits.shape[:-1]).flatten())
    loss.backward()
    opt.step()
    return loss.item()


def _compare_to_eager(model: nn.Module, eager: nn.Module) -> None:
    ref = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        r = ref[name]
        if r.numel() > 1 and r.std() > 0:
            assert abs(p.std() - r.std()) < 0.25 * r.std() + 1e-6, name
        else:
            assert torch.equal(p, r), name
    for name, b in eager.named_buffers():
        assert torch.equal(model.get_buffer(name), b), name  # rebuilt, not to_empty garbage


def _check(build, inputs: dict, real_init=None) -> None:
    """`real_init`: what the model's users run after an eager build (torchtitan: init_weights)."""
    torch.manual_seed(0)
    eager = build()
    if real_init is not None:
        with torch.no_grad():
            real_init(eager)
    with torch.device("meta"):
        model = build()
    materialize(model, "cpu")
    _compare_to_eager(model, eager)
    loss = _one_step(model, inputs)
    assert loss == loss and abs(loss) < 1e4
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("builder", ["seed_transformer_tiny", "gpt_tiny", "moe_transformer_tiny"])
def test_zoo_models_train_finite_after_materialize(builder):
    _check(zoo.ZOO[builder], {"tokens": torch.randint(0, 64, (2, 8))})


@pytest.mark.parametrize("config", HF_CONFIGS)
def test_hf_models_train_finite_after_materialize(config):
    pytest.importorskip("transformers")
    from planc.model.hf import build_hf_model
    inputs = {"input_ids": torch.randint(0, 64, (2, 8))}
    if config.startswith("t5"):
        inputs["decoder_input_ids"] = torch.randint(0, 64, (2, 8))
    _check(lambda: build_hf_model(config, torch.get_default_device()), inputs)


@pytest.mark.parametrize("tied", [False, True])
def test_torchtitan_llama3_trains_finite_after_materialize(tied):
    pytest.importorskip("torchtitan")
    from planc.model.torchtitan import llama3
    # torchtitan's modules are built with torch's default init; its real init is init_weights
    _check(lambda: llama3("debugmodel", tied=tied, max_seq_len=64), {"tokens": torch.randint(0, 2048, (2, 16))},
           real_init=lambda m: m.init_weights(buffer_device=None))


class _Scale(nn.Module):
    """A module with init code in `__init__` only: nothing can redo it after `to_empty`."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return x * self.gain + self.table


def test_refuses_what_no_initialiser_covers_naming_the_module():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Scale())
    with pytest.raises(PlanError) as err:
        materialize(model, "cpu")
    (d,) = err.value.errors
    assert d.code == "P606"
    assert "`1`" in d.notes[0] and "`1.gain`" in d.notes[1] and "`1.table`" in d.notes[1]
    assert "`0" not in d.notes[0]  # nn.Linear's reset_parameters covered it


def test_own_init_covering_everything_is_accepted_and_partial_init_refused():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Scale())

    def init(m):
        m[0].reset_parameters()
        m[1].gain.fill_(1.0)
        m[1].table.copy_(torch.arange(4.0))
    materialize(model, "cpu", init=init)
    assert torch.equal(model[1].table, torch.arange(4.0))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Scale())
    with pytest.raises(PlanError) as err:
        materialize(model, "cpu", init=lambda m: m[0].reset_parameters())
    assert "your `init`" in err.value.errors[0].message


# GPT's constructor draws lm_head's Linear init before tying the weight away; materialize
# initialises the tied weight once, so its values are not the eager ones (their distribution is).
@pytest.mark.parametrize("builder", sorted(b for b in zoo.ZOO if b.endswith("_tiny") and b != "gpt_tiny"))
def test_reproducible_materialize_of_an_unsharded_model_is_the_eager_build(builder):
    """No DTensors: `reproducible=True` is the plain per-module init, children first, as these
    models initialise when built (tests/test_tp_zoo_dist.py and tests/test_apply_dist.py check
    it under sharding)."""
    torch.manual_seed(0)
    eager = dict(zoo.ZOO[builder]().named_parameters())
    with torch.device("meta"):
        model = zoo.ZOO[builder]()
    torch.manual_seed(0)
    materialize(model, "cpu", reproducible=True)
    for name, p in model.named_parameters():
        assert torch.equal(p, eager[name]), name


def test_reproducible_needs_the_reset_parameters_initialiser():
    with torch.device("meta"):
        model = zoo.llama_tiny()
    with pytest.raises(ValueError, match="reset_parameters"):
        materialize(model, "cpu", init=lambda m: None, reproducible=True)



def test_reproducible_refuses_a_hugging_face_model_and_names_the_dcp_path():
    """Hugging Face models initialise as a whole (`initialize_weights()`): `reproducible=True`
    is refused, naming that initialiser and the way that works (a DCP checkpoint across plans)."""
    pytest.importorskip("transformers")
    from planc.model.build import build_model
    model = build_model("hf:llama-tiny")
    with pytest.raises(ValueError) as err:
        materialize(model, "cpu", reproducible=True)
    assert "Hugging Face's `initialize_weights()`" in str(err.value) and "set_state_dict" in str(err.value)
