"""Format .plan files canonically, keeping every comment and never changing the meaning.

Only layout and comments live here; every node's spelling is `planc.lang.printer`'s.
The layout: one statement per line, in the original order (order is meaning: later rules
override earlier ones); one blank line between groups of statements of different kinds
(model/include, mesh, defaults, unit/root, checkpoint/compile, ignore/place, expect) and
wherever the user left blank lines (runs collapsed to one); canonical spacing; a block with
one option on one line (`unit [norm, output] { reshard after_forward = false }`), a block
with more options (or with comments inside) on several lines with a two-space indent.
FSDP1 spellings stay as written.

Comments are attached to what they annotate: a comment alone on its line to the statement
(or block option) after it; a comment after code to the statement or option ending on that
line; a comment after a block's `{` to the block's first line. The formatted text is parsed
again and compared with the input's syntax tree (spans aside) before anything is written,
so a formatter bug can never silently change a plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

from planc.diagnostics import Span
from planc.lang import printer
from planc.lang import syntax as st
from planc.lang.parse import parse_text

INDENT = "  "
TRAILING = "  "  # two spaces before a comment that follows code, as PEP 8 does

# Statements of one kind stay together; a change of kind gets a blank line.
_KIND = {
    st.ModelStmt: "model", st.IncludeStmt: "model", st.MeshStmt: "mesh", st.DefaultsStmt: "defaults",
    st.UnitStmt: "unit", st.RootStmt: "unit", st.CheckpointStmt: "transform", st.CompileStmt: "transform",
    st.ParallelStmt: "parallel", st.StepStmt: "step", st.PipelineStmt: "pipeline", st.StageStmt: "pipeline",
    st.IgnoreStmt: "param", st.PlaceStmt: "param", st.ExpectUnit: "expect", st.ExpectMetric: "expect",
}

class FormatError(Exception):
    """The formatted text would not mean what the input meant (a bug in the formatter)."""


# ===================================================================== syntax tree equality


def strip_spans(node: Any) -> Any:
    """The syntax tree as nested tuples with every span left out, for comparing meaning."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return (type(node).__name__,) + tuple(
            (f.name, strip_spans(getattr(node, f.name))) for f in dataclasses.fields(node)
            if not f.name.endswith("span"))
    if isinstance(node, (tuple, list)):
        return tuple(strip_spans(n) for n in node)
    return node


# ===================================================================== printing nodes

statement_head = printer.head  # a statement in canonical spelling, without its block


def _block_of(s: st.Statement) -> st.Block | None:
    return getattr(s, "block", None)


# ===================================================================== comments -> nodes


def _pos(span: Span, end: bool = False) -> tuple[int, int]:
    return (span.end_line, span.end_column) if end else (span.line, span.column)


@dataclass
class _Entry:
    """A statement or block option with the comments attached to it, or a lone comment."""

    first: int  # source lines it covers, for finding the user's blank lines
    last: int
    node: Any = None  # a statement, an option, or None for a comment line
    comment: str = ""  # the comment text, for a comment line
    trailing: str = ""  # a comment after the node on its last line
    header: str = ""  # a comment after a block's `{`
    inner: list["_Entry"] = field(default_factory=list)  # the block's options and comment lines


def _entries(nodes: Sequence[Any], comments: list[st.Comment], lines: list[str]) -> list[_Entry]:
    """Interleave nodes (statements or options) with the comments among them, in order."""
    by_node: dict[int, _Entry] = {}
    for n in nodes:
        by_node[id(n)] = _Entry(n.span.line, n.span.end_line, node=n)
    # comments inside a node's span belong to its block; the rest stand alone or trail
    pending = list(comments)
    items: list[tuple[tuple[int, int], _Entry]] = [(_pos(n.span), by_node[id(n)]) for n in nodes]
    for n in nodes:
        entry = by_node[id(n)]
        inside = [c for c in pending if _pos(n.span) < _pos(c.span) < _pos(n.span, end=True)]
        if inside:
            pending = [c for c in pending if c not in inside]
            block = _block_of(n)
            # only blocks span lines; were that to change, the meaning check would refuse
            if block is None:
                entry.trailing = " ".join(_text(c) for c in inside)
                continue
            head = [c for c in inside if c.span.line == block.span.line
                    and not any(o.span.end_line == c.span.line for o in block.options)]
            if head:
                entry.header = _text(head[0])
            rest = [c for c in inside if c not in head]
            entry.inner = _entries(block.options, rest, lines)
    for c in pending:
        # after code on its line: trails the last node ending on that line
        enders = [n for n in nodes if n.span.end_line == c.span.line and _pos(n.span, end=True) <= _pos(c.span)]
        if enders and lines[c.span.line - 1][: c.span.column - 1].strip(" \t\f;"):
            e = by_node[id(enders[-1])]
            e.trailing = (e.trailing + " " if e.trailing else "") + _text(c)
            continue
        items.append((_pos(c.span), _Entry(c.span.line, c.span.line, comment=_text(c))))
    items.sort(key=lambda kv: kv[0])
    return [e for _, e in items]


