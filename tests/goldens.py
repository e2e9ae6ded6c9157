"""Golden files for the UI, resolver, fmt, emit and explain tests: compare, or rewrite.

`PLANC_UPDATE_GOLDENS=1 pytest ...` rewrites every golden a test compares against (review
the diff before committing); otherwise a missing or different golden fails the test.
"""

from __future__ import annotations

import os
import pathlib

UPDATE = bool(os.environ.get("PLANC_UPDATE_GOLDENS"))


def check_golden(path: pathlib.Path, actual: str) -> None:
    """Assert `actual` equals the golden at `path` (or write it when updating)."""
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual, encoding="utf-8")
    assert path.exists(), f"no golden {path.name}: run with PLANC_UPDATE_GOLDENS=1 and review it"
    assert actual == path.read_text(encoding="utf-8")
