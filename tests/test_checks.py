"""The check registry: each check declares what it needs, and the driver runs exactly those.

Each check is a plain function over a `Context`; these tests call some alone, and check that
what runs with and without a model, a world size and the memory model follows from the
declarations in `CHECKS`, not from special cases in the compiler.
"""

from __future__ import annotations

import pytest
from ui_models import fixture_net, shared_net

import planc
from planc.checks import context, validate
from planc.checks.context import MEMORY, MODEL, WORLD, Check, Context
from planc.checks.mesh import check_mesh, check_rank_limits
from planc.checks.structure import check_shared_modules, check_tied
from planc.model.graph import ModelGraph
from planc.resolve.resolver import resolve


def _context(text: str, model=None, world: int | None = None) -> Context:
    plan = planc.loads(text, filename="t.plan")
    graph = None if model is None else ModelGraph.from_module(model)
    res, _ = resolve(plan, graph)
    return Context(plan, graph, res, world)


def test_every_registered_check_declares_known_needs_and_is_listed_once():
    names = [c.name for c in validate.CHECKS]
    assert len(names) == len(set(names))
    assert all(c.needs <= context.NEEDS for c in validate.CHECKS)
    with pytest.raises(ValueError, match="unknown inputs"):
        Check(check_mesh, frozenset({"gpu"}))


@pytest.mark.parametrize("available,expected", [
    (frozenset(), {"check_rank_limits", "check_tensor_last", "check_context_sequence",
                   "check_pipeline_reshard", "check_pipeline_checkpoint", "check_pipeline_microbatches", "check_pipeline_batch",
                   "check_expert_mesh", "check_expert_layer_styles", "check_metric_lines"}),
    (frozenset({WORLD}), {"check_rank_limits", "check_mesh", "check_tensor_last",
                          "check_context_sequence", "check_pipeline_reshard", "check_pipeline_checkpoint",
                          "check_pipeline_microbatches",
                          "check_pipeline_batch", "check_expert_mesh", "check_expert_layer_styles",
                          "check_metric_lines"}),
    (frozenset({MODEL, WORLD, MEMORY}), {c.name for c in validate.CHECKS}),
])
def test_what_runs_follows_from_the_declarations(available, expected):
    assert {c.name for c in validate.CHECKS if c.runs_with(available)} == expected


def test_without_a_model_only_model_free_checks_run():
    # a mesh that does not fit, a bad metric line and a unit rule: without a model only the
    # first two can be judged, and the compiler asks for nothing else
    text = "mesh (replicate = 3, shard = *)\nunit blocks.*\nexpect units == 1GiB\n"
    compiled = planc.compile(planc.loads(text, filename="t.plan"), None, world_size=8, strict=False)
    assert [d.code for d in compiled.diagnostics] == ["P401", "P103"]
    ctx = _context(text, world=8)
    assert ctx.available == frozenset({WORLD})


def test_a_check_runs_alone_on_a_context():
    ctx = _context("mesh (replicate = 4096, shard = 4096)\n")
    assert [d.code for d in check_rank_limits(ctx)] == ["P407"]
    ctx = _context("unit blocks.*\n", shared_net())
    (shared,) = check_shared_modules(ctx)
    assert "`blocks.0.mlp` is also registered at `blocks.1.mlp`" in shared.message
    assert list(check_tied(ctx)) == []  # the tie embed/head/extra_head stays in the root


def test_failed_expectations_do_not_stop_memory_expects():
    # P501 on an `expect unit` line is about the expectation, not the plan: the memory line
    # after it is still evaluated (here it fails, P502)
    text = ("model tests.ui_models:fixture_net\nunit layers.*\nexpect unit norm\n"
            "expect memory.peak <= 1KiB at world = 2\n")
    compiled = planc.compile(planc.loads(text, filename="t.plan"), fixture_net(), strict=False)
    assert [d.code for d in compiled.diagnostics] == ["P501", "P502"]


def test_an_invalid_plan_skips_memory_expects():
    text = ("model tests.ui_models:fixture_net\nunit layers.* { reshard after_forward = 3 }\n"
            "expect memory.peak <= 1KiB\n")
    compiled = planc.compile(planc.loads(text, filename="t.plan"), fixture_net(), world_size=4, strict=False)
    assert [d.code for d in compiled.diagnostics] == ["P402"]
