"""The syntax nodes under a cursor: the statement and every node inside it that holds the position."""

from __future__ import annotations

import dataclasses
from typing import Any

from planc.lang import syntax as st
from planc.lsp.positions import contains


def _children(node: Any):
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        for v in value if isinstance(value, tuple) else (value,):
            if dataclasses.is_dataclass(v) and hasattr(v, "span"):
                yield v


def chain_at(plan: st.Plan, filename: str, line: int, column: int) -> list[Any]:
    """[statement, ..., innermost node] whose spans hold (line, column) in `filename`
    (the top file; statements spliced from includes are not under any cursor); [] if none."""
    for stmt in plan.statements:
        if stmt.span.file == filename and contains(stmt.span, line, column):
            chain = [stmt]
            while True:
                inner = next((c for c in _children(chain[-1]) if contains(c.span, line, column)), None)
                if inner is None:
                    return chain
                chain.append(inner)
    return []


def statement_index(plan: st.Plan, stmt: Any) -> int:
    """Where `stmt` stands in effect order (identity, not equality: equal rules may repeat)."""
    return next(i for i, s in enumerate(plan.statements) if s is stmt)
