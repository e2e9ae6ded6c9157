"""The analytic memory model, one process: exact state bytes, the step replay's rules, expects,
and agreement with the fake-process-group simulation at 8 ranks.

(2-rank real runs: tests/test_memory_dist.py.)
"""

from __future__ import annotations

import pathlib

import pytest
import shipped
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

import planc
from planc import zoo
from planc.analysis.simulate import simulate, zoo_inputs
from planc.estimate import memory
from planc.estimate.trace import TraceError
from planc.lower import fsdp
from planc.model.graph import ModelGraph
from planc.quantities import show_bytes

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEED = (ROOT / "plans" / "seed.plan").read_text()
FP32 = "\ndefaults { precision param = fp32, reduce = fp32 }\n"
SHAPE = (2, 16)


def tiny(builder: str = "seed_transformer_tiny"):
    with torch.device("meta"):
        return zoo.ZOO[builder]()


def compile_text(text: str, world: int, builder: str = "seed_transformer_tiny"):
    return planc.compile(planc.loads(text, filename="test.plan"), tiny(builder), world)


# ===================================================================== exact state bytes


@settings(max_examples=200, deadline=None)
@given(dim0=hs.integers(1, 70), rest=hs.integers(1, 6), shard=hs.integers(1, 9))
def test_shard_numel_is_the_padded_torch_chunk(dim0, rest, shard):
    # FSDP2 allocates every rank the size of the first (largest) chunk, empty ranks included
    first = torch.chunk(torch.empty(dim0, rest, device="meta"), shard)[0]
    assert fsdp.shard_numel((dim0, rest), shard) == first.numel()


def test_world_of_one_holds_every_byte():
    c = compile_text(SEED + FP32, 1)
    est = memory.estimate(c, 1)
    total = sum(p.nbytes for p in c.graph.params.values())
    assert sum(u.sharded for u in est.units) == total
    assert sum(u.grads for u in est.units) == total


def test_uneven_rows_are_padded():
    est = memory.estimate(compile_text(SEED, 3), 3)
    emb = next(u for u in est.units if u.name == "embedding")
    assert emb.sharded == 43 * 32 * 4          # 128 rows over 3 ranks: 43 each, fp32
    assert emb.unsharded == 3 * 43 * 32 * 2    # the all-gather output is padded too, in bf16


def test_hsdp_shards_over_the_shard_dimension_only():
    hsdp = (ROOT / "plans" / "seed_hsdp.plan").read_text()
    a = memory.estimate(compile_text(hsdp, 4), 4)     # 2 replicas x 2 shards
    b = memory.estimate(compile_text(SEED, 2), 2)
    assert (a.replicate, a.shard) == (2, 2)
    assert [u.sharded for u in a.units] == [u.sharded for u in b.units]


def test_optimizer_state():
    c = compile_text(SEED, 4)
    adamw, sgd = memory.estimate(c, 4, optimizer="adamw"), memory.estimate(c, 4, optimizer="sgd")
    for u in adamw.units:
        n_tensors = len(u.param_names)
        assert u.optimizer == 2 * u.sharded + fsdp.STEP_COUNTER_BYTES * n_tensors
    assert all(u.optimizer == 0 for u in sgd.units)
    assert sgd.peak.total < adamw.peak.total


def test_offload_moves_state_to_the_host():
    base = memory.estimate(compile_text(SEED, 4), 4)
    off = memory.estimate(compile_text(SEED + "unit transformer_layers[-1:] { offload cpu }\n", 4), 4)
    unit = next(u for u in off.units if u.name == "transformer_layers.1")
    assert unit.offload and off.host == unit.sharded + unit.grads + unit.optimizer
    assert off.sharded_state == base.sharded_state - off.host


# ===================================================================== the step replay


def _end_of_forward(est: memory.Estimate) -> memory.Moment:
    return [m for m in est.timeline if m.phase == "forward"][-1]


