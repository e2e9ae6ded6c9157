"""`planc lsp`: a language server for .plan files over stdio (needs the `lsp` extra).

The server (`planc/lsp/server.py`) is the only module that imports pygls and lsprotocol;
the rest of this package (analysis, hover, completion, positions) works on planc's own
types, so it is importable without the extra.
"""

from __future__ import annotations

import sys

INSTALL_HINT = 'planc: error: `planc lsp` needs the lsp extra (pygls 2): pip install "planc[lsp]"'


def main(args=None) -> int:
    """Entry point of `planc lsp`; exit 2 with one line when pygls/lsprotocol are missing."""
    try:
        import lsprotocol.types  # noqa: F401
        from pygls.lsp.server import LanguageServer  # noqa: F401  (pygls 2.x layout)
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    from planc.lsp.server import serve
    return serve()
