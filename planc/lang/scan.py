"""The one scanner of raw plan text: which characters are code, string or comment.

Error recovery and the nesting check read the text before (or without) the parser, so
they need to know where brackets and comments really are. They all ask this module, so
that they agree: a `#` inside a quoted string is not a comment, a bracket inside a string
or a comment is not a bracket. Strings follow the grammar: `"..."` (and `re"..."`) with
`\\` escapes, never spanning a line; an unterminated string runs to the end of its line.
"""

from __future__ import annotations

from typing import Iterator

OPENERS = {"{": "}", "[": "]", "(": ")"}
CLOSERS = {v: k for k, v in OPENERS.items()}


def pieces(row: str) -> Iterator[tuple[int, int, str]]:
    """(start, end, kind) over one line: kind is "code", "string" or "comment"."""
    i, n, start = 0, len(row), 0
    while i < n:
        ch = row[i]
        if ch == "#":
            if start < i:
                yield start, i, "code"
            yield i, n, "comment"
            return
        if ch == '"':
            if start < i:
                yield start, i, "code"
            j = i + 1
            while j < n and row[j] != '"':
                j += 2 if row[j] == "\\" else 1
            j = min(j + 1, n)
            yield i, j, "string"
            i = start = j
            continue
        i += 1
    if start < n:
        yield start, n, "code"


def code_end(row: str) -> int:
    """Where a line's code ends: the index after its last non-blank character outside a comment."""
    end = 0
    for _a, b, kind in pieces(row):
        if kind != "comment":
            end = b
    return len(row[:end].rstrip())


def first_word(row: str) -> tuple[int, str] | None:
    """(index, word) of the first word of a line's code, or None for a blank/comment line."""
    for a, b, kind in pieces(row):
        if kind != "code":
            return None
        text = row[a:b]
        stripped = text.lstrip()
        if not stripped:
            continue
        word = stripped.split(None, 1)[0]
        return a + len(text) - len(stripped), word
    return None


def code_chars(text: str, first_line: int = 1) -> Iterator[tuple[int, int, str]]:
    """(line, column, char) of every code character from `first_line` on (1-based)."""
    for n, row in enumerate(text.split("\n")[first_line - 1:], start=first_line):
        for a, b, kind in pieces(row):
            if kind == "code":
                for i in range(a, b):
                    yield n, i + 1, row[i]


def brackets(text: str, first_line: int = 1) -> Iterator[tuple[int, int, str, int]]:
    """(line, column, bracket, depth) of every bracket in code; depth counts the brackets
    open after an opener and before a closer (a stray closer does not go below zero)."""
    depth = 0
    for line, col, ch in code_chars(text, first_line):
        if ch in OPENERS:
            depth += 1
            yield line, col, ch, depth
        elif ch in CLOSERS:
            yield line, col, ch, depth
            depth = max(0, depth - 1)
