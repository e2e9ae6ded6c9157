"""Gradient accumulation, the first schedule with more than one microbatch (`step { accumulate N }`).

Oracles: FSDPMemTracker on a fake process group running a hand-written accumulation loop
(`planc.analysis.simulate`), the collectives FSDP2 really issues in a fake-process-group
step (`planc.analysis.comms`), and one unsharded process that accumulates the same
microbatches (real gloo ranks, `accumulate_workers`).
"""

from __future__ import annotations

import collections
import pathlib

import accumulate_workers
import pytest
import torch
from distributed import run

import planc
from planc import zoo
from planc.analysis.comms import record_collectives
from planc.analysis.simulate import simulate, zoo_inputs
from planc.estimate import memory
from planc.estimate.time import estimate_step_time, unit_collectives
from planc.estimate.trace import MicrobatchError
from planc.lang.fmt import format_plan
from planc.lower.job import BACKWARD_INPUT, FORWARD, FULL_BACKWARD, Action

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEED = "".join(line + "\n" for line in (ROOT / "plans" / "seed.plan").read_text().splitlines()
               if not line.startswith("expect"))
FP32 = "defaults { precision param = fp32, reduce = fp32 }\n"
SHAPE = (8, 16)


def _compile(text: str, world: int = 8):
    with torch.device("meta"):
        model = zoo.seed_transformer_tiny()
    return planc.compile(planc.loads(text, filename="acc.plan"), model, world)


def test_step_line_lowers_to_the_microbatch_schedule():
    job = _compile(SEED + "step { accumulate 4, sync = last }\n").job
    schedule = job.schedule
    assert (schedule.microbatches, schedule.gradient_sync) == (4, "last")
    assert [str(a) for a in schedule.actions[0]] == ["0F0", "0B0", "0F1", "0B1", "0F2", "0B2", "0F3", "0B3"]
    assert [schedule.reduces(a) for a in schedule.actions[0] if a.kind == FULL_BACKWARD] == [False] * 3 + [True]
    every = _compile(SEED + "step { accumulate 3 }\n").job.schedule
    assert every.gradient_sync == "every" and all(every.reduces(a) for a in every.actions[0] if a.kind != FORWARD)
    assert _compile(SEED).job.schedule.microbatches == 1
    assert not schedule.reduces(Action(0, BACKWARD_INPUT, 3))


def test_step_line_formats_and_reads_back():
    text = "model planc.zoo:seed_transformer_tiny\nstep {accumulate 4,sync=last}\n"
    out = format_plan(text)
    assert "step { accumulate 4, sync = last }" in out
    assert _compile(out).job.schedule.gradient_sync == "last"


@pytest.mark.parametrize("k,sync,precision", [(4, "every", ""), (4, "last", ""), (4, "last", FP32),
                                              (2, "every", FP32)])
def test_peak_equals_fsdpmemtracker_on_an_accumulating_step(k, sync, precision):
    """The replay of k microbatches, byte for byte against torch's tracker of the same loop."""
    text = SEED + precision + f"step {{ accumulate {k}, sync = {sync} }}\n"
    est = memory.estimate(_compile(text), 8, input_shape=SHAPE)
    sim = simulate(planc.loads(text, filename="acc.plan"), zoo.seed_transformer_tiny, 8, inputs=zoo_inputs(SHAPE))
    assert est.peak.total == sim.peak, (est.peak.label, sim.moment)


def test_sync_on_the_last_keeps_unsharded_gradients_and_every_does_not():
    every = memory.estimate(_compile(SEED + FP32 + "step { accumulate 4 }\n"), 8, input_shape=SHAPE)
    last = memory.estimate(_compile(SEED + FP32 + "step { accumulate 4, sync = last }\n"), 8, input_shape=SHAPE)
    whole = memory.estimate(_compile(SEED + FP32), 8, input_shape=SHAPE)
    assert last.peak.bytes["unsharded_grads"] > 0 == every.peak.bytes["unsharded_grads"]
    assert every.activations < whole.activations  # a microbatch's activations, not the step's
    assert "microbatch" in last.peak.label


@pytest.mark.parametrize("sync", ["every", "last"])
def test_collectives_of_a_fake_step_equal_the_time_model(sync):
    """Every collective FSDP2 issues over the 4 microbatches (gradient sync set by `applied.gradient_sync`),
    counted per unit, equals the time model's list with its `times`."""
    text = SEED + f"step {{ accumulate 4, sync = {sync} }}\n"
    compiled = _compile(text)
    predicted = collections.Counter()
    for op, cs in zip(compiled.program.units, unit_collectives(compiled.program, compiled.graph, 8,
                                                               compiled.job.schedule)):
        for c in cs:
            predicted[(op.name, c.kind, c.phase, c.bytes)] += c.times
    recorded = collections.Counter((r.unit, r.kind, r.phase, r.bytes) for r in record_collectives(
        planc.loads(text, filename="acc.plan"), zoo.seed_transformer_tiny, 8, inputs=zoo_inputs(SHAPE)))
    assert recorded == predicted
    reduces = sum(n for (_, kind, _, _), n in recorded.items() if kind == "reduce_scatter")
    reducing = sum(1 for op in compiled.program.units if op.params)  # (the root owns no parameter here)
    assert reduces == reducing * (4 if sync == "every" else 1)


