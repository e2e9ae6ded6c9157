"""Diagnostics: spans and findings, the values every stage reports problems with.

Every problem planc reports is a `Diagnostic` with a code from `CODES`, a severity, a terse
message in the user's words, a primary span, and `help:` lines saying how to fix it. Stages
collect diagnostics in lists; `PlanError` (`planc/diagnostics/error.py`) is raised only at the
API boundary, carrying all of them. The codes are registered in `codes.py`, rendered by `render.py`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable

from planc.diagnostics.codes import CODES, Severity


@dataclass(frozen=True, slots=True)
class Span:
    """A region of a source file; lines and columns start at 1, `end_column` is exclusive."""

    file: str
    line: int
    column: int
    end_line: int
    end_column: int

    @classmethod
    def point(cls, file: str, line: int = 1, column: int = 1) -> "Span":
        return cls(file, line, column, line, column + 1)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Diagnostic:
    """One finding: `code` from `CODES`, a message, where, and how to fix it."""

    code: str
    severity: Severity
    message: str
    span: Span | None = None
    label: str = ""
    help: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    related: tuple[tuple[Span, str], ...] = ()

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise KeyError(f"unregistered diagnostic code {self.code}")

    @property
    def is_error(self) -> bool:
        return self.severity == "error"


def did_you_mean(word: str, candidates: Iterable[str], n: int = 1) -> list[str]:
    """Close matches for `word` among `candidates`, best first (difflib, as ruff does)."""
    pool = sorted(set(candidates))
    exact_case = [c for c in pool if c.lower() == word.lower() and c != word]
    return (exact_case + difflib.get_close_matches(word, pool, n=n, cutoff=0.6))[:n]


def suggestion(word: str, candidates: Iterable[str]) -> tuple[str, ...]:
    """A `help:` line naming the closest candidate, or nothing."""
    best = did_you_mean(word, candidates)
    return (f"did you mean `{best[0]}`?",) if best else ()


def sort_diagnostics(diags: list[Diagnostic]) -> list[Diagnostic]:
    """Source order (file, line, column), as a reader goes through the plan; stable."""
    return sorted(diags, key=lambda d: (d.span.file, d.span.line, d.span.column) if d.span else ("", 0, 0))
