"""Positions: planc's 1-based line/column spans <-> LSP's 0-based positions in UTF-16 units.

planc columns count Python characters (code points) from 1, with an exclusive end column;
LSP counts lines from 0 and characters in the code units of the negotiated encoding
(UTF-16 unless the client asks for another), so a character outside the BMP (an emoji) is
one planc column but two LSP characters. Lines are split on `\\n` only, as the parser does.
"""

from __future__ import annotations

from planc.diagnostics import Span

UTF16, UTF8, UTF32 = "utf-16", "utf-8", "utf-32"


def _units(ch: str, encoding: str) -> int:
    if encoding == UTF32:
        return 1
    if encoding == UTF8:
        return len(ch.encode("utf-8", "surrogatepass"))
    return 2 if ord(ch) > 0xFFFF else 1


def lines_of(text: str) -> list[str]:
    return text.split("\n")


def to_lsp(lines: list[str], line: int, column: int, encoding: str = UTF16) -> tuple[int, int]:
    """planc (line, column), both from 1, -> LSP (line, character), both from 0; clamped to the text."""
    if not lines:
        return 0, 0
    row = min(max(line, 1), len(lines)) - 1
    text = lines[row]
    col = min(max(column, 1) - 1, len(text))
    return row, sum(_units(c, encoding) for c in text[:col])


def from_lsp(lines: list[str], line: int, character: int, encoding: str = UTF16) -> tuple[int, int]:
    """LSP (line, character) -> planc (line, column); a character inside a surrogate pair
    or past the end of the line lands on the next whole character or the line end."""
    if not lines:
        return 1, 1
    row = min(max(line, 0), len(lines) - 1)
    text = lines[row]
    used, col = 0, 0
    while col < len(text) and used < character:
        used += _units(text[col], encoding)
        col += 1
    return row + 1, col + 1


def span_to_range(lines: list[str], span: Span, encoding: str = UTF16) -> tuple[tuple[int, int], tuple[int, int]]:
    """A planc span as LSP ((start line, char), (end line, char)); never an inverted range."""
    start = to_lsp(lines, span.line, span.column, encoding)
    end = to_lsp(lines, span.end_line, span.end_column, encoding)
    return start, max(start, end)


def contains(span: Span, line: int, column: int) -> bool:
    """True if planc position (line, column) lies in `span` (the end column counts as inside,
    so a cursor just after a word still hovers it)."""
    return (span.line, span.column) <= (line, column) <= (span.end_line, span.end_column)