def _text(c: st.Comment) -> str:
    return c.text.rstrip()


def _blank_between(lines: list[str], after: int, before: int) -> bool:
    """Whether the user left an empty line between source lines `after` and `before`."""
    return any(not lines[i - 1].strip(" \t\f\r;") for i in range(after + 1, before))


# ===================================================================== layout


def _with_trailing(text: str, comment: str) -> str:
    return text + TRAILING + comment if comment else text


def _block_lines(entry: _Entry, head: str, block: st.Block, lines: list[str], indent: str) -> list[str]:
    multi = len(block.options) > 1 or entry.header or any(e.comment or e.trailing for e in entry.inner)
    if not multi:
        body = printer.block(block)
        return [indent + _with_trailing(f"{head} {body}", entry.trailing)]
    out = [indent + _with_trailing(f"{head} {{", entry.header)]
    inner = entry.inner or [_Entry(o.span.line, o.span.end_line, node=o) for o in block.options]
    prev = None
    for e in inner:
        if prev is not None and _blank_between(lines, prev.last, e.first):
            out.append("")
        text = e.comment if e.node is None else _with_trailing(printer.text(e.node), e.trailing)
        out.append(indent + INDENT + text)
        prev = e
    out.append(indent + _with_trailing("}", entry.trailing))
    return out


def _statement_lines(entry: _Entry, lines: list[str]) -> list[str]:
    s = entry.node
    block = _block_of(s)
    head = statement_head(s)
    if block is None:
        return [_with_trailing(head, entry.trailing)]
    return _block_lines(entry, head, block, lines, "")


def format_plan(text: str, filename: str = "<string>") -> str:
    """Format plan text canonically.

    Args:
        text: the plan source.
        filename: the name used in diagnostics.

    Returns:
        The formatted text (ending in one newline, or empty for an empty plan).

    Raises:
        PlanError: the text has syntax errors (it is not formatted).
        FormatError: formatting would change the plan's meaning (a bug in the formatter).
    """
    from planc.diagnostics import PlanError

    statements, comments, diags = parse_text(text, filename)
    if any(d.is_error for d in diags):
        raise PlanError(diags, {filename: text})
    lines = text.split("\n")
    entries = _entries(list(statements), list(comments), lines)
    blank = [i > 0 and _blank_between(lines, entries[i - 1].last, e.first) for i, e in enumerate(entries)]
    prev_kind = None
    for i, e in enumerate(entries):
        if e.node is None:
            continue
        kind = _KIND[type(e.node)]
        if prev_kind is not None and kind != prev_kind:
            j = i  # the break goes before the comments that lead into this statement
            while entries[j - 1].node is None:
                j -= 1
            blank[j] = True
        prev_kind = kind
    out: list[str] = []
    for i, e in enumerate(entries):
        if blank[i]:
            out.append("")
        out.extend([e.comment] if e.node is None else _statement_lines(e, lines))
    result = "\n".join(out)
    result = result + "\n" if result else ""
    _check_same_meaning(statements, comments, result, filename)
    return result


def _check_same_meaning(statements, comments, result: str, filename: str) -> None:
    again, again_comments, diags = parse_text(result, filename)
    if any(d.is_error for d in diags):
        raise FormatError(f"formatted `{filename}` does not parse: {diags[0].message}")
    if strip_spans(again) != strip_spans(statements):
        raise FormatError(f"formatting `{filename}` would change its meaning")
    if [_text(c) for c in again_comments] != [_text(c) for c in comments]:
        raise FormatError(f"formatting `{filename}` would lose or reorder comments")
