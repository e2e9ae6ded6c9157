"""The zoo's routed mixture of experts: routing, the grouped matmul op, and tracing on fake tensors.

The oracle is a per-token loop written here: for each token, the sum over its top-k experts
of the router weight times that expert's SwiGLU, each expert a plain matmul chain. The op
itself is checked by torch's own `torch.library.opcheck` (schema, fake kernel, autograd).
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn.functional as F

import planc
from planc import zoo
from planc.estimate.flops import step_profile
from planc.model.graph import ModelGraph
from planc.zoo.grouped import grouped_mm, grouped_mm_weight_grad
from planc.zoo.routed import RoutedMoE


def reference(moe: RoutedMoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its top-k experts, one at a time."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = tokens @ moe.router.gate.weight.T
    probs = probs.softmax(-1)
    out = torch.zeros_like(tokens)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    for t in range(tokens.shape[0]):
        weights, ids = probs[t].topk(moe.router.top_k)
        weights = weights / weights.sum()
        for weight, e in zip(weights, ids.tolist()):
            h = F.silu(tokens[t] @ w1[e].T) * (tokens[t] @ w3[e].T)
            out[t] = out[t] + weight * (h @ w2[e].T)
    return out.view_as(x)


def test_routed_moe_equals_the_per_token_loop_forward_and_backward():
    torch.manual_seed(0)
    moe = RoutedMoE(dim=16, num_experts=4, hidden_dim=24, top_k=2).double()
    x = torch.randn(3, 10, 16, dtype=torch.float64, requires_grad=True)
    ids, _ = moe.router(x.detach().reshape(-1, 16))
    counts = torch.bincount(ids.reshape(-1), minlength=4)
    assert counts.min() != counts.max()  # the groups are uneven, as routing makes them
    got = moe(x)
    want = reference(moe, x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    probe = torch.randn_like(got)
    grads = torch.autograd.grad((got * probe).sum(), [x, *moe.parameters()])
    ref_grads = torch.autograd.grad((want * probe).sum(), [x, *moe.parameters()])
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_an_expert_without_tokens_gets_a_zero_gradient():
    torch.manual_seed(0)
    moe = RoutedMoE(dim=8, num_experts=4, hidden_dim=8, top_k=1).double()
    with torch.no_grad():  # expert 3 is never anyone's top choice
        moe.router.gate.weight[3] = -1e3 * moe.router.gate.weight[3].abs().sum() - 1e3
    x = torch.randn(2, 5, 8, dtype=torch.float64).abs()
    moe(x).sum().backward()
    assert torch.count_nonzero(moe.experts.w1.grad[3]) == 0
    assert torch.count_nonzero(moe.experts.w1.grad[:3]) > 0
    torch.testing.assert_close(moe(x), reference(moe, x))


def test_grouped_mm_passes_torchs_opcheck():
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([2, 2, 7])  # the middle group is empty
    torch.library.opcheck(grouped_mm, (x, w, offsets))
    torch.library.opcheck(grouped_mm_weight_grad, (x.detach(), torch.randn(7, 4, dtype=torch.float64), offsets))
    torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, offsets), (x, w))


def test_the_full_model_builds_on_meta_and_its_step_traces_with_expert_flops():
    """A step with data-dependent groups traces on fake tensors (the op's fake kernel), and the
    experts' FLOPs are counted: 3 grouped matmuls forward, 6 backward, over tokens x top_k rows."""
    with torch.device("meta"):
        model = zoo.routed_moe_tiny()
    cfg = model.config
    prof = step_profile(ModelGraph.from_module(model), input_shape=(2, 16))
    rows = 2 * 16 * cfg.top_k
    per_matmul = 2 * rows * cfg.dim * cfg.hidden_dim
    for i in range(cfg.n_layers):
        assert prof.forward[f"layers.{i}.moe.experts"] == 3 * per_matmul
        assert prof.backward[f"layers.{i}.moe.experts"] == 6 * per_matmul


def test_the_shipped_plan_checks_at_64_ranks():
    with torch.device("meta"):
        model = zoo.routed_moe()
    compiled = planc.compile(planc.load(pathlib.Path(__file__).resolve().parent.parent / "plans/routed-moe.plan"), model, 64)
    assert compiled.ok, [d.message for d in compiled.errors]
    assert len(compiled.units) == 19


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tiny_model_trains_one_step_in_each_precision(dtype):
    torch.manual_seed(0)
    model = zoo.routed_moe_tiny().to(dtype)
    tokens = zoo.example_input(model, 2, 16)
    logits = model(tokens)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens.reshape(-1))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())