def test_reshard_rules_at_the_end_of_forward():
    true = memory.estimate(compile_text(SEED, 8), 8)
    false = memory.estimate(compile_text(SEED + "unit transformer_layers.* { reshard after_forward = false }\n", 8), 8)
    two = memory.estimate(compile_text(SEED + "unit transformer_layers.* { reshard after_forward = 2 }\n", 8), 8)
    blocks = [u for u in true.units if u.name.startswith("transformer_layers.")]
    tail = next(u for u in true.units if u.name == "[norm, output]")   # kept: reshard false
    assert _end_of_forward(true).bytes["unsharded_params"] == tail.unsharded
    assert _end_of_forward(false).bytes["unsharded_params"] == tail.unsharded + sum(b.unsharded for b in blocks)
    assert _end_of_forward(two).bytes["unsharded_params"] == tail.unsharded + sum(b.unsharded // 2 for b in blocks)
    # kept blocks need no all-gather in backward; resharded ones do
    gathered = {m.gathered for m in false.timeline if m.phase == "backward"}
    assert not gathered & {b.name for b in blocks}
    gathered = {m.gathered for m in true.timeline if m.phase == "backward"}
    assert {b.name for b in blocks} <= gathered


def test_without_input_activations_are_left_out():
    est = memory.estimate(compile_text(SEED, 8), 8)
    assert est.activations is None and est.notes
    assert all(m.bytes["activations"] == 0 for m in est.timeline)


def test_checkpointing_lowers_activations():
    plain = memory.estimate(compile_text(SEED, 8), 8, input_shape=SHAPE)
    ckpt = memory.estimate(compile_text(SEED + "checkpoint transformer_layers.* full\n", 8), 8, input_shape=SHAPE)
    assert 0 < ckpt.activations < plain.activations


def test_bounds_bracket_the_peak():
    est = memory.estimate(compile_text(SEED, 8), 8, input_shape=SHAPE)
    assert est.lower_bound <= est.peak.total < est.unsharded_peak_baseline
    assert est.peak.phase == "backward" and est.peak.unit


# ===================================================================== expect lines


def test_memory_expects_are_checked():
    text = SEED + "expect memory.peak <= 1KiB at world = 8\nexpect memory.peak <= 70GiB at world = 64\n"
    c = planc.compile(planc.loads(text, filename="m.plan"), tiny(), 8, strict=False)
    p502 = [d for d in c.diagnostics if d.code == "P502"]
    assert len(p502) == 1 and "world = 8" in p502[0].message


def test_metric_values():
    c = compile_text(SEED, 8)
    est = memory.estimate(c, 8)
    assert memory.metric(c, "memory.peak", 8) == est.peak.total
    assert memory.metric(c, "memory.sharded", 8) == est.sharded_state
    assert memory.metric(c, "memory.activations", 8) is None
    traced = memory.estimate(c, 8, input_shape=SHAPE)
    assert memory.metric(c, "memory.peak", 8, SHAPE) == traced.peak.total > est.peak.total
    assert memory.metric(c, "memory.activations", 8, SHAPE) == traced.activations > 0


GPT_TINY = "model planc.zoo:gpt_tiny\nunit blocks.*\n"


def test_an_input_makes_a_bound_that_holds_on_state_alone_fail():
    # gpt_tiny on 8 ranks: 225.75 KiB without activations, 2.55 MiB with those of 8 x 64 tokens
    text = GPT_TINY + "expect memory.peak <= 1MiB at world = 8\nexpect memory.peak <= 1MiB at world = 8, input = 8x64\n"
    c = planc.compile(planc.loads(text, filename="m.plan"), tiny("gpt_tiny"), strict=False)
    (d,) = c.errors
    assert d.code == "P502" and d.span.line == 4
    without, with_input = memory.estimate(c, 8), memory.estimate(c, 8, input_shape=(8, 64))
    assert without.peak.total <= 2**20 < with_input.peak.total
    assert with_input.peak.bytes["activations"] > 0
    assert d.message == ("expected memory.peak <= 1MiB at world = 8, input = 8x64, but the estimate, activations "
                         f"included, is {show_bytes(with_input.peak.total)}")
    assert "--input-shape 8x64" in d.help[0]


def test_input_alone_takes_the_world_size_from_the_command_line():
    text = GPT_TINY + "expect memory.peak <= 1MiB at input = 8x64\n"
    for world, fails in ((8, True), (None, False)):
        c = planc.compile(planc.loads(text, filename="m.plan"), tiny("gpt_tiny"), world, strict=False)
        assert [d.code for d in c.diagnostics] == (["P502"] if fails else ["P503"])
    (d,) = c.diagnostics
    assert "no world size" in d.message


def test_expects_use_the_estimate_explain_reports(monkeypatch, tmp_path):
    """`expect ... input = BxS` is checked on exactly what `planc explain --input-shape BxS` shows."""
    import contextlib
    import io
    import json

    from planc import cli
    plan = tmp_path / "p.plan"
    plan.write_text("model planc.zoo:seed_transformer_tiny\nunit transformer_layers.*\n"
                    + "checkpoint transformer_layers.0\n"
                    + "expect memory.peak <= 1KiB at world = 8, input = 2x16\n"
                    + "expect memory.activations <= 1GiB at input = 2x16, world = 8\n"
                    + "expect memory.sharded <= 1GiB at world = 8, input = 2x16\n")
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["explain", str(plan), "--world-size", "8", "--input-shape", "2x16", "--format", "json"])
    assert code == 1  # the 1 KiB bound fails, and explain still reports
    reported = json.loads(out.getvalue())
    assert reported["input_shape"] == [2, 16]

    compiled, diags, _, _ = cli.compile_for_cli(str(plan), None, [None], cli.ModelCache())  # as `planc check`
    (c,) = compiled
    (p502,) = [d for d in diags if d.is_error]
    assert p502.code == "P502" and show_bytes(reported["memory"]["peak_bytes"]) in p502.message
    # the three lines share one estimate (one trace), and it is the one explain printed
    used = {k: v for k, v in c._estimates.items() if k[1] is not None}
    assert list(used) == [(8, (2, 16))]
    est = used[(8, (2, 16))]
    assert est.peak.total == reported["memory"]["peak_bytes"]
    assert est.activations == reported["memory"]["activations_bytes"]
    assert est.sharded_state == reported["totals"]["sharded_state_bytes"]
    from planc.estimate.trace import _TRACES
    assert [key[1][1] for key in _TRACES[c.graph] if key[1] is not None] == [(((2, 16), torch.long),)]


