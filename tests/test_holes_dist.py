"""The silent-wrong tensor-parallel holes, on 2 real gloo ranks (tp = 2), against one process.

Each plan here passes the shape simulation (shapes are fine, numbers are not); the static
rules in planc/checks/holes.py rest on what this file shows torch 2.13 really computes:

* P423 (error): `replicate` (torchtitan's `NoParallel`, planc's `ReplicateParallel`) on a
  module with weights that runs on head-sharded activations: the tiny Qwen3's per-head
  `q_norm` / `k_norm` after a colwise `q_proj` / `k_proj`. Each rank's weight gradient is
  the gradient of its own heads only: nothing reduces it over the tensor axis, so it differs
  from one process and between the ranks (their sum is the right gradient). The fix planc
  points at, `sequence { sequence_dim 2; local_output true }` (Hugging Face's
  `replicated_with_grad_allreduce`), gives the one-process gradient.
* P424 (error): `colwise` on a fused projection whose consumer expects another split (the
  tiny Phi-3's `gate_up_proj`, [gate | up], before a rowwise `down_proj`): rank 0 holds all of
  `gate`, so the MLP computes another function; the loss differs from one process. Gathering
  the output (`colwise { output replicate }`, `rowwise { input replicate }`) gives its loss.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from distributed import run

pytestmark = pytest.mark.dist

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOL = 1e-5


def _build(name: str) -> torch.nn.Module:
    from planc.model.hf import build_hf_model

    torch.manual_seed(0)
    return build_hf_model(name, device="cpu", attn_implementation="eager")


def _tokens(vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (2, 8), generator=gen)


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _qwen3_norm_grads(rank: int, world: int, norm_style: str) -> dict:
    """The layer-0 q_norm / k_norm weight gradients of the tiny Qwen3 with its attention split
    (q/k/v colwise, o rowwise) and the norms under `norm_style`; and one process's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    from planc.backends.runtime import ReplicateParallel

    tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    norm = {"replicate": ReplicateParallel(), "sequence": SequenceParallel(sequence_dim=2, use_local_output=True)}
    ref, model = _build("qwen3-tiny"), _build("qwen3-tiny")
    tokens = _tokens(model.config.vocab_size)
    for layer in model.model.layers:
        parallelize_module(layer.self_attn, tp, {
            "q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
            "o_proj": RowwiseParallel(), "q_norm": norm[norm_style], "k_norm": norm[norm_style]})
    loss, want = _loss(model, tokens), _loss(ref, tokens)
    loss.backward()
    want.backward()
    out = {"loss": loss.item(), "want_loss": want.item()}
    for name in ("q_norm", "k_norm"):
        got = getattr(model.model.layers[0].self_attn, name).weight.grad
        out[name] = _full(got).detach().clone()  # a Replicate DTensor: this rank's copy
        out[f"want_{name}"] = getattr(ref.model.layers[0].self_attn, name).weight.grad.detach().clone()
    return out


def _phi3_loss(rank: int, world: int, form: str) -> dict:
    """The tiny Phi-3's loss with each MLP split: plain colwise `gate_up_proj` + rowwise
    `down_proj` ("plain"), or the gather form ("gather"); and one process's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    styles = {"plain": (ColwiseParallel(), RowwiseParallel()),
              "gather": (ColwiseParallel(output_layouts=Replicate()), RowwiseParallel(input_layouts=Replicate()))}
    ref, model = _build("phi3-tiny"), _build("phi3-tiny")
    tokens = _tokens(model.config.vocab_size)
    colwise, rowwise = styles[form]
    for layer in model.model.layers:
        parallelize_module(layer.mlp, tp, {"gate_up_proj": colwise, "down_proj": rowwise})
    with torch.no_grad():
        return {"loss": _loss(model, tokens).item(), "want_loss": _loss(ref, tokens).item()}


def _ranks(rank: int, world: int) -> dict:
    return {"qwen3_replicate": _qwen3_norm_grads(rank, world, "replicate"),
            "qwen3_sequence": _qwen3_norm_grads(rank, world, "sequence"),
            "phi3_plain": _phi3_loss(rank, world, "plain"),
            "phi3_gather": _phi3_loss(rank, world, "gather")}


@pytest.fixture(scope="module")
def results():
    return run(_ranks, 2, timeout=600)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def test_replicate_on_a_per_head_norm_leaves_its_gradient_unreduced(results):
    # P423: under `replicate` each rank's q_norm / k_norm gradient is that of its own heads
    for name in ("q_norm", "k_norm"):
        grads = [r["qwen3_replicate"][name] for r in results]
        want = results[0]["qwen3_replicate"][f"want_{name}"]
        errors = [_rel(g, want) for g in grads]
        print(f"replicate {name}: relative gradient error per rank {[f'{e:.1%}' for e in errors]}")
        assert all(e > 0.1 for e in errors), errors                 # wrong by more than 10% on every rank
        assert _rel(grads[0], grads[1]) > 0.1                       # the "replicated" copies differ ...
        assert _rel(grads[0] + grads[1], want) < TOL                # ... and their sum is the right gradient
    # the forward itself is right: only the gradient is wrong (no simulation of shapes sees it)
    assert all(abs(r["qwen3_replicate"]["loss"] - r["qwen3_replicate"]["want_loss"]) < TOL for r in results)


def test_the_sequence_form_reduces_a_per_head_norm_gradient(results):
    # P423's fix: `sequence { sequence_dim 2; local_output true }` gives the one-process gradient
    for r in results:
        for name in ("q_norm", "k_norm"):
            assert _rel(r["qwen3_sequence"][name], r["qwen3_sequence"][f"want_{name}"]) < TOL, name


def test_colwise_on_a_fused_gate_up_projection_computes_another_function(results):
    # P424: shapes are fine, the loss is not
    for r in results:
        diff = abs(r["phi3_plain"]["loss"] - r["phi3_plain"]["want_loss"])
        print(f"phi3 plain colwise gate_up_proj: loss {r['phi3_plain']['loss']:.6f} vs {r['phi3_plain']['want_loss']:.6f}")
        assert diff > 1e-4, r["phi3_plain"]


def test_the_gathered_fused_projection_computes_the_model(results):
    # P424's fix: gather the fused output, split the consumer's input
    for r in results:
        assert abs(r["phi3_gather"]["loss"] - r["phi3_gather"]["want_loss"]) < TOL, r["phi3_gather"]
