"""A split backward per stage (`planc/estimate/split_backward.py`) against torch's own halves run on real tensors.

Oracle: llama_tiny cut by hand into 4 stages as torchtitan cuts it (tests/pp_memory_workers.py's
Embed / Block / Head, not planc's `split`), each stage run on real CPU tensors on the previous
one's detached output, then torch's `stage_backward_input` and `stage_backward_weight` (the
first stage: `stage_backward`, as `PipelineStage` runs it there) under FlopCounterMode, and the
bytes alive after the input half (what `PipelineStage.backward_state` holds until the weight
half) under `pp_memory_workers.LiveBytes` (a storage counter on real tensors), with the most each
half holds above its start (and a full backward on a second forward, once the weights have
gradients). planc runs its own split on fake tensors; the FLOPs of each half must be equal, the
kept bytes within 1%, the peaks equal.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from pp_memory_workers import Block, Embed, Head, LiveBytes, alive, lm_loss
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight
from torch.utils.flop_counter import FlopCounterMode

import planc
from planc.estimate.roles import BACKWARD_INPUT, BACKWARD_WEIGHT, _JobCosts, estimate_pipeline_time, whole_program
from planc.estimate.split_backward import split_costs
from planc.estimate.trace import Example
from planc.lower.pipeline import pipeline_job
from planc.lower.schedules import schedule
from planc.zoo import llama_tiny

PLAN = """model planc.zoo:llama_tiny
mesh (shard = *)
unit tok_embeddings { reshard after_forward = false }
unit layers.* { reshard after_forward = false }
unit [norm, output] { reshard after_forward = false }
root { reshard after_forward = false }
"""
FOUR = [("tok_embeddings",), ("layers.0",), ("layers.1",), ("norm", "output")]
MICRO, BATCH, SEQ = 4, 8, 16


def _torch_halves() -> list[tuple[int | None, int, int, tuple[int, int, int]]]:
    """Per stage, on real tensors: (bytes kept from I to W, or None where I does nothing; I FLOPs; W FLOPs;
    the peaks of I, W and a full backward above each one's start)."""
    torch.manual_seed(0)
    model = llama_tiny()
    tokens = torch.randint(0, 128, (BATCH // MICRO, SEQ))
    inp, halves = tokens, []
    for s in range(4):
        mod = Embed(model) if s == 0 else Head(model) if s == 3 else Block(model, s - 1)
        half, out = _torch_half(mod, inp, tokens, s == 3)
        halves.append(half)
        inp = out.detach().requires_grad_()
    return halves


def _torch_half(mod, inp, tokens, last: bool):
    """One stage's halves as `PipelineStage` runs them (a function: nothing of the previous stage's
    step is alive while the counter runs but its output, this stage's input). FLOPs and bytes are
    counted in separate runs (FlopCounterMode decomposes some backward ops, which allocates)."""
    (i, w), _ = _run_halves(mod, inp, tokens, last, flops=True)
    for p in mod.parameters():
        p.grad = None  # the bytes run's `W` makes the weights' gradients, as the first microbatch's does
    (kept, peaks), out = _run_halves(mod, inp, tokens, last, flops=False)
    return (kept, i, w, peaks), out


def _run_halves(mod, inp, tokens, last: bool, flops: bool):
    def half(live, fn, *args):  # (result, FLOPs or the most live bytes above its start)
        live._read()
        start = live.peak = live.cur
        with FlopCounterMode(display=False) if flops else contextlib.nullcontext() as counter:
            result = fn(*args)
        return result, counter.get_total_flops() if flops else live.peak - start

    with LiveBytes(alive()) as live:  # only what this stage's step makes is counted
        out = mod(inp)
        loss = lm_loss(out, tokens) if last else None
        roots, grads = ([loss], None) if last else ([out], [torch.ones_like(out)])
        if not inp.is_floating_point():  # the first stage: I does nothing, W is `stage_backward`
            _, w = half(live, stage_backward, roots, grads, [inp])
            return ((0, w) if flops else (None, (0, w, w))), out
        (dinputs, groups), i = half(live, stage_backward_input, roots, grads, [inp], iter(mod.parameters()))
        del dinputs, loss
        inp.grad = None  # the input's gradient (on the receive buffer), the received gradient and the
        roots = grads = None  # output are the schedule's, not the split's: not counted in what it keeps
        kept = live.cur - live.start - out.untyped_storage().nbytes()
        _, w = half(live, stage_backward_weight, iter(mod.parameters()), groups)
        if flops:
            return (i, w), out
        again = mod(inp)  # a second microbatch's full backward: the weights' gradients exist now
        roots, grads = (lm_loss(again, tokens), None) if last else ([again], [torch.ones_like(again)])
        _, full = half(live, stage_backward, roots, grads, [inp])
    return (kept, (i, w, full)), out


@pytest.fixture(scope="module")
def compiled():
    return planc.compile(planc.loads(PLAN, filename="pp.plan"), llama_tiny(), 2)


def test_split_costs_equal_torchs_halves_on_real_tensors(compiled):
    # DualPipeV: input and weight halves, and full backwards (their peak is asked for only then)
    job = pipeline_job(compiled.job, FOUR, schedule("DualPipeV", 2, MICRO, 2))
    example = Example.of(torch.zeros(BATCH // MICRO, SEQ, dtype=torch.long))
    costs = split_costs(types.SimpleNamespace(graph=compiled.graph, program=whole_program(job)), job, example)
    for cost, (kept, i, w, peaks) in zip(costs, _torch_halves()):
        assert (cost.input_flops, cost.weight_flops) == (i, w), cost.stage
        # measured: the blocks' equal; the head's 256 bytes over of 41,088 (fake vs real CPU kernels)
        assert cost.kept == kept if kept is None else abs(cost.kept - kept) <= 0.01 * kept, (cost.stage, cost.kept, kept)
        # measured: equal on every stage (a block's I 114,688 B, the head's 65,540 B; W and a full backward
        # with the weight gradients allocated, then added)
        assert (cost.input_peak, cost.weight_peak, cost.full_peak) == peaks, (cost.stage, cost, peaks)
    assert costs[0].kept is None and costs[0].input_share == 0.0  # the first stage: W is the whole backward
    assert all(c.kept > 0 for c in costs[1:])


def test_step_time_splits_each_backward_by_its_counted_flops(compiled):
    job = pipeline_job(compiled.job, FOUR, schedule("ZBVZeroBubble", 2, MICRO, 2))
    pt = estimate_pipeline_time(job, world=2, graph=compiled.graph, input_shape=(BATCH, SEQ))
    costs = _JobCosts(pt.stages, {}, {s: 0 for s in range(4)})
    for st, (kept, i, w, _) in zip(pt.stages, _torch_halves()):
        share = 0.0 if kept is None else i / (i + w)
        assert costs.compute_s(st.stage, BACKWARD_INPUT) == pytest.approx(st.backward_s * share)
        assert costs.compute_s(st.stage, BACKWARD_WEIGHT) == pytest.approx(st.backward_s * (1 - share))
    # the first stage's input half takes no time on the timeline: its weight half is its whole backward
    first = [sp for r in pt.timeline.ranks for sp in r.spans if sp.action.startswith("0I")]
    assert first and all(sp.end == pytest.approx(sp.start) for sp in first)