def test_the_traced_step_is_shared_across_world_sizes():
    from planc.estimate.trace import _TRACES
    graph = ModelGraph.from_module(tiny())  # as `planc check --world-size 8 64`: one graph, two compiles
    plan = planc.loads(SEED.split("expect")[0] + "expect memory.peak <= 1GiB at input = 2x16\n", filename="t.plan")
    at8, at64 = planc.compile(plan, graph, 8), planc.compile(plan, graph, 64)
    est8, est64 = at8.memory_at(8, (2, 16)), at64.memory_at(64, (2, 16))
    assert [key[1][1] for key in _TRACES[graph] if key[1] is not None] == [(((2, 16), torch.long),)]
    assert est8.activations == est64.activations > 0  # one trace ...
    assert est8.sharded_state > est64.sharded_state    # ... two world sizes
    other = planc.loads(SEED.split("expect")[0] + "checkpoint transformer_layers.*\n", filename="t.plan")
    ckpt = planc.compile(other, graph, 8).memory_at(8, (2, 16))
    assert ckpt.activations < est8.activations  # another step (checkpointing) is traced anew
    assert len([k for k in _TRACES[graph] if k[1] is not None]) == 2


def test_an_input_the_model_cannot_run_is_p504_on_the_shape():
    # gpt_tiny's context is 64 tokens; two lines with the same input trace (and fail) once
    text = GPT_TINY + ("expect memory.peak <= 1GiB at world = 8, input = 2x4096\n"
                       "expect memory.activations <= 1GiB at input = 2x4096, world = 8\n")
    c = planc.compile(planc.loads(text, filename="m.plan"), tiny("gpt_tiny"), strict=False)
    assert [(d.code, d.span.line, d.span.column) for d in c.diagnostics] == [("P504", 3, 50), ("P504", 4, 46)]
    assert "sequence length 4096 exceeds context_length 64" in c.diagnostics[0].message
    assert isinstance(c._estimates[(8, (2, 4096))], TraceError)


def test_no_input_can_be_built_without_the_model_object():
    import copy
    graph = copy.copy(ModelGraph.from_module(tiny("gpt_tiny")))
    graph.model = None  # a graph of shapes alone: nothing to run
    text = GPT_TINY + "expect memory.peak <= 1GiB at world = 8, input = 2x16\nexpect memory.peak <= 1GiB at world = 8\n"
    c = planc.compile(planc.loads(text, filename="m.plan"), graph, strict=False)
    (d,) = c.diagnostics
    assert d.code == "P504" and d.span.line == 3 and "no model to run" in d.message


