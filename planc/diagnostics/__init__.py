"""Diagnostics: what every stage reports, the registry of codes, renderers, `PlanError`.

    core.py    Span, Diagnostic, "did you mean" suggestions
    codes.py   CODES: every code with its title and explanation (`planc codes`)
    render.py  rustc-style text, JSON, GitHub annotations (pure functions)
    error.py   PlanError, raised only at the API boundary
"""

from planc.diagnostics.codes import CODES, Code
from planc.diagnostics.core import Diagnostic, Severity, Span, did_you_mean, sort_diagnostics, suggestion
from planc.diagnostics.error import PlanError

__all__ = ["CODES", "Code", "Diagnostic", "PlanError", "Severity", "Span", "did_you_mean", "sort_diagnostics",
           "suggestion"]
