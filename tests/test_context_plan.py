"""A context-parallel plan, statically: the `context` axis and style resolve and lower to the job
(`AttendOverContext` ops, FSDP over the flattened shard x context axis, the `ShardBatch` step op)."""

from __future__ import annotations

import pathlib

import torch

import planc
from planc import zoo
from planc.lower.job import ShardBatch
from planc.lower.program import AttendOverContext, FullyShard
from planc.resolve.mesh import Mesh, Role
from planc.zoo import llama_tiny

PLAN = """model planc.zoo:llama_tiny
mesh (shard = *, context = 2)
unit layers.*
parallel layers.*.attention context
"""


def _compiled(text: str = PLAN, world: int = 4):
    return planc.compile(planc.loads(text), llama_tiny(), world, strict=False)


def test_context_plan_lowers_to_attention_ops_flat_fsdp_and_batch_sharding():
    c = _compiled()
    assert c.ok, c.diagnostics
    job = c.job
    attends = job.program.of_type(AttendOverContext)
    assert [(op.module, op.axis) for op in attends] == [("layers.0.attention", "context"), ("layers.1.attention", "context")]
    assert {op.axes for op in job.program.of_type(FullyShard)} == {("shard_context",)}
    (shard,) = job.step_op(ShardBatch)
    assert (shard.axis, shard.balance) == ("context", "head-tail")
    assert dict(shard.tensors) == {"tokens": 1, "labels": 1, "positions": 0}
    assert shard.origin.span.line == 4


def test_flattened_axes_keep_the_plans_words_and_replicate_stays_outside():
    mesh = Mesh.of({Role.REPLICATE: 2, Role.SHARD: None, Role.CONTEXT: 2}, {Role.SHARD: "dp_shard", Role.CONTEXT: "cp"})
    assert mesh.flattened == {"dp_shard_cp": ("dp_shard", "cp")}
    assert mesh.fsdp_axis_names == ("replicate", "dp_shard_cp")
    assert Mesh().flattened == {} and Mesh().fsdp_axis_names == ("shard",)


def test_cp_spelling_is_the_context_axis():
    c = _compiled(PLAN.replace("context = 2", "cp = 2"))
    assert c.ok, c.diagnostics
    assert c.mesh.axis_name(Role.CONTEXT) == "cp" and c.mesh.sizes(4)[Role.CONTEXT] == 2


def test_context_style_needs_a_context_axis_and_takes_no_options():
    c = _compiled(PLAN.replace("mesh (shard = *, context = 2)", "mesh (shard = *)"))
    assert [d.code for d in c.errors] == ["P490"]
    c = _compiled(PLAN.replace("attention context", "attention context { balance round_robin }"))
    assert [d.code for d in c.errors] == ["P491"]


def test_supported_attention_is_the_zoo_llamas_and_not_other_modules():
    from planc.checks.context_parallel import KNOWN, supports_context
    from planc.zoo import llama3

    assert supports_context(llama3.Attention) and f"{llama3.Attention.__module__}.Attention" in KNOWN
    assert not supports_context(llama3.FeedForward) and not supports_context(llama3.TransformerBlock)


def test_one_error_per_mistake():
    """A broken `context` line is not also a P492; a context axis alone is; the sequence rule reads `input =`."""
    bare = "model planc.zoo:llama_tiny\nmesh (shard = *, context = 2)\nunit layers.*\n"
    assert [d.code for d in _compiled(bare).errors] == ["P492"]
    broken = bare + "parallel layers.*.attention context { x }\n"
    assert [d.code for d in _compiled(broken).errors] == ["P491"]
    fits = PLAN + "expect memory.peak <= 1GiB at world = 4, input = 2x16\n"
    assert _compiled(fits).errors == []
    assert [d.code for d in _compiled(fits.replace("2x16", "2x18")).errors] == ["P495"]


