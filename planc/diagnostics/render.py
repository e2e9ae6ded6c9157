"""Render diagnostics as rustc-style text, JSON, or GitHub workflow annotations.

One pure function per format. Text output looks like rustc and ruff:

    error[P201]: selector `layer.*` matches nothing
     --> plans/x.plan:7:6
      |
    7 | unit layer.*
      |      ^^^^^^^ no module has this path
      |
      = help: did you mean `layers`?
"""

from __future__ import annotations

import functools
import json
from typing import Mapping, Sequence

from planc.diagnostics.core import Diagnostic, Span

_COLORS = {"error": "\x1b[1;31m", "warning": "\x1b[1;33m", "note": "\x1b[1;36m",
           "help": "\x1b[1;32m", "bold": "\x1b[1m", "blue": "\x1b[1;34m", "reset": "\x1b[0m"}


def _paint(text: str, style: str, color: bool) -> str:
    return f"{_COLORS[style]}{text}{_COLORS['reset']}" if color else text


@functools.lru_cache(maxsize=16)
def _lines(text: str) -> tuple[str, ...]:
    """A source's lines, split once per source ("\n" ends a line, as for the parser)."""
    return tuple(row.rstrip("\r") for row in text.split("\n"))


def _snippet(span: Span, label: str, sources: Mapping[str, str], color: bool,
             caret: str = "^", width: int = 0) -> list[str]:
    text = sources.get(span.file)
    if text is None:
        return []
    lines = _lines(text)
    if not 1 <= span.line <= len(lines):
        return []
    raw = lines[span.line - 1]
    # columns are counted in the raw text; carets go under the text as shown (tabs expanded)
    end_raw = span.end_column if span.end_line == span.line else len(raw) + 1
    if "\t" in raw:
        start = len(raw[:span.column - 1].expandtabs(4))
        end = len(raw[:max(end_raw - 1, span.column - 1)].expandtabs(4))
        line = raw.expandtabs(4)
    else:  # no tabs: columns are offsets (no copy of a huge line per diagnostic)
        start = min(span.column - 1, len(raw))
        end = min(max(end_raw - 1, span.column - 1), len(raw))
        line = raw
    if len(line) > 200:  # a huge line: show a window around the span
        first = max(0, start - 60)
        lead = "... " if first else ""
        shown = lead + line[first:first + 200] + (" ..." if first + 200 < len(line) else "")
        start, end = start - first + len(lead), min(end - first, 200) + len(lead)
        line = shown
    width = width or len(str(span.line))
    pad = " " * width
    marks = " " * start + caret * max(1, end - start)
    gutter = _paint(f"{pad} |", "blue", color)
    out = [gutter, _paint(f"{span.line:>{width}} |", "blue", color) + f" {line}"]
    out.append(gutter + " " + _paint(marks + (f" {label}" if label else ""),
                                     "error" if caret == "^" else "blue", color))
    return out


def render_one(d: Diagnostic, sources: Mapping[str, str], *, color: bool = False) -> str:
    """One diagnostic in rustc style."""
    head = _paint(f"{d.severity}[{d.code}]", d.severity, color) + _paint(f": {d.message}", "bold", color)
    out = [head]
    # one gutter width for every snippet of the diagnostic, as rustc aligns them
    width = max([len(str(s.line)) for s in [d.span, *(r for r, _ in d.related)] if s is not None] or [1])
    if d.span is not None:
        out.append(_paint(" --> ", "blue", color) + str(d.span))
        out.extend(_snippet(d.span, d.label, sources, color, width=width))
    for span, label in d.related:
        out.append(_paint(" ::: ", "blue", color) + str(span))
        out.extend(_snippet(span, label, sources, color, caret="-", width=width))
    tail = [("note", n) for n in d.notes] + [("help", h) for h in d.help]
    if tail:
        pad = " " * (width if d.span is not None else 1)
        if d.span is not None:
            out.append(_paint(f"{pad} |", "blue", color))
        for kind, text in tail:
            out.append(_paint(f"{pad} = ", "blue", color) + _paint(f"{kind}:", kind, color) + f" {text}")
    return "\n".join(out)


def render_text(diags: Sequence[Diagnostic], sources: Mapping[str, str], *, color: bool = False) -> str:
    """All diagnostics, each followed by a blank line, then a one-line summary."""
    parts = [render_one(d, sources, color=color) + "\n" for d in diags]
    errors = sum(d.severity == "error" for d in diags)
    warnings = sum(d.severity == "warning" for d in diags)
    if errors or warnings:
        summary = f"{errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}"
        parts.append(_paint(summary, "error" if errors else "warning", color))
    return "\n".join(parts)


JSON_VERSION = 1


def _position(s: Span | None) -> dict:
    return {"file": s.file if s else None, "line": s.line if s else None, "column": s.column if s else None,
            "end_line": s.end_line if s else None, "end_column": s.end_column if s else None}


def to_dict(d: Diagnostic) -> dict:
    """The JSON shape of one diagnostic (stable: CI tools read it; docs/ci.md documents it).

    Version 1: positions are 1-based, `end_column` exclusive, all null without a span;
    `help` and `notes` are lists of strings; each `related` entry has a full position and a label.
    """
    return {
        "code": d.code,
        "severity": d.severity,
        "message": d.message,
        **_position(d.span),
        "label": d.label,
        "help": list(d.help),
        "notes": list(d.notes),
        "related": [{**_position(r), "label": label} for r, label in d.related],
    }


def render_json(diags: Sequence[Diagnostic], **extra) -> str:
    """One JSON object: `version`, a `diagnostics` list (and whatever `extra` adds)."""
    return json.dumps({"version": JSON_VERSION, "diagnostics": [to_dict(d) for d in diags], **extra}, indent=2)


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_prop(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def render_github(diags: Sequence[Diagnostic]) -> str:
    """GitHub Actions workflow commands, one annotation per diagnostic."""
    kinds = {"error": "error", "warning": "warning", "note": "notice"}
    lines = []
    for d in diags:
        props = [f"title={_escape_prop(d.code + ' ' + d.message.split(':')[0])}"]
        if d.span:
            s = d.span
            if s.end_line == s.line:
                where = [f"line={s.line}", f"col={s.column}", f"endLine={s.end_line}", f"endColumn={s.end_column}"]
            else:  # GitHub misplaces columns of multi-line spans (ruff omits them too)
                where = [f"line={s.line}", f"endLine={s.end_line}"]
            props = [f"file={_escape_prop(s.file)}", *where] + props
        body = f"[{d.code}] {d.message}" + "".join(f"\nhelp: {h}" for h in d.help)
        lines.append(f"::{kinds[d.severity]} {','.join(props)}::{_escape_data(body)}")
    return "\n".join(lines)
