"""Expert x tensor parallelism on 4 real gloo ranks (shard 2 x tensor 2, expert 2: the expert axis
borrows the tensor ranks, efsdp 2): the zoo's `moe_llama_tiny` (Llama attention, routed MoE,
4 experts top-2), attention tensor-parallel, the experts expert-parallel, fp32, 3 clipped AdamW
steps against one unsharded process.

- Sequence parallel (plans/zoo-llama-tp.plan's rules, loss parallel): each MoE layer runs on its
  rank's sequence shard; through `planc.apply` and through the code `planc emit` prints.
- Replicated residual (no sequence parallelism): each MoE layer cuts the tensor group's tokens
  in two, runs its half, gathers the outputs.
- The fact behind the split (torch accepts it): every rank of a tensor group dispatching the same
  replicated tokens computes the right loss but expert gradients twice too large.

Loss and every gradient within 1e-5; the parameters after 3 AdamW steps within 1e-4 (Adam divides
by the root of the second moment: on expert weights with gradients near its eps, 1e-8 gradient
differences move the update by about 3e-5 at lr 1e-2). One launch, under the gloo lock.
"""

from __future__ import annotations

import pytest
from distributed import run
from expert_tensor_workers import train_all

TOL = 1e-5


@pytest.fixture(scope="module")
def results():
    return run(train_all, 4)


@pytest.mark.dist
def test_expert_by_tensor_trains_like_one_process(results):
    for ranks in results:
        for r in ranks[:3]:  # sequence parallel (apply, emitted), replicated residual
            assert r["loss"] < TOL and r["grad"] < TOL and r["param"] < 1e-4, r
            assert r["grads"] == 23  # every parameter compared


@pytest.mark.dist
def test_replicated_tokens_dispatched_twice_train_wrong(results):
    for ranks in results:
        twice = ranks[3]
        assert twice["loss"] < TOL  # the forward is right ...
        assert twice["grad"] > 1e-3  # ... the gradients are not
