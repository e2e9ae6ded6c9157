"""The torch behaviour the static tensor-parallel checks rest on, on 2 real gloo ranks (tp = 2).

Each severity in planc/checks/tensor.py is a claim about what torch 2.13 does; this file
holds them to it, so a torch upgrade that changes one fails here, not in a user's job:

* P413 (error): a colwise -> rowwise MLP whose hidden size tp does not divide fails in the
  rowwise matmul (its `DTensor.from_local` assumes equal shards); with `use_local_output=False`
  on the colwise layer the same split computes what one process computes.
* uneven splits torch handles, left unreported: an Embedding's vocabulary rowwise; and
  P414 is a warning because `loss_parallel` on an uneven vocabulary gives the right loss.
* P417 (error): a norm between sequence-sharded activations gets the one-process weight
  gradient only with the `sequence` style.
* P422 (warning, as the producer is found from the module tree): a rowwise Linear whose input
  no colwise layer shards fails in its matmul.
* P418 (error): parameters on two different sets of meshes (some 2-D, some 1-D) break
  `clip_grad_norm_` (a foreach AdamW step runs on this torch, though pytorch#134212 reported
  it failing).
"""

from __future__ import annotations

import pytest
import torch
from distributed import run
from torch import nn

pytestmark = pytest.mark.dist


def _mlp(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, hidden, bias=False), nn.Linear(hidden, 4, bias=False))


def _outcome(fn) -> str:
    try:
        return fn()
    except Exception as err:  # the claim is about which error torch raises
        return f"{type(err).__name__}: {err}"


def _ranks(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

    tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))
    out = {}

    def mlp(local: bool) -> str:
        model, ref = _mlp(5), _mlp(5)
        parallelize_module(model, tp, {"0": ColwiseParallel(use_local_output=local), "1": RowwiseParallel()})
        return "equal" if torch.allclose(model(x), ref(x), atol=1e-6) else "different"
    out["uneven_local"] = _outcome(lambda: mlp(True))
    out["uneven_dtensor"] = _outcome(lambda: mlp(False))

    def rowwise_alone() -> str:  # P422: a whole input read as Shard(-1)
        model, ref = _mlp(4), _mlp(4)
        parallelize_module(model, tp, {"1": RowwiseParallel()})
        return "equal" if torch.allclose(model(x), ref(x), atol=1e-6) else "different"
    out["rowwise_alone"] = _outcome(rowwise_alone)

    def embedding() -> str:
        torch.manual_seed(0)
        emb, ref = nn.Embedding(5, 4), None
        torch.manual_seed(0)
        ref = nn.Embedding(5, 4)
        parallelize_module(emb, tp, RowwiseParallel(input_layouts=Replicate()))
        tokens = torch.tensor([[0, 4, 3], [1, 2, 4]])
        return "equal" if torch.allclose(emb(tokens), ref(tokens)) else "different"
    out["embedding_vocab"] = _outcome(embedding)

    def loss() -> str:
        torch.manual_seed(0)
        head = nn.Linear(4, 5, bias=False)
        torch.manual_seed(0)
        ref = nn.Linear(4, 5, bias=False)
        targets = torch.tensor([0, 4, 3, 1, 2, 4])
        want = nn.functional.cross_entropy(ref(x).flatten(0, 1), targets)
        parallelize_module(head, tp, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
        with loss_parallel():
            got = nn.functional.cross_entropy(head(x).flatten(0, 1), targets)
            got.backward()
        return "equal" if torch.allclose(got.full_tensor(), want, atol=1e-6) else "different"
    out["loss_parallel_vocab"] = _outcome(loss)

    def mixed_meshes(what: str) -> str:
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
        model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.LayerNorm(4))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(output_layouts=Replicate())})  # LayerNorm left out
        fully_shard(model, mesh=mesh["dp"])
        model(x).sum().backward()
        if what == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True).step()
        return "ran"

    def sequence_norm(style: str) -> str:
        from torch.distributed.tensor.parallel import SequenceParallel

        from planc.backends.runtime import ReplicateParallel

        model, ref = _SeqBlock(), _SeqBlock()
        norm = {"sequence": SequenceParallel(), "replicate": ReplicateParallel()}
        parallelize_module(model, tp, {"w1": ColwiseParallel(), "w2": RowwiseParallel(output_layouts=Shard(1)),
                                       "w3": ColwiseParallel(input_layouts=Shard(1)), "w4": RowwiseParallel(),
                                       **({"norm": norm[style]} if style in norm else {})})
        tokens = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(2))  # 4 tokens: 2 a rank
        model(tokens).sum().backward()
        ref(tokens).sum().backward()
        grad = model.norm.weight.grad
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        return "equal" if torch.allclose(grad, ref.norm.weight.grad, atol=1e-5) else "different"
    for style in ("sequence", "replicate", "none"):
        out[f"norm_{style}"] = _outcome(lambda: sequence_norm(style))  # noqa: B023 (called at once)
    out["mixed_clip"] = _outcome(lambda: mixed_meshes("clip"))
    out["mixed_foreach_adamw"] = _outcome(lambda: mixed_meshes("adamw"))
    return out


class _SeqBlock(nn.Module):
    """colwise -> rowwise (output `Shard(1)`) -> norm -> colwise (input `Shard(1)`) -> rowwise."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1, self.w2 = nn.Linear(4, 8, bias=False), nn.Linear(8, 4, bias=False)
        self.norm = nn.LayerNorm(4)
        self.w3, self.w4 = nn.Linear(4, 8, bias=False), nn.Linear(8, 4, bias=False)

    def forward(self, x):
        h = self.w2(self.w1(x))
        return self.w4(self.w3(self.norm(h)))


@pytest.fixture(scope="module")
def results():
    return run(_ranks, 2, timeout=600)


def test_uneven_colwise_rowwise_fails_unless_the_colwise_output_stays_a_dtensor(results):
    # P413: an error for the local (default) output, nothing to report with local_output false
    assert any("Sharding propagation failed" in r["uneven_local"] for r in results), results
    assert [r["uneven_dtensor"] for r in results] == ["equal", "equal"]


def test_a_rowwise_layer_without_a_colwise_producer_fails(results):
    # P422: the whole activation is read as 1/tp of a wider one
    assert all("Sharding propagation failed" in r["rowwise_alone"] for r in results), results


def test_uneven_splits_torch_handles(results):
    assert [r["embedding_vocab"] for r in results] == ["equal", "equal"]      # not reported
    assert [r["loss_parallel_vocab"] for r in results] == ["equal", "equal"]  # P414 is a warning


def test_a_norm_between_sequence_shards_needs_the_sequence_style(results):
    # P417: with `sequence` the norm's weight gradient is the one-process gradient; replicated
    # on the tensor axis or left alone, each rank keeps the gradient of its own tokens only
    assert [r["norm_sequence"] for r in results] == ["equal", "equal"], results
    assert all(r["norm_replicate"] == "different" and r["norm_none"] == "different" for r in results), results


def test_parameters_on_different_meshes_break_clip_grad_norm(results):
    # P418: the LayerNorm's weight is 1-D (dp), the Linear's 2-D (dp, tp): gradient clipping
    # stacks the per-parameter norms and refuses two meshes
    assert all("must have the same mesh" in r["mixed_clip"] for r in results), results
    # a foreach AdamW step does run on torch 2.13's CPU build (pytorch#134212 reported it
    # failing): P418 does not rest on it
    assert [r["mixed_foreach_adamw"] for r in results] == ["ran", "ran"]
