"""The canonical text of every syntax node: the one place plan text is spelled out.

`text(node)` prints any node of `planc.lang.syntax` (a selector, a value, an option, a
statement with its block on one line); `head(stmt)` a statement without its block;
`rule_name(stmt)` how explanations and diagnostics name a rule (`unit layers.*`,
`defaults`). The formatter (`planc.lang.fmt`) adds only layout and comments on top, the
syntax nodes' `__str__`, the resolver and the accelerate importer all print through here,
so a construct's spelling changes in one place. Printed text parses back to the same tree.
"""

from __future__ import annotations

import re
from typing import Any, Callable

# A model reference that needs no quotes (the grammar's MODEL_REF terminal).
MODEL_REF = re.compile(r"[A-Za-z_][\w.]*:[\w./-]+")


def quote(value: str) -> str:
    """A string literal: `"..."` with `\\` and `"` escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _optional(s) -> str:
    return "optional " if s.optional else ""


# ===================================================================== selectors


def _segment(s) -> str:
    if s.alternatives:
        return "{" + ",".join(s.alternatives) + "}"
    if s.is_slice:
        lo = "" if s.start is None else str(s.start)
        hi = "" if s.stop is None else str(s.stop)
        return f"{s.pattern}[{lo}:{hi}]"
    if s.index is not None:
        return f"{s.pattern}[{s.index}]"
    return s.pattern


def _path(p) -> str:
    return ".".join(_segment(s) for s in p.segments)


def _regex(r) -> str:
    # parse unescapes `\"`; escape it again so the text parses back to this pattern
    return 're"' + r.pattern.replace('"', '\\"') + '"'


def _guard(g) -> str:
    return ": " + " | ".join(g.classes)


def _where(w) -> str:
    return f"where {w.field} {w.op} {text(w.value)}"


def _exclusion(e) -> str:
    return f"except {text(e.base)}" + (f" {_guard(e.guard)}" if e.guard else "")


def _selector(s) -> str:
    parts = [text(s.base)]
    if s.guard:
        parts.append(_guard(s.guard))
    if s.where:
        parts.append(_where(s.where))
    parts.extend(_exclusion(e) for e in s.exclusions)
    return " ".join(parts)


def _bracketed(selectors) -> str:
    return "[" + ", ".join(_selector(s) for s in selectors) + "]"


# ===================================================================== values and options


def _call(c) -> str:
    return f"{c.name}(" + ", ".join(text(a) for a in c.args) + ")"


def _arg(a) -> str:
    return f"{a.key} = {text(a.value)}" if a.key else text(a.value)


def _option(o) -> str:
    return o.name + ("" if not o.args else " " + ", ".join(_arg(a) for a in o.args))


def block(b) -> str:
    """A block on one line: `{}`, `{ reshard false }`, `{ a; b }`."""
    if not b.options:
        return "{}"
    return "{ " + "; ".join(_option(o) for o in b.options) + " }"


# ===================================================================== statements


def _mesh(s) -> str:
    out = "mesh"
    if s.strategy:
        out += f" {s.strategy}"
    if s.axes:
        out += " (" + ", ".join(f"{d.name} = {'*' if d.size is None else d.size}" for d in s.axes) + ")"
    return out


def _expect_metric(s) -> str:
    # canonical order: world first, then input
    at = ([f"world = {s.world}"] if s.world is not None else []) + \
        ([f"input = {'x'.join(map(str, s.input_shape))}"] if s.input_shape is not None else [])
    return f"expect {s.metric} {s.op} {text(s.value)}" + (" at " + ", ".join(at) if at else "")


_HEADS: dict[str, Callable[[Any], str]] = {
    "ModelStmt": lambda s: f"model {s.ref}" if MODEL_REF.fullmatch(s.ref) else f"model {quote(s.ref)}",
    "IncludeStmt": lambda s: f"include {quote(s.path)}",
    "MeshStmt": _mesh,
    "DefaultsStmt": lambda s: "defaults",
    "UnitStmt": lambda s: f"{_optional(s)}unit {text(s.target)}",
    "RootStmt": lambda s: "root none" if s.disabled else "root",
    "CheckpointStmt": lambda s: f"{_optional(s)}checkpoint {_selector(s.selector)}" +
    (f" {s.mode.value}" if s.mode else ""),
    "CompileStmt": lambda s: f"{_optional(s)}compile {_selector(s.selector)}",
    "ParallelStmt": lambda s: f"{_optional(s)}parallel {_selector(s.selector)} {s.style.value}",
    "IgnoreStmt": lambda s: f"{_optional(s)}ignore {_selector(s.selector)}",
    "PlaceStmt": lambda s: f"{_optional(s)}place {_selector(s.selector)} {_call(s.placement)}",
    "StepStmt": lambda s: "step",
    "PipelineStmt": lambda s: f"pipeline {s.schedule.value}",
    "StageStmt": lambda s: f"stage {s.index}: " + ", ".join(_selector(x) for x in s.selectors),
    "ExpectUnit": lambda s: f"expect {'not ' if s.negated else ''}unit {text(s.target)}",
    "ExpectMetric": _expect_metric,
}


def head(stmt) -> str:
    """A statement in canonical spelling, without its block."""
    try:
        return _HEADS[type(stmt).__name__](stmt)
    except KeyError:
        raise TypeError(f"no text for {type(stmt).__name__}") from None


def statement(stmt) -> str:
    """A statement on one line, its block (if any) inline."""
    b = getattr(stmt, "block", None)
    return head(stmt) if b is None else f"{head(stmt)} {block(b)}"


_RULE_NAMES: dict[str, Callable[[Any], str]] = {
    "UnitStmt": lambda s: f"unit {text(s.target)}",
    "DefaultsStmt": lambda s: "defaults",
    "RootStmt": lambda s: "root",
    "CheckpointStmt": lambda s: f"checkpoint {_selector(s.selector)}",
    "CompileStmt": lambda s: f"compile {_selector(s.selector)}",
    "ParallelStmt": lambda s: f"parallel {_selector(s.selector)} {s.style.value}",
    "StepStmt": lambda s: "step",
    "PipelineStmt": lambda s: f"pipeline {s.schedule.value}",
    "StageStmt": lambda s: f"stage {s.index}",
}


def rule_name(stmt) -> str:
    """How a statement is named in explanations: `unit layers.*`, `defaults`, `root`."""
    name = type(stmt).__name__
    return _RULE_NAMES[name](stmt) if name in _RULE_NAMES else name


# ===================================================================== any node

_TEXT: dict[str, Callable[[Any], str]] = {
    "Segment": _segment, "Path": _path, "Regex": _regex, "Guard": _guard, "Where": _where,
    "Exclusion": _exclusion, "Selector": _selector, "Group": lambda g: _bracketed(g.selectors),
    "Name": lambda n: n.value, "Number": lambda n: n.text, "String": lambda s: quote(s.value),
    "Star": lambda s: "*", "Call": _call, "SelectorList": lambda s: _bracketed(s.items),
    "Arg": _arg, "Option": _option, "Block": block,
}


def text(node) -> str:
    """The canonical text of any syntax node (a statement with its block inline)."""
    printer = _TEXT.get(type(node).__name__)
    if printer is not None:
        return printer(node)
    return statement(node)