def test_step_time_runs_every_microbatch():
    with torch.device("meta"):
        model = zoo.seed_transformer()
    one = estimate_step_time(planc.compile(planc.loads(SEED), model, 64), world=64, input_shape=(8, 2048))
    times = {}
    for sync in ("every", "last"):
        c = planc.compile(planc.loads(SEED + f"step {{ accumulate 4, sync = {sync} }}\n"), model, 64)
        times[sync] = estimate_step_time(c, world=64, input_shape=(8, 2048))
    for st in times.values():
        assert st.model_flops == pytest.approx(one.model_flops, rel=1e-3)  # the same tokens, in 4 parts
        assert st.tokens == one.tokens
        assert st.totals()["all_gather"]["shard"] == 4 * one.totals()["all_gather"]["shard"]
    assert times["every"].totals()["reduce_scatter"]["shard"] == 4 * one.totals()["reduce_scatter"]["shard"]
    assert times["last"].totals()["reduce_scatter"]["shard"] == one.totals()["reduce_scatter"]["shard"]
    assert one.total_s < times["last"].total_s < times["every"].total_s


def test_a_batch_that_does_not_split_is_refused():
    compiled = _compile(SEED + "step { accumulate 4 }\n")
    with pytest.raises(MicrobatchError, match="does not divide into 4 microbatches"):
        memory.estimate(compiled, 8, input_shape=(2, 16))
    with pytest.raises(MicrobatchError, match="does not divide into 4 microbatches"):
        estimate_step_time(compiled, world=8, input_shape=(6, 16))


@pytest.mark.dist
def test_two_ranks_accumulating_train_like_one_process():
    """2 gloo ranks, FSDP2, 4 microbatches of 2 rows per rank, fp32, 3 AdamW steps: losses, the
    last step's gradients and the weights equal one process accumulating the global batch in 4
    microbatches; `sync = last` reduce-scatters once per unit per step, `every` once per microbatch."""
    ref = accumulate_workers.reference()
    for sync in ("every", "last"):
        results = run(accumulate_workers.worker, 2, sync)
        for rank, out in enumerate(results):
            assert out["losses"] == pytest.approx(ref["losses"], abs=1e-5), (sync, rank)
            for name, grad in ref["grads"].items():
                assert torch.allclose(out["grads"][name], grad, atol=1e-5, rtol=0), (sync, rank, name)
                # Adam moves a parameter by ~lr whatever its gradient's size, so a gradient that is
                # zero but for round-off (the attention's key bias) moves on round-off: compared
                # where the gradient is real
                real = grad.abs() > 1e-6
                assert torch.allclose(out["params"][name][real], ref["params"][name][real], atol=1e-5, rtol=0), \
                    (sync, rank, name)
            per_step = out["units"] * (accumulate_workers.K if sync == "every" else 1)
            assert out["reduce_scatters"] == accumulate_workers.STEPS * per_step, (sync, rank)
        assert ref["losses"][-1] < ref["losses"][0]  # it trains


def test_accumulate_splits_the_batch_and_refuses_what_does_not_split():
    from planc.backends.runtime import AppliedPlan

    applied = AppliedPlan(_compile(SEED + "step { accumulate 4 }\n"), None, None)
    with pytest.raises(ValueError, match="multiple of 4"):
        next(applied.accumulate(torch.zeros(6, 3)))
    assert applied.microbatches == 4


def test_emitted_accumulate_yields_and_syncs_as_the_runtime():
    """`planc emit`'s `accumulate(model, *batch)` against `AppliedPlan.accumulate` on a fake group:
    the same slices, and FSDP2's gradient-sync flag of every unit the same at each microbatch."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from planc.analysis.simulate import init_fake
    from planc.backends.emit import emit_python
    from planc.backends.runtime import build_mesh

    def flags(root):
        return [m._get_fsdp_state()._fsdp_param_group.reduce_grads for _, m in root.named_modules()
                if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None]

    for sync in ("every", "last"):
        text = SEED + f"step {{ accumulate 4, sync = {sync} }}\n"
        compiled = _compile(text)
        source = emit_python(compiled)
        batch = torch.arange(8 * 3).reshape(8, 3)
        init_fake(8)
        try:
            mesh = build_mesh(compiled.mesh, 8, "cpu")
            with torch.device("meta"):
                model, emitted = zoo.seed_transformer_tiny(), zoo.seed_transformer_tiny()
            applied = planc.apply(model, compiled, mesh=mesh)
            scope = {}
            exec(compile(source, "<emitted>", "exec"), scope)
            scope["apply_plan"](emitted, mesh)
            ours = [(mb, flags(model)) for (mb,) in applied.accumulate(batch)]
            theirs = [(mb, flags(emitted)) for (mb,) in scope["accumulate"](emitted, batch)]
        finally:
            dist.destroy_process_group()
        assert len(ours) == len(theirs) == 4
        for (a, fa), (b, fb) in zip(ours, theirs):
            assert torch.equal(a, b) and fa == fb
        expected = [[True] * len(ours[0][1])] * 4 if sync == "every" else \
            [[False] * len(ours[0][1])] * 3 + [[True] * len(ours[0][1])]
        assert [f for _, f in ours] == expected, sync
