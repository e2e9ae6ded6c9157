"""One source for each vocabulary: options, dtypes, booleans, FSDP1 words and keywords are
named once (`planc/lang/vocabulary.py`), checked against the option table and the grammar,
and the lexer and the editor grammar are built from them."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

from pygments.token import Keyword

from planc.lang import lexer
from planc.lang import vocabulary as vocab
from planc.lang.parse import parser
from planc.resolve import options

ROOT = pathlib.Path(__file__).resolve().parent.parent
TMLANGUAGE = ROOT / "editors" / vocab.TMLANGUAGE


def test_vocabulary_matches_the_option_table():
    assert set(vocab.OPTIONS) == set(options.OPTIONS)
    assert set(vocab.DTYPES) == set(options.DTYPES) - {"none"}
    assert set(vocab.BOOLS) == set(options.BOOLS)
    assert set(vocab.FSDP1_WORDS) == set(options.FSDP1_RESHARD) | set(options.FSDP1_MESH)


def test_vocabulary_matches_the_grammar_keywords():
    literals = {t.pattern.value for t in parser().terminals if t.pattern.type == "str"}
    keywords = {w for w in literals if re.fullmatch(r"[a-z_]+", w)}
    statements = {str(r.origin.name) for r in parser().rules}
    assert set(vocab.STATEMENTS) <= keywords
    assert keywords <= set(vocab.STATEMENTS) | set(vocab.CLAUSES)
    assert set(vocab.STATEMENT_ORDER) == set(vocab.STATEMENTS) | {"optional"}
    # every statement keyword names a statement rule of the grammar
    assert {f"{w}_stmt" for w in vocab.STATEMENTS if w != "expect"} <= statements


def test_style_words_are_the_resolvers():
    from planc.resolve.context import CONTEXT_STYLE
    from planc.resolve.experts import EXPERT_STYLE
    from planc.resolve.tensor import STYLE_KINDS

    assert vocab.STYLES == (*STYLE_KINDS, CONTEXT_STYLE, EXPERT_STYLE)
    tokens = [(t, v) for t, v in lexer.PlanLexer().get_tokens("parallel layers.*.attention context\nunit context.x\n")]
    assert (Keyword.Pseudo, "context") in tokens and tokens.count((Keyword.Pseudo, "context")) == 1


def test_lexer_word_lists_come_from_the_vocabulary():
    assert lexer.STATEMENTS == vocab.STATEMENTS and lexer.DTYPES == vocab.DTYPES
    assert lexer.CONSTANTS == vocab.BOOLS and lexer.FSDP1_WORDS == vocab.FSDP1_WORDS
    assert set(lexer.OPTIONS) | set(vocab.STATEMENTS) >= set(options.OPTIONS)


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.module if isinstance(n, ast.ImportFrom) else a.name
            for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
            for a in (n.names if isinstance(n, ast.Import) else [n])}


def test_vocabulary_and_lexer_need_no_torch():
    # the word lists are plain data, and the lexer needs only them and pygments
    assert _imports(ROOT / "planc" / "lang" / "vocabulary.py") <= {"__future__", "json", "sys", "pathlib"}
    lexer_imports = _imports(ROOT / "planc" / "lang" / "lexer.py")
    assert {m for m in lexer_imports if m.startswith("planc")} == {"planc.lang.vocabulary"}


def test_tmlanguage_is_generated_from_the_vocabulary():
    text = TMLANGUAGE.read_text(encoding="utf-8")
    assert vocab.tmlanguage_text(text) == text, \
        "stale: run `python -m planc.lang.vocabulary --tmlanguage`"


def test_tmlanguage_generator_command(tmp_path):
    grammar = tmp_path / "g.json"
    grammar.write_text(TMLANGUAGE.read_text(encoding="utf-8").replace("|half)", ")"), encoding="utf-8")
    run = [sys.executable, "-m", "planc.lang.vocabulary", "--tmlanguage"]
    assert subprocess.run(run + ["--check", str(grammar)], capture_output=True).returncode == 1
    subprocess.run(run + [str(grammar)], check=True)
    assert grammar.read_text(encoding="utf-8") == TMLANGUAGE.read_text(encoding="utf-8")
    assert subprocess.run(run + ["--check", str(grammar)], capture_output=True).returncode == 0
