"""`PlanError`: raised at the API boundary, carrying every diagnostic of a plan."""

from __future__ import annotations

from dataclasses import dataclass, field

from planc.diagnostics.core import Diagnostic
from planc.diagnostics.render import render_text


@dataclass
class PlanError(Exception):
    """A plan failed to load, compile or apply; carries every diagnostic, not only the first."""

    diagnostics: list[Diagnostic] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        errors = [d for d in self.diagnostics if d.is_error]
        head = f"plan has {len(errors)} error(s)"
        return head + "\n" + render_text(self.diagnostics, self.sources, color=False)

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.is_error]
