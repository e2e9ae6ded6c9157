"""planc spans <-> LSP positions (planc/lsp/positions.py): code points vs UTF-16/UTF-8 units."""

from __future__ import annotations

from planc.diagnostics import Span
from planc.lsp.positions import UTF8, UTF16, UTF32, from_lsp, span_to_range, to_lsp

LINES = ['unit [wte, lm_head] { offload "\U0001F600é"; precison param = bf16 }', "", "x"]
COL = LINES[0].index("precison") + 1  # planc column (code points, from 1)


def test_columns_after_astral_and_accented_characters():
    # the emoji is 2 UTF-16 units and 4 UTF-8 bytes; é is 1 unit and 2 bytes
    assert to_lsp(LINES, 1, COL, UTF16) == (0, COL - 1 + 1)
    assert to_lsp(LINES, 1, COL, UTF8) == (0, COL - 1 + 3 + 1)
    assert to_lsp(LINES, 1, COL, UTF32) == (0, COL - 1)
    for enc in (UTF16, UTF8, UTF32):
        assert from_lsp(LINES, *to_lsp(LINES, 1, COL, enc), enc) == (1, COL)


def test_ranges_clamp_and_never_invert():
    span = Span("f", 1, COL, 1, COL + len("precison"))
    assert span_to_range(LINES, span) == ((0, COL), (0, COL + len("precison")))
    assert span_to_range(LINES, Span("f", 9, 50, 2, 1)) == ((2, 1), (2, 1))  # past the end: clamped
    assert from_lsp(LINES, 0, 10**6) == (1, len(LINES[0]) + 1) and from_lsp(LINES, 99, 0) == (3, 1)
    emoji = LINES[0].index("\U0001F600")
    assert from_lsp(LINES, 0, emoji + 1) == (1, emoji + 2)  # inside the surrogate pair: the next character
    assert to_lsp([], 3, 3) == (0, 0) and from_lsp([], 3, 3) == (1, 1)
