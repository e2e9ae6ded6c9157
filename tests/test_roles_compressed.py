"""The fast path of the pipeline estimates equals the slow one, and each stage is priced at its own dtype.

The memory per pipeline rank and the stages' FLOPs trace runs of identical blocks as four
(planc/estimate/repeat.py) and replay each run of op events cut to its extremes
(`planc.estimate.trace.compress`); `compressed=False` / `repeat=False` trace every block and
replay every op. Oracle: that full path, on models long enough to have a run (6 blocks), every
rank, several schedules, mixed precision, checkpointing, tensor parallelism: the same peak,
moment and breakdown per rank, the same stage FLOPs, boundary bytes and step. And the stages'
FLOPs summed equal FlopCounterMode over the whole model's real step; a stage of bf16 units is
priced at the bf16 rate even when the other stages hold most of the parameters (it was priced
fp32: the other stages' parameters, outside its units, counted in their stored dtype).
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import planc
from planc import zoo
from planc.estimate.role_memory import estimate_pipeline_memory
from planc.estimate.roles import estimate_pipeline_time
from planc.lower.pipeline import pipeline_job
from planc.lower.schedules import schedule

ROOT = pathlib.Path(__file__).resolve().parent.parent
N = 6
L = tuple(f"layers.{i}" for i in range(N))
TWO = [("tok_embeddings", L[0]), (*L[1:], "norm", "output")]
FOUR = [("tok_embeddings", *L[:2]), L[2:4], (L[4],), (L[5], "norm", "output")]
LLAMA = """model planc.zoo:llama_tiny
mesh (shard = *)
{defaults}unit tok_embeddings
unit layers.*
unit [norm, output]
{checkpoint}"""
BF16 = "defaults { precision param = bf16, reduce = fp32 }\n"


def _llama():
    return zoo.llama(dataclasses.replace(zoo.LLAMA_TINY_CONFIG, n_layers=N))


def _both(text: str, stages, name: str, world: int, shape=(8, 16), microbatches=4, per_rank=1):
    """The estimates both ways; each on its own model graph, so no trace or profile is shared."""
    out = []
    for fast in (True, False):
        model = _llama()
        compiled = planc.compile(planc.loads(text, filename="pp.plan"), model, world)
        job = pipeline_job(compiled.job, stages, schedule(name, len(stages) // per_rank, microbatches, per_rank))
        mem = estimate_pipeline_memory(job, world, graph=compiled.graph, input_shape=shape, compressed=fast)
        time = estimate_pipeline_time(job, graph=compiled.graph, world=world, input_shape=shape, repeat=fast)
        out.append((mem, time))
    return out


def _same(fast, full):
    (mem_a, time_a), (mem_b, time_b) = fast, full
    for a, b in zip(mem_a, mem_b, strict=True):
        assert (a.peak.label, a.peak.phase, a.peak.bytes) == (b.peak.label, b.peak.phase, b.peak.bytes)
        assert (a.sharded_state, a.activations, a.notes, a.stages) == (b.sharded_state, b.activations, b.notes, b.stages)
        for name in ("memory.peak", "memory.sharded", "memory.unsharded_peak", "memory.activations"):
            assert a.metric(name) == b.metric(name)
        full_moments = [(m.label, m.total) for m in b.timeline]
        kept = [(m.label, m.total) for m in a.timeline]
        assert len(kept) < len(full_moments) and set(kept) <= set(full_moments)
    assert [(s.forward_flops, s.backward_flops, s.boundary_bytes) for s in time_a.stages] == \
        [(s.forward_flops, s.backward_flops, s.boundary_bytes) for s in time_b.stages]
    assert (time_a.step_s, time_a.model_flops) == (time_b.step_s, time_b.model_flops)


@pytest.mark.parametrize("name,stages,per_rank,defaults,checkpoint", [
    ("1F1B", TWO, 1, "", ""),
    ("GPipe", TWO, 1, BF16, "checkpoint layers.* full\n"),
    ("Interleaved1F1B", FOUR, 2, BF16, "checkpoint layers.* selective\n"),
    ("ZBVZeroBubble", FOUR, 2, "", ""),
])
def test_compressed_equals_the_full_trace_and_replay(name, stages, per_rank, defaults, checkpoint):
    fast, full = _both(LLAMA.format(defaults=defaults, checkpoint=checkpoint), stages, name, world=4,
                       per_rank=per_rank)
    _same(fast, full)


def test_compressed_equals_the_full_trace_under_tensor_parallelism():
    # torchtitan's Llama 3 plan (sequence parallel, loss parallel) as plans/zoo-llama-tp.plan states it
    text = (ROOT / "plans" / "zoo-llama-tp.plan").read_text().replace("model planc.zoo:llama\n", "model planc.zoo:llama_tiny\n")
    fast, full = _both(text, TWO, "1F1B", world=8)
    assert fast[1].stages[0].boundary_bytes > 0
    _same(fast, full)


def test_stage_flops_sum_to_flop_counter_on_the_whole_real_step():
    model = _llama()
    text = LLAMA.format(defaults="", checkpoint="")
    compiled = planc.compile(planc.loads(text, filename="pp.plan"), model, 2)
    job = pipeline_job(compiled.job, TWO, schedule("1F1B", 2, 4))
    est = estimate_pipeline_time(job, graph=compiled.graph, world=2, input_shape=(8, 16))
    tokens = torch.randint(0, zoo.LLAMA_TINY_CONFIG.vocab_size, (2, 16))  # one microbatch of 8 / 4
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    cfg = zoo.LLAMA_TINY_CONFIG
    # the estimate counts a GPU flash kernel, whose backward recomputes Q K^T (one more matmul per
    # attention than the math kernel counted here)
    flash = N * 2 * 2 * cfg.n_heads * 16 * 16 * (cfg.dim // cfg.n_heads)
    assert sum(s.forward_flops + s.backward_flops for s in est.stages) == counter.get_total_flops() + flash
    assert est.model_flops == 4 * (counter.get_total_flops() + flash)  # 4 microbatches, 1 data-parallel rank


def test_a_stage_of_bf16_units_is_priced_at_the_bf16_rate():
    compiled = planc.compile(planc.loads(LLAMA.format(defaults=BF16, checkpoint=""), filename="pp.plan"), _llama(), 2)
    job = pipeline_job(compiled.job, TWO, schedule("1F1B", 2, 4))  # stage 0: a sixth of the blocks
    est = estimate_pipeline_time(job, graph=compiled.graph, world=2, input_shape=(8, 16))
    rate = est.hardware.bf16_flops * est.hardware.efficiency
    for st in est.stages:
        assert st.forward_s == pytest.approx(st.forward_flops / rate, rel=1e-12)
        assert st.backward_s == pytest.approx(st.backward_flops / rate, rel=1e-12)
