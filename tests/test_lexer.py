"""Syntax highlighting: the Pygments lexer and the TextMate grammar cover every construct."""

from __future__ import annotations

import json
import re

import pytest

pygments = pytest.importorskip("pygments")
from pygments.lexers import get_lexer_by_name, get_lexer_for_filename  # noqa: E402
from pygments.token import Comment, Error, Keyword, Name, Number, Operator, String  # noqa: E402

from planc.lang.lexer import PlanLexer  # noqa: E402

# Every construct of the language in one plan (the quick reference of the brief, and more).
EVERYTHING = '''\
model planc.zoo:seed_transformer   # a comment
include "base.plan"
mesh (replicate = 2, shard = *)
mesh HYBRID_SHARD (shard = 8)
defaults { precision param = bf16, reduce = fp32, cast_inputs = false; reshard after_forward = true }
defaults { prefetch forward = [layers.1, layers[-1]], backward = 1 ; offload cpu, pin_memory = no }
unit embedding
unit [norm, output] { reshard after_forward = false }
unit transformer_layers[-2:] { offload cpu }
optional unit **.mlp : MLP | Experts where size >= 1.5M except transformer_layers.0.mlp except re"layers\\.1\\..*"
unit blocks.{attn, mlp} { strategy SHARD_GRAD_OP; mixed_precision param_dtype = bf16 }
root { reshard after_forward = 2 }
root none
checkpoint transformer_layers.* full
compile transformer_layers.*
ignore **.freqs_cis
place **.experts.w* Shard(1)
expect units == 27 ; expect unit transformer_layers.* ; expect not unit norm
expect memory.peak <= 70GiB at world = 64
expect memory.peak <= 3GiB at input = 8x4096, world = 64
unit a \\
  .b
'''


def _plans(root):
    return sorted((root / "plans").glob("*.plan"))


def test_registered_by_entry_point():
    assert isinstance(get_lexer_by_name("plan"), PlanLexer)
    assert isinstance(get_lexer_for_filename("llama.plan"), PlanLexer)


def test_every_shipped_plan_lexes_without_error_tokens(root):
    plans = _plans(root)
    assert len(plans) >= 6
    for path in plans:
        text = path.read_text(encoding="utf-8")
        tokens = list(PlanLexer().get_tokens(text))
        assert not [v for t, v in tokens if t in Error], path.name
        # pygments adds a final newline when the text lacks one; nothing else changes
        assert "".join(v for _, v in tokens) == (text if text.endswith("\n") else text + "\n")


def test_every_construct_gets_its_token_type():
    tokens = [(t, v) for t, v in PlanLexer().get_tokens(EVERYTHING) if v.strip()]
    assert not [v for t, v in tokens if t in Error]
    kinds = {}
    for t, v in tokens:
        kinds.setdefault(v, set()).add(t)

    def is_(value, ttype):
        return any(t in ttype for t in kinds[value])
    for kw in ("model", "include", "mesh", "defaults", "unit", "root", "checkpoint", "compile", "ignore",
               "place", "expect", "optional", "except", "where", "not", "none", "at", "world", "input"):
        assert is_(kw, Keyword), kw
    assert is_("planc.zoo:seed_transformer", Name.Namespace)
    assert is_("# a comment", Comment)
    assert is_('"base.plan"', String) and is_('re"layers\\.1\\..*"', String.Regex)
    for number in ("2", "8", "27", "1.5M", "70GiB", "-1", "-2", "64", "8x4096"):
        assert is_(number, Number), number
    assert is_("MLP", Name.Class) and is_("Experts", Name.Class)
    assert is_("Shard", Name.Function)
    assert is_("precision", Name.Builtin) and is_("reshard", Name.Builtin)
    assert is_("param", Name.Attribute) and is_("after_forward", Name.Attribute)
    assert is_("bf16", Keyword.Type) and is_("false", Keyword.Constant)
    assert is_("HYBRID_SHARD", Name.Constant)
    assert is_(">=", Operator) and is_("==", Operator) and is_("<=", Operator)
    assert is_("embedding", Name.Variable) and is_("**", Name.Variable) and is_("w*", Name.Variable)


