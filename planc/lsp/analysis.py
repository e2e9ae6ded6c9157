"""One open document compiled as `planc check` would: parse, build the model once, resolve, validate.

`analyze` is the only place the language server calls the compiler. The model a plan names is
built on meta once per (reference, plan folder) and kept in a `ModelCache` (the one `planc
check` uses), failures included, so typing in a plan never rebuilds it. Without a `model`
line only the checks that need no model run (syntax, options, mesh, expect metrics).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from planc.compiler import CompiledPlan, sort_diagnostics
from planc.diagnostics import Diagnostic
from planc.lang import syntax as st
from planc.lang.parse import loads_with_diagnostics, parse_text
from planc.model.build import ModelLoadError
from planc.model.cache import ModelCache
from planc.model.graph import ModelGraph


@dataclass
class Analysis:
    """What the server knows about one version of a document."""

    text: str
    filename: str                     # the path diagnostics name (the document's file path)
    plan: st.Plan | None = None       # None only when the text cannot be a plan at all (P002)
    graph: ModelGraph | None = None   # the model, when the plan names one that builds
    compiled: CompiledPlan | None = None
    diagnostics: list[Diagnostic] = field(default_factory=list)

    @property
    def lines(self) -> list[str]:
        return self.text.split("\n")

    @property
    def folder(self) -> str:
        return os.path.dirname(self.filename) if not self.filename.startswith("<") else os.getcwd()


def _model_diagnostic(plan: st.Plan, ref: str, err: ModelLoadError) -> Diagnostic:
    """P106 at the `model` line that named `ref`, worded as `planc check` words it."""
    stmt = next(s for s in reversed(plan.statements) if getattr(s, "ref", None) == ref)
    return Diagnostic(code="P106", severity="error", message=str(err), span=stmt.span, label="this model",
                      help=(err.help or "check the module path and that its package is installed; or pass `--model`",))


def _model_line(text: str, filename: str) -> str | None:
    """The last `model` line that parses on its own: after a syntax error the parser's recovery
    may drop it, but completion and hover still want the model while a line is being typed."""
    ref = None
    for line in text.split("\n"):
        if line.lstrip().startswith("model"):
            stmts, _, errs = parse_text(line, filename)
            if not errs and stmts and isinstance(stmts[0], st.ModelStmt):
                ref = stmts[0].ref
    return ref


def analyze(text: str, filename: str, cache: ModelCache, world_size: int | None = None) -> Analysis:
    """Compile `text` (the unsaved buffer of `filename`); never raises for a bad plan.

    As `planc check` does, semantic checks run only on a plan without syntax errors; the
    model is built even then (from the `model` line that parsed) so completion and hover
    keep working while a line is half typed.
    """
    plan, diags = loads_with_diagnostics(text, filename)
    out = Analysis(text=text, filename=filename, plan=plan, diagnostics=list(diags))
    if plan is None:
        return out
    ref = plan.model_ref
    if ref is None and any(d.is_error for d in diags):
        ref = _model_line(text, filename)
    model_diag = None
    if ref is not None:
        try:
            out.graph = cache.graph(ref, out.folder)
        except ModelLoadError as err:
            model_diag = _model_diagnostic(plan, ref, err)
    out.compiled = CompiledPlan(plan, out.graph, world_size)
    if any(d.is_error for d in diags):
        return out
    found = list(diags) + ([model_diag] if model_diag else [])
    seen = {(d.code, d.span, d.message) for d in found}
    for d in out.compiled.diagnostics:
        if (d.code, d.span, d.message) not in seen:
            seen.add((d.code, d.span, d.message))
            found.append(d)
    out.diagnostics = sort_diagnostics(found)
    return out