def _cli(*argv: str) -> tuple[int, str]:
    """`planc ARGV` from the repository root: (exit code, stdout and stderr together)."""
    import contextlib
    import io
    import os

    from planc import cli

    err, cwd = io.StringIO(), os.getcwd()
    os.chdir(pathlib.Path(__file__).resolve().parent.parent)
    try:
        with contextlib.redirect_stdout(err), contextlib.redirect_stderr(err):
            code = cli.main(list(argv))
    finally:
        os.chdir(cwd)
    return code, err.getvalue()


def test_shipped_plan_checks_and_explain_estimates_one_context_rank():
    """`planc check` passes the shipped context plan; `explain` estimates one context rank's step
    (memory and time: tests/test_context_memory_dist.py and tests/test_time_context.py hold the figures)."""
    assert _cli("check", "plans/zoo-llama-context.plan", "--world-size", "8")[0] == 0
    code, out = _cli("explain", "plans/zoo-llama-context.plan", "--model", "planc.zoo:llama_tiny", "--world-size", "8",
                     "--input-shape", "2x64")
    assert code == 0, out
    assert "shard x context 2, flattened; one context rank's step" in out
    assert "one of 2 context ranks: its sequence shard, K/V gathered" in out
    # K and V of 2 KV heads (not the 4 query heads they are repeated to), 2 layers, and their gradients' reduce-scatters
    assert "all-gather 64.00 KiB (context)" in out and "reduce-scatter 64.00 KiB (context)" in out


def test_fmt_writes_the_context_axis_and_style_canonically():
    from planc.lang.fmt import format_plan

    messy = "model planc.zoo:llama_tiny\nmesh (shard=*,cp=2)\nparallel   layers.*.attention   context\n"
    assert format_plan(messy) == ("model planc.zoo:llama_tiny\n\nmesh (shard = *, cp = 2)\n\n"
                                  "parallel layers.*.attention context\n")


def test_check_simulate_runs_the_context_step_after_checking_the_input_shape():
    """`--simulate` cuts the batch (`applied.shard_batch`) and runs the routed attention on the fake
    group; an `--input-shape` the context axis cannot cut is P495 first, located, not a traceback."""
    code, err = _cli("check", "--simulate", "--input-shape", "2x18", "plans/zoo-llama-context.plan", "--world-size", "8")
    assert code == 1 and "internal error" not in err
    assert "error[P495]: context = 2 cuts each sequence into 4 chunks, but `input = 2x18`" in err
    code, out = _cli("check", "--simulate", "--input-shape", "2x16", "plans/zoo-llama-context.plan", "--world-size", "8")
    assert code == 0 and "one training step simulated at world 8" in out, out


def test_fsdp_group_checks_count_the_flattened_shard_x_context_ranks():
    """`reshard after_forward = N` must divide the group FSDP shards over: shard x context (4 here)."""
    assert _compiled(PLAN.replace("mesh (shard = *, context = 2)", "mesh (shard = 2, context = 2)")
                     + "defaults { reshard after_forward = 4 }\n").errors == []
    bad = _compiled(PLAN.replace("mesh (shard = *, context = 2)", "mesh (shard = 2, context = 2)")
                    + "defaults { reshard after_forward = 3 }\n")
    assert [d.code for d in bad.errors] == ["P402"]
    assert Mesh.of({Role.SHARD: None, Role.CONTEXT: 2}).dp_sizes(8) == (1, 8)


def test_a_forward_without_positions_is_a_clear_error_not_a_wrong_result():
    """A loop that forgets `shard_batch` (a trainer integration, say) fails at the first forward."""
    import pytest
    import torch

    from planc.backends.context import attend_over_context

    model = llama_tiny()
    attend_over_context(model.layers[0].attention)
    with pytest.raises(RuntimeError, match="without `positions=`"):
        model(torch.zeros(1, 8, dtype=torch.long))


