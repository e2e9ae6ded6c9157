"""What every command shares: exit codes, usage errors, colour, and compiling a plan file.

Exit codes (CI relies on them): 0 no errors (warnings allowed), 1 the plan has errors,
2 usage or I/O problems (a missing plan file, a model that cannot be built from `--model`).
"""

from __future__ import annotations

import os
from typing import Sequence

from planc.compiler import CompiledPlan
from planc.diagnostics import Diagnostic, sort_diagnostics
from planc.lang.parse import load_with_diagnostics
from planc.model.build import ModelLoadError
from planc.model.cache import ModelCache

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A problem with how planc was called; printed as `planc: error: ...`, exit 2."""


def use_color(stream) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (no-color.org)."""
    return hasattr(stream, "isatty") and stream.isatty() and not os.environ.get("NO_COLOR")


def compile_for_cli(path: str, model_ref: str | None, world_sizes: Sequence[int | None], cache: ModelCache,
                    routing: str | None = None) -> tuple[list[CompiledPlan], list[Diagnostic], dict[str, str], bool]:
    """Compile one plan file for each world size, with the routing histogram file `routing`
    (`--routing`) if given.

    Returns the compiled plans, the diagnostics (deduplicated over world sizes), the
    sources for rendering, and whether an I/O problem occurred (exit 2: the plan or the
    routing file cannot be read).
    """
    plan, diags = load_with_diagnostics(path)
    if plan is None:
        return [], diags, {}, True
    sources = dict(plan.sources)
    measured = None
    if routing is not None:
        from planc.estimate.routing import RoutingError, load_routing
        try:
            measured = load_routing(routing)
        except RoutingError as err:  # P437, located in the file
            if err.text is not None:
                sources[routing] = err.text
            return [], diags + [err.diagnostic], sources, err.text is None
    if any(d.is_error for d in diags):
        return [], diags, sources, False
    ref = model_ref or plan.model_ref
    graph = None
    if ref is not None:
        try:
            graph = cache.graph(ref, None if model_ref else os.path.dirname(os.path.abspath(path)))
        except ModelLoadError as err:
            if model_ref is not None:
                raise UsageError(f"--model {model_ref}: {err}") from err
            stmt = next(s for s in reversed(plan.statements) if getattr(s, "ref", None) == ref)
            diags.append(Diagnostic(code="P106", severity="error", message=str(err), span=stmt.span,
                                    label="this model", help=(err.help or "check the module path and that its "
                                                              "package is installed; or pass `--model`",)))
    compiled = [CompiledPlan(plan, graph, w, routing=measured) for w in world_sizes]
    seen = set()
    for c in compiled:
        for d in c.diagnostics:
            key = (d.code, d.span, d.message)
            if key not in seen:
                seen.add(key)
                diags.append(d)
    return compiled, sort_diagnostics(diags), sources, False