def test_module_named_like_a_keyword_in_a_path_is_a_name():
    tokens = [(t, v) for t, v in PlanLexer().get_tokens("unit model.unit.*\n") if v.strip()]
    assert [str(t) for t, _ in tokens][:4] == ["Token.Keyword", "Token.Name.Variable", "Token.Punctuation",
                                               "Token.Name.Variable"]


def test_bad_character_is_an_error_token():
    assert any(t in Error for t, _ in PlanLexer().get_tokens("unit @layers\n"))


# ===================================================================== TextMate grammar


@pytest.fixture(scope="module")
def grammar(root):
    return json.loads((root / "editors" / "plan.tmLanguage.json").read_text(encoding="utf-8"))


def _flat(grammar) -> list[tuple[str, re.Pattern, dict]]:
    """The top-level patterns, includes resolved, in order: (scope or '', regex, captures)."""
    out = []

    def add(p):
        if "include" in p:
            add(grammar["repository"][p["include"][1:]])
        elif "patterns" in p:
            for q in p["patterns"]:
                add(q)
        else:
            out.append((p.get("name", ""), re.compile(p["match"]), p.get("captures", {})))
    for p in grammar["patterns"]:
        add(p)
    return out


def _scan(grammar, line: str) -> list[tuple[str, str]]:
    """TextMate's rule: at each point the earliest match wins, ties to the first pattern."""
    patterns, pos, out = _flat(grammar), 0, []
    while pos < len(line):
        best = None
        for scope, rx, caps in patterns:
            m = rx.search(line, pos)
            if m and m.end() > m.start() and (best is None or m.start() < best[1].start()):
                best = (scope, m, caps)
        if best is None:
            out.append(("", line[pos:]))
            break
        scope, m, caps = best
        out.append(("", line[pos:m.start()]))
        if caps:
            for i in range(1, (m.re.groups or 0) + 1):
                if m.group(i) and str(i) in caps:
                    out.append((caps[str(i)]["name"], m.group(i)))
        else:
            out.append((scope, m.group(0)))
        pos = m.end()
    return [(s, t) for s, t in out if t]


def test_textmate_grammar_has_the_scopes(grammar):
    assert grammar["scopeName"] == "source.plan" and "plan" in grammar["fileTypes"]
    scopes = " ".join(s for s, _, caps in _flat(grammar)) + " " + json.dumps(grammar["repository"])
    for scope in ("keyword.control", "comment.line", "string.quoted", "string.regexp", "constant.numeric",
                  "variable.other.selector", "entity.name.type.class"):
        assert scope in scopes, scope


def test_textmate_grammar_scopes_every_character_of_the_plans(grammar, root):
    for path in _plans(root):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            unscoped = [t for s, t in _scan(grammar, line) if not s and t.strip()]
            assert not unscoped, f"{path.name}:{n}: {unscoped}"


def test_textmate_grammar_scopes_constructs(grammar):
    def scope_of(line, text):
        return [s for s, t in _scan(grammar, line) if t == text]
    assert scope_of("unit layers.* : LlamaDecoderLayer  # why", "# why") == ["comment.line.number-sign.plan"]
    assert scope_of("unit layers.* : LlamaDecoderLayer", "LlamaDecoderLayer") == ["entity.name.type.class.plan"]
    assert scope_of("unit layers.*", "unit") == ["keyword.control.statement.plan"]
    assert scope_of("unit layers.*", "layers.*") == ["variable.other.selector.plan"]
    assert scope_of("expect memory.peak <= 70GiB", "70GiB") == ["constant.numeric.quantity.plan"]
    line = "expect memory.peak <= 3GiB at world = 64, input = 8x4096"
    assert scope_of(line, "input") == scope_of(line, "world") == ["keyword.other.clause.plan"]
    assert scope_of(line, "8x4096") == ["constant.numeric.shape.plan"]
    assert scope_of("unit layers.2x3", "layers.2x3") == ["variable.other.selector.plan"]
    assert scope_of('include "base.plan"', '"base.plan"') == ["string.quoted.double.plan"]
    assert scope_of('ignore re"a\\.b"', 're"a\\.b"') == ["string.regexp.plan"]
    assert scope_of("model hf:llama-tiny", "hf:llama-tiny") == ["entity.name.namespace.model.plan"]
