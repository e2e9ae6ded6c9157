"""Validation: every check over a resolved plan, in one ordered registry, run by what it needs.

`CHECKS` lists them once, in the order their findings are reported (the sqlglot `RULES`
pattern); each entry declares the inputs it needs (`planc/checks/context.py`), and
`validate` runs exactly those the compile can feed: without a model only the mesh and the
`expect` lines read alone are checked. Each check reads a `Context` and never mutates it, so
each can be tested alone. The checks live by family: `structure`, `precision`, `mesh`,
`rules`, `tensor` (tensor parallelism), `context_parallel`, `pipeline`, `experts`, `expect`.
"""

from __future__ import annotations

import dataclasses

from planc.checks.chain import check_pipeline_chain
from planc.checks.context import MEMORY, MODEL, WORLD, Check, Context
from planc.checks.context_parallel import (
    check_context_modules,
    check_context_sequence,
    check_context_unused,
)
from planc.checks.expect import METRICS, check_expects, check_memory_expects, check_metric_lines, metric_problems
from planc.checks.experts import (
    check_expert_layer_styles,
    check_expert_mesh,
    check_expert_modules,
    check_expert_placements,
    check_expert_unused,
)
from planc.checks.mesh import check_mesh, check_placements, check_rank_limits, check_reshard_size
from planc.checks.pipeline import (
    check_pipeline_batch,
    check_pipeline_checkpoint,
    check_pipeline_microbatches,
    check_pipeline_reshard,
    check_pipeline_rules,
    check_pipeline_stages,
    check_pipeline_tied,
    check_pipeline_units,
)
from planc.checks.precision import check_ignored_precision, check_precision
from planc.checks.rules import check_root_reshard, check_shadowed
from planc.checks.structure import (
    check_containers,
    check_group_root,
    check_never_called,
    check_scalar,
    check_shared_modules,
    check_tied,
    check_unowned,
)
from planc.checks.tensor import (
    check_colwise_consumed,
    check_heads,
    check_rowwise_fed,
    check_sequence_length,
    check_sequence_norms,
    check_split_modules,
    check_split_sizes,
    check_tensor_last,
    check_tied_placements,
)
from planc.checks.tensor_holes import check_fused_colwise, check_replicated_head_params, check_same_meshes
from planc.diagnostics import Diagnostic

__all__ = ["CHECKS", "METRICS", "Check", "Context", "metric_problems", "validate"]

_MODEL = frozenset({MODEL})

CHECKS: tuple[Check, ...] = (
    Check(check_containers, _MODEL),
    Check(check_never_called, _MODEL),
    Check(check_group_root, _MODEL),
    Check(check_tied, _MODEL),
    Check(check_shared_modules, _MODEL),
    Check(check_unowned, _MODEL),
    Check(check_scalar, _MODEL),
    Check(check_ignored_precision, _MODEL),
    Check(check_precision, _MODEL),
    Check(check_rank_limits),
    Check(check_mesh, frozenset({WORLD})),
    Check(check_reshard_size, frozenset({MODEL, WORLD})),
    Check(check_placements, _MODEL),
    Check(check_tensor_last),
    Check(check_split_modules, _MODEL),
    Check(check_heads, _MODEL),
    Check(check_split_sizes, _MODEL),
    Check(check_sequence_length, _MODEL),
    Check(check_colwise_consumed, _MODEL),
    Check(check_rowwise_fed, _MODEL),
    Check(check_sequence_norms, _MODEL),
    Check(check_same_meshes, _MODEL),
    Check(check_replicated_head_params, _MODEL),
    Check(check_fused_colwise, _MODEL),
    Check(check_tied_placements, _MODEL),
    Check(check_context_unused, _MODEL),
    Check(check_context_modules, _MODEL),
    Check(check_context_sequence),
    Check(check_pipeline_stages, _MODEL),
    Check(check_pipeline_units, _MODEL),
    Check(check_pipeline_rules, _MODEL),
    Check(check_pipeline_tied, _MODEL),
    Check(check_pipeline_chain, _MODEL),
    Check(check_pipeline_reshard),
    Check(check_pipeline_checkpoint),
    Check(check_pipeline_microbatches),
    Check(check_pipeline_batch),
    Check(check_expert_mesh),
    Check(check_expert_unused, _MODEL),
    Check(check_expert_modules, _MODEL),
    Check(check_expert_placements, _MODEL),
    Check(check_expert_layer_styles),
    Check(check_root_reshard, _MODEL),
    Check(check_shadowed, _MODEL),
    Check(check_metric_lines, about_expectations=True),
    Check(check_expects, _MODEL, about_expectations=True),
    Check(check_memory_expects, frozenset({MODEL, MEMORY}), about_expectations=True),
)


def validate(ctx: Context, checks: tuple[Check, ...] = CHECKS) -> list[Diagnostic]:
    """Run every check whose needs `ctx` meets, in order, and collect all findings."""
    out: list[Diagnostic] = []
    invalid = False
    for check in checks:
        if ctx.metrics is not None and invalid:
            # NOTE: memory estimates of a plan with errors are meaningless (and the memory
            # model may assume a valid plan, e.g. placements on existing dims): skip them.
            ctx = dataclasses.replace(ctx, metrics=None)
        if check.runs_with(ctx.available):
            found = list(check.fn(ctx))
            invalid = invalid or (not check.about_expectations and any(d.is_error for d in found))
            out.extend(found)
    return out