def test_a_refused_or_failed_forward_leaves_no_context_mode_behind():
    """The attention's SDPA routing ends with its forward, even when the forward raises."""
    import pytest
    import torch
    import torch.nn.functional as F

    from planc.backends.context import attend_over_context

    model = llama_tiny()
    attend_over_context(model.layers[0].attention)
    with pytest.raises(RuntimeError, match="without `positions=`"):
        model(torch.zeros(1, 8, dtype=torch.long))
    q = torch.randn(1, 2, 4, 8)
    plain = F.scaled_dot_product_attention(q, q, q, is_causal=True)  # no mode left active: no process group needed
    assert plain.shape == q.shape


class _NoPositions(__import__("torch").nn.Module):
    """The zoo Llama's layers under a forward that takes no `positions`."""

    def __init__(self):
        super().__init__()
        self.inner = llama_tiny()

    def forward(self, tokens):
        return self.inner(tokens)


def test_a_model_whose_forward_takes_no_positions_is_refused():
    text = "mesh (shard = *, context = 2)\nunit inner.layers.*\nparallel inner.layers.*.attention context\n"
    c = planc.compile(planc.loads(text), _NoPositions(), 4, strict=False)
    (d,) = c.errors
    assert d.code == "P493" and "`_NoPositions.forward` takes no `positions`" in d.message and d.span.line == 3


def _rules(path: str) -> list[str]:
    """A plan's statements without comments, `model`, `mesh` and `expect` lines."""
    text = (pathlib.Path(__file__).resolve().parent.parent / path).read_text()
    return [line for line in text.splitlines()
            if line.strip() and not line.startswith(("#", "model ", "mesh ", "expect "))]


def test_the_long_context_plan_and_its_tiny_sibling_have_the_same_rules():
    """The tiny sibling (4 ranks, what examples/train.py trains in CI) differs only in model and mesh."""
    big, tiny = _rules("plans/llama3-8b-long-context.plan"), _rules("plans/llama3-8b-long-context-tiny.plan")
    assert big == tiny and "parallel layers.*.attention context" in big


def test_the_long_context_plan_checks_and_its_bounds_hold_at_131072_tokens():
    """`planc check` accepts it (its `expect memory` lines at 64 ranks, one 131072-token sequence
    per context group, are estimated and hold); explain shows the context and tensor degrees."""
    code, out = _cli("check", "plans/llama3-8b-long-context.plan")
    assert code == 0 and "warning" not in out and "ok (35 units)" in out, out
    plan = planc.load(pathlib.Path(__file__).resolve().parent.parent / "plans/llama3-8b-long-context.plan")
    with torch.device("meta"):
        model = zoo.llama3_8b()
    compiled = planc.compile(plan, model, 64)
    assert compiled.mesh.sizes(64) == {"replicate": 1, "shard": 1, "context": 8, "tensor": 8}
    est = compiled.memory_at(64, (1, 131072))
    assert "one of 8 tensor-parallel ranks" in est.source and "one of 8 context ranks" in est.source
    assert 30 * 2**30 < est.peak.total <= 40 * 2**30  # the plan's bound, and not a vacuous one


def test_the_routed_attention_refuses_what_it_would_drop():
    """SDPA options the chunked attention does not apply (a scale, dropout, a mask) are refused,
    not dropped; plain causal SDPA and the grouped-query repeat route (identity gathers here)."""
    import pytest
    import torch
    import torch.nn.functional as F

    from planc.model.context_attention import RouteAttention

    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 1, 4, 8)
    seen = []
    with RouteAttention(lambda t: seen.append(t.shape[1]) or t, lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True)) as mode:
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(2, dim=1), k.repeat_interleave(2, dim=1),
                                             is_causal=True)
        assert seen == [1, 1] and out.shape == q.shape  # the 1 KV head gathered, then repeated
        for extra in ({"scale": 0.5}, {"dropout_p": 0.1}, {"attn_mask": torch.ones(4, 4, dtype=torch.bool)}):
            with pytest.raises(NotImplementedError, match="without a mask, scale or dropout"):
                F.scaled_dot_product_attention(q, q, q, is_causal=True, **extra)
        assert not mode.repeated
