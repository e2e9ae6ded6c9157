"""A pipeline job flows through the estimators' usual entry points (memory.estimate, `expect memory.peak`,
estimate_step_time) by the per-role path.

Until the plan language writes a pipeline, the tests cut the compiled plan's job with
`pipeline_job` and give it to the compiled plan (its `job`). Oracles: the per-rank estimates
(tests/test_roles_memory_dist.py holds them against FSDPMemTracker) and the timeline.
"""

from __future__ import annotations

import pytest

import planc
from planc.compiler import CompiledPlan
from planc.estimate import memory
from planc.estimate.role_memory import estimate_pipeline_memory
from planc.estimate.roles import estimate_pipeline_time
from planc.estimate.time import estimate_step_time
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
STAGES = [("tok_embeddings", "layers.0"), ("layers.1", "norm", "output")]


def _pipelined(extra: str = "") -> CompiledPlan:
    base = planc.compile(planc.loads(PLAN, filename="pp.plan"), llama_tiny(), 4)
    compiled = CompiledPlan(planc.loads(PLAN + extra, filename="pp.plan"), base.graph, 4)
    compiled.__dict__["job"] = pipeline_job(base.job, STAGES, schedule("1F1B", 2, 4))
    return compiled


def test_memory_estimate_of_a_pipeline_is_the_binding_rank():
    compiled = _pipelined()
    ranks = estimate_pipeline_memory(compiled, 4, input_shape=(8, 16))
    est = memory.estimate(compiled, 4, input_shape=(8, 16))
    assert [r.peak.total for r in est.roles] == [r.peak.total for r in ranks]
    assert est.peak.total == max(r.peak.total for r in ranks) > min(r.peak.total for r in ranks)


def test_expect_memory_peak_holds_for_every_pipeline_rank():
    peaks = sorted(r.peak.total for r in estimate_pipeline_memory(_pipelined(), 4, input_shape=(8, 16)))
    between = (peaks[0] + peaks[1]) / 2 / 1024  # above one rank's peak, below the other's
    failing = _pipelined(f"expect memory.peak <= {between:.1f}KiB at world = 4, input = 8x16\n")
    assert [d.code for d in failing.diagnostics] == ["P502"]
    holding = _pipelined(f"expect memory.peak <= {-(-peaks[1] // 1024)}KiB at world = 4, input = 8x16\n")
    assert holding.diagnostics == []


def test_without_an_input_each_rank_counts_its_state():
    est = memory.estimate(_pipelined(), 4)  # no input: no activations
    for role in est.roles:
        assert role.activations is None and role.peak.bytes["activations"] == 0
        state = sum(m.sharded + m.optimizer for m in role.units)
        assert role.peak.bytes["sharded_params"] + role.peak.bytes["optimizer_state"] == state
    bound = est.peak.total / 1024 - 1  # just under the binding rank's peak
    assert [d.code for d in _pipelined(f"expect memory.peak <= {bound:.1f}KiB at world = 4\n").diagnostics] == ["P502"]


def test_step_time_of_a_pipeline_is_the_slowest_rank():
    compiled = _pipelined()
    st = estimate_step_time(compiled, world=4, input_shape=(8, 16))
    pt = estimate_pipeline_time(compiled, world=4, input_shape=(8, 16))
    assert st.total_s == pytest.approx(pt.step_s) and st.pipeline.bubble == pytest.approx(pt.bubble)
    binding = pt.timeline.ranks[pt.timeline.binding_rank]
    assert [u.name for u in st.per_unit] == [f"stage {s}" for s in binding.stages]
    assert st.mfu == pytest.approx(pt.mfu) and st.tokens_per_s == pytest.approx(pt.tokens_per_s)


def test_explain_shows_a_table_per_stage_and_the_binding_rank():
    from planc.analysis.explain import render_text, report

    compiled = _pipelined()
    est = memory.estimate(compiled, 4, input_shape=(8, 16))
    data = report(compiled, est, step_time=estimate_step_time(compiled, world=4, input_shape=(8, 16)))
    model = llama_tiny()
    pp = data["pipeline"]
    for row, modules in zip(pp["stages"], STAGES):  # oracle: the real model's parameters under the stage
        assert row["modules"] == list(modules)
        assert row["params"] == sum(p.numel() for n, p in model.named_parameters() if n.startswith(modules))
        assert row["peak_bytes"] == est.roles[row["rank"]].peak.total
    assert pp["binding_rank"] == max(range(2), key=lambda r: est.roles[r].peak.total)
    assert data["world_size"] == 4 and data["memory"]["peak_bytes"] == est.peak.total
    text = render_text(data, compiled)
    assert "stage  rank  modules" in text and f"binding rank {pp['binding_rank']}: peak" in text
    assert "layers.1, norm, output" in text and "bubble" in text


def test_a_mesh_with_the_pipeline_axis_prices_each_stage_on_its_own_ranks():
    # what the plan language will lower: the pipeline axis outermost on the mesh, the data axis `*`
    import dataclasses

    from planc.resolve.mesh import Mesh, Role

    compiled = _pipelined()
    job = compiled.job
    mesh = Mesh.of({Role.PIPELINE: 2, Role.SHARD: None})
    assert mesh.sizes(4)[Role.SHARD] == 2
    parts = tuple(dataclasses.replace(p, program=dataclasses.replace(p.program, mesh=mesh)) for p in job.parts)
    with_axis = dataclasses.replace(job, parts=parts, mesh=mesh)
    for a, b in zip(estimate_pipeline_memory(with_axis, 4, graph=compiled.graph, input_shape=(8, 16)),
                    estimate_pipeline_memory(job, 4, graph=compiled.graph, input_shape=(8, 16))):
        assert (a.peak.total, a.shard) == (b.peak.total, b.shard)
    t_axis = estimate_pipeline_time(with_axis, graph=compiled.graph, world=4, input_shape=(8, 16))
    t_plain = estimate_pipeline_time(job, graph=compiled.graph, world=4, input_shape=(8, 16))
    assert t_axis.step_s == pytest.approx(t_plain.step_s) and t_axis.tokens == t_plain.tokens


def test_boundaries_are_what_one_tensor_rank_holds():
    # sequence parallel: each tensor rank holds its seq / tp tokens of a block's output; loss
    # parallel: its vocab / tp of the logits (oracle: the shapes, by hand)
    from planc.estimate.roles import boundaries

    text = open("plans/zoo-llama-tp.plan").read().replace("planc.zoo:llama\n", "planc.zoo:llama_tiny\n")
    compiled = planc.compile(planc.loads(text, filename="tp.plan"), llama_tiny(), 8)
    job = pipeline_job(compiled.job, STAGES, schedule("1F1B", 2, 4))
    cfg = llama_tiny().config
    b, s, tp = 2, 16, 2
    plain = boundaries(job, compiled.graph, input_shape=(b, s), tp=1)
    split = boundaries(job, compiled.graph, input_shape=(b, s), tp=tp)
    assert plain == [0, b * s * cfg.dim * 4, b * s * cfg.vocab_size * 4]
    assert split == [0, b * s // tp * cfg.dim * 4, b * s * cfg.vocab_size // tp * 4]
