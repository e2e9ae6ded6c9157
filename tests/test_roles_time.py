"""Time per role of a pipeline job (planc/estimate/roles.py).

Oracles: FlopCounterMode over hand-written stages of the real model (embedding + block 0; block 1 +
norm + head + loss), one microbatch on real tensors; the boundary activation's bytes from its
shape; FSDP collectives counted once per step under a pipeline (torch's PipelineStage keeps
gradients unreduced and parameters gathered until the last microbatch).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import planc
from planc.estimate.hardware import Link, hardware
from planc.estimate.roles import estimate_pipeline_time
from planc.lower.pipeline import pipeline_job
from planc.lower.schedules import schedule
from planc.zoo import llama_tiny

PLAN = """model planc.zoo:llama_tiny
mesh (shard = *)
unit tok_embeddings
unit layers.*
unit [norm, output] { reshard after_forward = false }
root { reshard after_forward = false }
"""
STAGES = [("tok_embeddings", "layers.0"), ("layers.1", "norm", "output")]
BATCH, SEQ, MICRO = 8, 32, 4


def _estimate(name="1F1B", world=4, plan=PLAN):
    compiled = planc.compile(planc.loads(plan, filename="pp.plan"), llama_tiny(), world)
    job = pipeline_job(compiled.job, STAGES, schedule(name, 2, MICRO))
    return estimate_pipeline_time(job, graph=compiled.graph, world=world, input_shape=(BATCH, SEQ))


def _counted(fn):
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = fn()
    return out, counter.get_total_flops()


def test_stage_flops_equal_flop_counter_on_the_hand_split_stages():
    model = llama_tiny()
    cfg = model.config
    tokens = torch.randint(0, cfg.vocab_size, (BATCH // MICRO, SEQ))
    h, f0 = _counted(lambda: model.layers[0](model.tok_embeddings(tokens)))
    _, b0 = _counted(lambda: h.backward(torch.ones_like(h)))
    x = h.detach().requires_grad_()

    def last():
        logits = model.output(model.norm(model.layers[1](x)))
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    loss, f1 = _counted(last)
    _, b1 = _counted(loss.backward)
    # the profile counts a GPU flash kernel, whose backward recomputes Q K^T (one more matmul of
    # 2 b h s^2 d per attention than the math kernel counted here)
    flash = 2 * (BATCH // MICRO) * cfg.n_heads * SEQ * SEQ * (cfg.dim // cfg.n_heads)
    est = _estimate()
    s0, s1 = est.stages
    assert (s0.forward_flops, s0.backward_flops) == (f0, b0 + flash)
    assert (s1.forward_flops, s1.backward_flops) == (f1, b1 + flash)
    assert s0.boundary_bytes == h.numel() * h.element_size() and s1.boundary_bytes == 0


def test_fsdp_collectives_run_once_per_step_under_a_pipeline():
    est = _estimate(world=4)  # 2 pipeline ranks x 2 data-parallel ranks
    for rank in est.timeline.ranks:
        (stage,) = rank.stages
        st = est.stages[stage]
        # units kept gathered (reshard false) gather once; `layers.*` (reshard true) before every
        # forward and backward; every unit reduces once, after the last backward
        once = sum(s for s, again in st.gathers["forward"] if not again)
        every = sum(s for s, again in st.gathers["forward"] + st.gathers["backward"] if again)
        assert every > 0 and (once > 0) == (stage == 1) and len(st.reductions) == 2  # [norm, output] on stage 1
        assert rank.comm_s == pytest.approx(once + MICRO * every + sum(st.reductions))
    alone = _estimate(world=2)  # one rank per stage: no data-parallel collectives
    assert all(r.comm_s == 0 for r in alone.timeline.ranks)
    assert alone.step_s < est.step_s


def test_step_throughput_and_bubble():
    est = _estimate()
    busy = [r.busy_s for r in est.timeline.ranks]
    s0, s1 = est.stages
    assert busy == pytest.approx([MICRO * (s0.forward_s + s0.backward_s), MICRO * (s1.forward_s + s1.backward_s)])
    assert est.step_s >= max(busy) and 0 < est.bubble < 1
    assert est.tokens == BATCH * SEQ * 2  # the step's batch on each of the 2 data-parallel ranks
    flops = (s0.forward_flops + s0.backward_flops + s1.forward_flops + s1.backward_flops) * MICRO * 2
    assert est.model_flops == flops and est.mfu == pytest.approx(flops / (est.step_s * 4 * est.hardware.bf16_flops))


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
def test_more_microbatches_shrink_the_bubble_unless_latency_dominates(name):
    compiled = planc.compile(planc.loads(PLAN, filename="pp.plan"), llama_tiny(), 2)
    free = dataclasses.replace(hardware("h100"), intra=Link(0.0, 1e30), inter=Link(0.0, 1e30))
    bubbles, slow = [], []
    for m in (2, 4, 8):
        job = pipeline_job(compiled.job, STAGES, schedule(name, 2, m))
        bubbles.append(estimate_pipeline_time(job, graph=compiled.graph, world=2, input_shape=(16, SEQ),
                                              hardware=free).bubble)
        slow.append(estimate_pipeline_time(job, graph=compiled.graph, world=2, input_shape=(16, SEQ)).bubble)
    assert bubbles[0] > bubbles[1] > bubbles[2]
    # the tiny model's microbatch computes in well under a microsecond: the 10 us latency of
    # each transfer of an activation or its gradient idles the ranks
    assert all(s > b for s, b in zip(slow, bubbles)) and min(slow) > 0.8


@pytest.mark.parametrize("name", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                                  "DualPipeV"])
def test_every_multi_stage_schedule_prices_each_rank_s_stages(name):
    compiled = planc.compile(planc.loads(PLAN, filename="pp.plan"), llama_tiny(), 4)
    four = [("tok_embeddings",), ("layers.0",), ("layers.1",), ("norm", "output")]
    job = pipeline_job(compiled.job, four, schedule(name, 2, MICRO, 2))
    est = estimate_pipeline_time(job, graph=compiled.graph, world=4, input_shape=(BATCH, SEQ))
    for rank in est.timeline.ranks:  # every forward and backward (split or not) of its stages, once
        stages = [est.stages[s] for s in rank.stages]
        assert rank.busy_s == pytest.approx(MICRO * sum(st.forward_s + st.backward_s for st in stages))
    assert sum(st.forward_flops for st in est.stages) == sum(s.forward_flops for s in _estimate().stages)
