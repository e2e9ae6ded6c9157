"""docs/language.md is the reference: every plan example in it parses as written.

The grammar summary block is prose for readers, not plan text; an `include` example names a
file that only exists in the reader's project, so a missing file (P003) is all it may report.
"""

from __future__ import annotations

import pathlib
import re

import pytest

import planc

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "language.md").read_text()
EXAMPLES = [b for lang, b in re.findall(r"^```([a-z]*)\n(.*?)^```", DOC, flags=re.S | re.M)
            if lang != "python" and not b.startswith("plan        :=")]  # not the training loop, the grammar summary


def test_the_reference_has_examples_and_the_grammar_summary():
    assert len(EXAMPLES) >= 12 and "plan        :=" in DOC


@pytest.mark.parametrize("text", EXAMPLES, ids=lambda b: b.splitlines()[0][:40])
def test_every_example_parses(text):
    try:
        planc.loads(text, filename="example.plan")
    except planc.PlanError as err:
        assert "include" in text and {d.code for d in err.errors} == {"P003"}, str(err)