@pytest.mark.parametrize("line,code,message", [
    ("expect memory.peak <= 1GiB at world = 8, input = 512", "P103", "`input = 512` has 1 size"),
    ("expect memory.peak <= 1GiB at world = 8, input = 2x512x4", "P103", "has 3 sizes"),
    ("expect memory.peak <= 1GiB at input = 0x512, world = 8", "P103", "the batch size is 0"),
    ("expect memory.peak <= 1GiB at world = 8, input = 2x0", "P103", "the sequence length is 0"),
    ("expect units == 3 at input = 2x16", "P104", "the input only changes memory"),
    ("expect memory.peak <= 1GiB at world = 0", "P103", "at least 1 rank"),
    ("expect units == 3 at world = 8", "P104", "the units do not depend on the world size"),
])
def test_bad_inputs_are_located_without_a_model(line, code, message):
    plan = planc.loads(GPT_TINY + line + "\n", filename="m.plan")
    for model in (None, tiny("gpt_tiny")):  # found by `planc check` with or without a model
        (d,) = planc.compile(plan, model, 8, strict=False).errors
        assert (d.code, d.span.line) == (code, 3) and message in d.message, d
        if "input" in line:
            assert line[d.span.column - 1:d.span.end_column - 1] == line.split("input = ")[1].split(",")[0]


def test_activations_bound_without_input_is_not_checked_and_says_so():
    c = compile_text(GPT_TINY + "expect memory.activations <= 1KiB at world = 8\n", 8, "gpt_tiny")
    (d,) = c.diagnostics
    assert (d.code, d.severity) == ("P503", "warning") and "no input shape" in d.message


# ===================================================================== against the simulation


def _zoo_plans():
    out = []
    for path in sorted((ROOT / "plans").glob("*.plan")):
        ref = planc.load(path).model_ref or ""
        if ref.startswith("planc.zoo:") and f"{ref.split(':')[1]}_tiny" in zoo.ZOO:
            out.append((path.name, f"{ref.split(':')[1]}_tiny"))
    return out


@pytest.mark.parametrize("name,builder", shipped.params(_zoo_plans(), lambda c: ROOT / "plans" / c[0],
                                                     ids=[n for n, _ in _zoo_plans()], world=8))
def test_estimate_within_10_percent_of_simulation_at_8_ranks(name, builder):
    plan = planc.load(ROOT / "plans" / name)
    est = memory.estimate(planc.compile(plan, tiny(builder), 8), 8, input_shape=SHAPE)
    sim = simulate(plan, zoo.ZOO[builder], 8, inputs=zoo_inputs(SHAPE))
    assert abs(est.peak.total - sim.peak) <= 0.10 * sim.peak, (est.peak.label, sim.moment)
    assert est.peak.bytes["sharded_params"] == sim.breakdown["sharded_params"]


VARIANTS = {  # seed.plan plus one change each; offload is left out: on a CPU-only build the
    # simulation cannot tell host memory from device memory
    "checkpoint": "checkpoint transformer_layers.* full\n",
    "checkpoint_selective": "checkpoint transformer_layers.* selective\n",
    "reshard_2": "unit transformer_layers.* { reshard after_forward = 2 }\n",
    "no_reshard": "unit transformer_layers.* { reshard after_forward = false }\n",
    "fp32": "defaults { precision param = fp32, reduce = fp32 }\n",
    "prefetch_lists": "defaults { prefetch forward = 1, backward = 2 }\n",
    "nested_units": "unit transformer_layers.*.mlp\n",
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_plan_variants_within_10_percent_of_simulation(variant):
    plan = planc.loads(SEED + VARIANTS[variant], filename=f"{variant}.plan")
    est = memory.estimate(planc.compile(plan, tiny(), 8), 8, input_shape=SHAPE)
    sim = simulate(plan, zoo.seed_transformer_tiny, 8, inputs=zoo_inputs(SHAPE))
    assert abs(est.peak.total - sim.peak) <= 0.10 * sim.peak, (est.peak.label, sim.moment)


def test_selective_checkpointing_keeps_less_than_none_and_more_than_full():
    """`selective` keeps matmul and attention outputs: activations fall between no
    checkpointing and `full`, in the analytic model as in the runtime's own policy."""
    acts = {}
    for mode in ("", "selective", "full"):
        text = SEED + (f"checkpoint transformer_layers.* {mode}\n" if mode else "")
        acts[mode] = memory.estimate(planc.compile(planc.loads(text), tiny(), 8), 8, input_shape=SHAPE).activations
    assert acts[""] > acts["selective"] > acts["full"], acts


def test_sgd_and_root_only_match_simulation():
    for text, optimizer in ((SEED, "sgd"), ("model planc.zoo:seed_transformer\nroot {}\n", "adamw")):
        plan = planc.loads(text, filename="v.plan")
        est = memory.estimate(planc.compile(plan, tiny(), 8), 8, input_shape=SHAPE, optimizer=optimizer)
        sim = simulate(plan, zoo.seed_transformer_tiny, 8, inputs=zoo_inputs(SHAPE), optimizer=optimizer)
        assert abs(est.peak.total - sim.peak) <= 0.10 * sim.peak
