"""Recover from a syntax error: improve its diagnostic and say what text to parse next.

After an error the broken line is blanked (or a missing `}` inserted) and parsing resumes,
so one run reports every broken line, not only the first. Every look at the raw text goes
through `planc.lang.scan`, so brackets and `#` inside strings never count.
"""

from __future__ import annotations

import dataclasses

from planc.diagnostics import Diagnostic, Span
from planc.lang import scan
from planc.lang.vocabulary import STATEMENTS

# Words that start a statement and can never name a block option (`checkpoint` and `compile`
# are both, so they do not count).
_STATEMENT_WORDS = (set(STATEMENTS) - {"checkpoint", "compile"}) | {"optional"}


def open_brackets(text: str, line: int, column: int | None = None) -> list[tuple[str, int, int]]:
    """Brackets still open just before (`line`, `column`): (bracket, line, column), innermost last.

    A stray closer is ignored (the parser reports it).
    """
    stack: list[tuple[str, int, int]] = []
    for n, col, ch in scan.code_chars(text):
        if n > line or (n == line and column is not None and col >= column):
            break
        if ch in scan.OPENERS:
            stack.append((ch, n, col))
        elif stack and ch == scan.OPENERS[stack[-1][0]]:
            stack.pop()
    return stack


def closing_line(text: str, opener: tuple[str, int, int]) -> int | None:
    """The line where the bracket opened at `opener` closes, or None if it never does."""
    bracket, line, column = opener
    depth = 0
    for n, col, ch in scan.code_chars(text, line):
        if n == line and col < column:
            continue
        if ch == bracket:
            depth += 1
        elif ch == scan.OPENERS[bracket]:
            depth -= 1
            if depth == 0:
                return n
    return None


def blank_lines(text: str, first: int, last: int) -> str:
    """Replace lines `first`..`last` with spaces, keeping every offset of the other lines."""
    lines = text.split("\n")
    for n in range(max(first, 1), min(last, len(lines)) + 1):
        lines[n - 1] = " " * len(lines[n - 1])
    return "\n".join(lines)


def close_block_before(text: str, line: int) -> str:
    """Insert `}` at the end of the last code line before `line` (offsets after it unchanged)."""
    lines = text.split("\n")
    for n in range(line - 1, 0, -1):
        end = scan.code_end(lines[n - 1])
        if end:
            lines[n - 1] = lines[n - 1][:end] + " }" + lines[n - 1][end:]
            return "\n".join(lines)
    return text


def statement_start(text: str, after: int, upto: int) -> tuple[int, int, str] | None:
    """The first line in (after, upto] that starts with a statement-only keyword."""
    lines = text.split("\n")
    for n in range(after + 1, min(upto, len(lines)) + 1):
        first = scan.first_word(lines[n - 1])
        if first and first[1] in _STATEMENT_WORDS:
            return n, first[0] + 1, first[1]
    return None


def deepest_nesting(text: str) -> tuple[int, int]:
    """(depth, line) of the deepest bracket nesting in the text's code."""
    best, best_line = 0, 1
    for line, _, ch, depth in scan.brackets(text):
        if ch in scan.OPENERS and depth > best:
            best, best_line = depth, line
    return best, best_line


def recover(err, d: Diagnostic, file: str, work: str) -> tuple[Diagnostic, str | None]:
    """Improve the diagnostic for unclosed brackets and say how to go on parsing.

    Returns the diagnostic and the text to parse next (None: give up). The common causes of
    a cascade get one diagnostic each: a statement continued on the next line (statements
    are one line; only `{}` blocks span lines), and a `{` block that is never closed.
    """
    tok = getattr(err, "token", None)
    line = d.span.line
    is_eol = tok is not None and tok.type == "_NL"
    opened = open_brackets(work, line, None if is_eol or tok is None or tok.type == "$END" else d.span.column)
    blocks = [o for o in opened if o[0] == "{"]
    # `[`/`(` never legally span a line end (except after `\`), wherever they were opened
    inner = [o for o in opened if o[0] != "{"]
    if is_eol and inner:
        bracket, bline, bcol = inner[-1]
        closer = scan.OPENERS[bracket]
        end = closing_line(work, inner[-1])
        d = dataclasses.replace(
            d, message=f"unexpected end of line: `{bracket}` is not closed on this line",
            label=f"expected `{closer}` before the end of the line",
            related=((Span(file, bline, bcol, bline, bcol + 1), "opened here"),),
            help=("statements end at the end of a line (only `{}` blocks span lines): write it on "
                  "one line, or end the line with `\\` to continue it",))
        return d, blank_lines(work, min(bline, line), end if end is not None else line)
    stmt = statement_start(work, blocks[-1][1], line) if blocks and tok is not None else None
    if blocks and tok is not None and (stmt is not None or tok.type == "$END"):
        # NOTE: a statement keyword inside a block cannot be an option, so the first line
        # that starts with one is where the block should have ended, even when the parser
        # only fails later (`unit a` reads as an option `unit` with argument `a`).
        _, bline, bcol = blocks[-1]
        if stmt is not None:
            sline, scol, word = stmt
            span, where, label = Span(file, sline, scol, sline, scol + len(word)), f"`{word}`", \
                "a new statement starts here"
        else:
            span, where, label = d.span, "the end of the file", "the block would end here"
        d = dataclasses.replace(
            d, span=span, message=f"unclosed `{{`: the block on line {bline} has no `}}` before {where}",
            label=label, related=((Span(file, bline, bcol, bline, bcol + 1), "this `{` is never closed"),),
            help=(f"add `}}` to close the block that starts on line {bline}",))
        if stmt is None:
            return d, None
        return d, close_block_before(work, stmt[0])
    if d.message == "unexpected end of file":
        return d, None
    return d, blank_lines(work, line, line)
