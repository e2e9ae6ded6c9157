"""`planc lsp`: serve the language server over stdio (planc/lsp/; needs the `lsp` extra)."""

from __future__ import annotations


def main(args) -> int:
    from planc.lsp import main as serve  # pygls is imported only when the server starts
    return serve(args)
