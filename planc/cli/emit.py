"""`planc emit PLAN`: the plan's sharding printed as plain Python (planc/backends/emit.py)."""

from __future__ import annotations

import os
import sys

from planc.backends.emit import emit_python
from planc.cli.common import UsageError, use_color
from planc.compiler import CompiledPlan
from planc.diagnostics import render, sort_diagnostics
from planc.lang.parse import load_with_diagnostics
from planc.model.build import ModelLoadError, build_model
from planc.model.graph import ModelGraph


def main(args) -> int:
    """`planc emit PLAN [--model M:F]`: print the code; 1 if the plan has errors, 2 on I/O problems.

    The plan is checked without a world size (the emitted code takes any mesh), so checks
    that need one (mesh fit, reshard and placement divisibility) are left to `planc check`.
    """
    plan, diags = load_with_diagnostics(args.plan)
    if plan is None or any(d.is_error for d in diags):
        sources = dict(plan.sources) if plan is not None else {}
        print(render.render_text(diags, sources, color=use_color(sys.stderr)), file=sys.stderr)
        return 2 if plan is None else 1
    ref = args.model or plan.model_ref
    if ref is None:
        raise UsageError("emit needs a model: a `model` line in the plan, or --model MODULE:CALLABLE")
    try:
        model = build_model(ref, base=None if args.model else os.path.dirname(os.path.abspath(args.plan)))
    except ModelLoadError as err:
        raise UsageError(f"cannot build `{ref}`: {err}") from err
    compiled = CompiledPlan(plan, ModelGraph.from_module(model), None)
    diags = sort_diagnostics(list(diags) + list(compiled.diagnostics))
    if diags:  # warnings too, on stderr: stdout stays a clean Python module
        print(render.render_text(diags, compiled.sources, color=use_color(sys.stderr)), file=sys.stderr)
    if any(d.is_error for d in diags):
        return 1
    print(emit_python(compiled, plan_path=args.plan, model_ref=ref), end="")
    return 0
