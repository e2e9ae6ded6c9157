"""Hostile and odd input to the language front end: special files, include bombs, huge numbers,
byte-order marks, look-alike characters, habits from other languages, 100k statements, and
the one scanner and one printer the front end is built on."""

from __future__ import annotations

import json
import os
import threading

import pytest

from planc.diagnostics.render import render_github, render_json, render_text
from planc.lang import fmt, printer, recover, scan
from planc.lang.load import MAX_INCLUSIONS, load_with_diagnostics, loads_with_diagnostics
from planc.lang.parse import parse_text


def codes(diags):
    return [d.code for d in diags]


def bounded(fn, seconds=60):
    """Run `fn` in a thread; a hang fails the test instead of stalling the suite."""
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("value", fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} did not return"
    return result["value"]


# ===================================================================== special files


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_plan_path_that_is_a_fifo_is_refused(tmp_path):
    fifo = tmp_path / "plan.plan"
    os.mkfifo(fifo)
    plan, diags = bounded(lambda: load_with_diagnostics(fifo))
    assert plan is None and codes(diags) == ["P002"]
    assert "FIFO" in diags[0].message and "regular file" in diags[0].message


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_include_of_a_fifo_is_refused(tmp_path):
    os.mkfifo(tmp_path / "base.plan")
    (tmp_path / "top.plan").write_text('include "base.plan"\nunit a\n')
    _, diags = bounded(lambda: load_with_diagnostics(tmp_path / "top.plan"))
    assert codes(diags) == ["P003"] and diags[0].span.line == 1


@pytest.mark.skipif(not os.path.exists("/dev/stdin"), reason="no /dev/stdin")
def test_include_of_dev_stdin_is_refused(tmp_path):
    (tmp_path / "top.plan").write_text('include "/dev/stdin"\n')
    _, diags = bounded(lambda: load_with_diagnostics(tmp_path / "top.plan"))
    assert codes(diags) == ["P003"] and "not a regular file" in diags[0].message


def test_include_of_a_directory_is_refused(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "top.plan").write_text('include "sub"\n')
    _, diags = load_with_diagnostics(tmp_path / "top.plan")
    assert codes(diags) == ["P003"] and "directory" in diags[0].message


def test_missing_include_suggests_a_sibling(tmp_path):
    (tmp_path / "base_llama.plan").write_text("unit a\n")
    (tmp_path / "top.plan").write_text('include "base_lama.plan"\n')
    (d,) = load_with_diagnostics(tmp_path / "top.plan")[1]
    assert d.code == "P003" and d.help[0] == 'did you mean `include "base_llama.plan"`?'


# ===================================================================== include expansion


def test_diamond_includes_30_deep_are_bounded(tmp_path):
    # each file includes the next two: fib(30) copies of the last, about 1.3 million
    for i in range(30):
        (tmp_path / f"d{i}.plan").write_text(f'include "d{i + 1}.plan"\ninclude "d{i + 2}.plan"\n')
    (tmp_path / "d30.plan").write_text("unit a\n")
    (tmp_path / "d31.plan").write_text("unit b\n")
    _, diags = bounded(lambda: load_with_diagnostics(tmp_path / "d0.plan"))
    assert codes(diags) == ["P006"] and str(MAX_INCLUSIONS) in diags[0].message


def test_a_small_diamond_splices_each_include_as_written(tmp_path):
    (tmp_path / "base.plan").write_text("unit base\n")
    (tmp_path / "a.plan").write_text('include "base.plan"\nunit a\n')
    (tmp_path / "b.plan").write_text('include "base.plan"\nunit b\n')
    (tmp_path / "top.plan").write_text('include "a.plan"\ninclude "b.plan"\n')
    plan, diags = load_with_diagnostics(tmp_path / "top.plan")
    assert diags == []
    assert [str(s.target) for s in plan.statements] == ["base", "a", "base", "b"]


# ===================================================================== numbers


@pytest.mark.parametrize("text,what", [
    ("mesh (shard = " + "9" * 5000 + ")", "mesh size"),
    ("expect memory.peak <= 1GiB at world = " + "9" * 5000, "world size"),
    ("expect memory.peak <= 1GiB at world = 1000000000000", "world size"),
    ("expect units == " + "9" * 5000, "integer"),
    ("unit a[" + "1" * 30 + "]", "index"),
    ("unit a[-" + "1" * 30 + ":]", "index"),
    ("expect memory.peak <= 1GiB at input = 2x" + "9" * 5000, "input size"),
    ("unit a { reshard " + "9" * 5000 + " }", "integer"),
    ("unit a where size >= " + "9" * 400 + "M", "number"),
    ("unit a where size >= " + "9" * 400 + ".5", "number"),
])
def test_huge_integers_are_located_p103(text, what):
    _, diags = bounded(lambda: loads_with_diagnostics(text))
    assert codes(diags) == ["P103"] and what in diags[0].message, diags
    assert diags[0].span.line == 1 and diags[0].span.column > 1


def test_integers_within_bounds_parse():
    plan, diags = loads_with_diagnostics("mesh (shard = 1048576)\nexpect units == 9223372036854775807\n")
    assert diags == [] and plan.statements[0].axes[0].size == 1 << 20


# ===================================================================== unicode


def test_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.plan"
    path.write_bytes(b"\xef\xbb\xbfunit a\n")
    plan, diags = load_with_diagnostics(path)
    assert diags == [] and plan.statements[0].span.column == 1
    assert loads_with_diagnostics("\ufeffunit a\n")[1] == []
    assert fmt.format_plan("\ufeffunit   a\n") == "unit a\n"


@pytest.mark.parametrize("char,name,meant", [
    ("\u0440", "U+0440 CYRILLIC SMALL LETTER ER", "`p`"),
    ("\u2212", "U+2212 MINUS SIGN", "`-`"),
    ("\u00a0", "U+00A0 NO-BREAK SPACE", "a space"),
])
def test_lookalikes_are_named_in_every_format(char, name, meant):
    text = {"\u0440": "unit a { \u0440recision bf16 }", "\u2212": "expect units == \u22121",
            "\u00a0": "unit\u00a0a"}[char]
    _, diags = loads_with_diagnostics(text)
    (d,) = diags
    assert d.message == f"unexpected character {name}" and meant in d.label
    assert name in render_text(diags, {"<string>": text})
    assert json.loads(render_json(diags))["diagnostics"][0]["message"] == d.message
    assert name in render_github(diags)


# ===================================================================== habits from other languages


@pytest.mark.parametrize("text,fix", [
    ("defaults { precision param = torch.bfloat16 }", "write `bf16` for `torch.bfloat16`"),
    ("defaults { precision param = torch.float32 }", "write `fp32`"),
    ("place **.w Shard(dim=1)", "write `Shard(1)`"),
    ("unit layers.-1", "`layers[-1]`"),
    ("defaults { reshard: false }", "is YAML"),
    ('mesh (shard = "8")', "without quotes: `8`"),
    ("// a comment", "comments start with `#`"),
    ("unit optional layers.*", "`optional unit layers.*`"),
    ("checkpoint optional layers.*", "`optional checkpoint layers.*`"),
    ("expect memory.peak <= 3G", "`3GiB`"),
    ("expect memory.peak <= 1e8", "`100M`"),
    ("auto_wrap_policy transformer", "unit rules"),
    ("backward_prefetch BACKWARD_PRE", "`defaults { prefetch backward = 1 }`"),
    ("precision bf16", "is a block option"),
    ("unt layers.*", "did you mean `unit`?"),
    ("mesh (shard = True)", "lower case: `true`"),
])
def test_habits_get_the_plan_spelling(text, fix):
    (d,) = loads_with_diagnostics(text)[1]
    assert d.code == "P001" and fix in d.help[0], d.help


def test_statement_position_lists_every_statement_keyword_likeliest_first():
    (d,) = loads_with_diagnostics("chekpoint a")[1]
    listed = d.help[-1]
    assert listed.startswith("expected a statement: `checkpoint`, `unit`")
    for word in ("unit", "defaults", "root", "mesh", "model", "include", "ignore", "place", "expect", "optional"):
        assert f"`{word}`" in listed
    assert "..." not in listed


def test_expected_list_ranks_a_block_first_and_says_how_many_are_left_out():
    (d,) = loads_with_diagnostics("unit a @")[1]
    assert d.help[0].startswith("expected `{`, end of line") and "more" in d.help[0]


# ===================================================================== empty plans


@pytest.mark.parametrize("text,label", [("", "empty plan"), ("# just a comment\n\n", "only comments"),
                                        ("\n;\n", "empty plan")])
def test_empty_plan_warns(text, label):
    plan, diags = loads_with_diagnostics(text)
    assert plan is not None and codes(diags) == ["P209"] and diags[0].label == label
    assert json.loads(render_json(diags))["diagnostics"][0]["code"] == "P209"


# ===================================================================== size


def test_100k_statements_parse_and_render():
    text = "unit ln_f\n" * 100_000  # 1 MB: the most one file may hold
    plan, diags = bounded(lambda: loads_with_diagnostics(text), 300)
    assert diags == [] and len(plan.statements) == 100_000
    one_line = ";".join(["unit ln_f"] * 100_000)
    plan, diags = bounded(lambda: loads_with_diagnostics(one_line), 300)
    assert diags == [] and plan.statements[-1].span.column == 10 * 99_999 + 1


def test_many_diagnostics_on_one_huge_line_render():
    text = ";".join(["unit ln_f"] * 20_000)
    plan, _ = loads_with_diagnostics(text)
    from planc.diagnostics import Diagnostic
    diags = [Diagnostic(code="P207", severity="warning", message="m", span=s.span, label="l")
             for s in plan.statements]
    out = bounded(lambda: render_text(diags, dict(plan.sources)), 120)
    assert out.count("warning[P207]") == 20_000 and "..." in out


# ===================================================================== the one scanner


def test_scanner_treats_strings_and_comments_alike_everywhere():
    row = 'model "a#b{"  # { [ ('
    assert [k for _, _, k in scan.pieces(row)] == ["code", "string", "code", "comment"]
    assert scan.code_end(row) == len('model "a#b{"')
    assert list(scan.brackets(row)) == []
    assert scan.first_word('  unit x # y') == (2, "unit")
    assert scan.first_word('# unit') is None


def test_recovery_helpers_agree_about_hash_in_strings():
    text = 'defaults {\n  offload "#" # {\nunit a\n'
    # the block opened on line 1 is still open: a `#` in a string starts no comment
    assert recover.open_brackets(text, 3) == [("{", 1, 10)]
    assert recover.closing_line('place a f("#", [\n1])\n', ("(", 1, 10)) == 2
    closed = recover.close_block_before(text, 3)
    assert closed.split("\n")[1] == '  offload "#" } # {'
    assert recover.statement_start(text, 1, 3) == (3, 1, "unit")
    assert recover.deepest_nesting('a "(((" [ ( # (((\n') == (2, 1)


def test_unclosed_block_with_hash_in_a_string_is_one_error():
    diags = loads_with_diagnostics('defaults {\n  offload "#"\nunit a\n')[1]
    assert codes(diags) == ["P001"] and diags[0].message.startswith("unclosed `{`")


# ===================================================================== the one printer


PRINTED = [
    "model planc.zoo:gpt", 'model "hf:my config.json"', 'include "base \\"x\\".plan"',
    "mesh HYBRID_SHARD (replicate = *, shard = 8)", "defaults { precision param = bf16, reduce = fp32 }",
    "optional unit **.mlp : MLP | Experts where size >= 1.5M except layers.0 : MLP except re\"a\\\"b\"",
    "unit [norm, output] { reshard after_forward = false; prefetch forward = [layers.1, layers[-1]] }",
    "unit layers[-2:] {}", "unit blocks.{attn,mlp}", "root none", "root { reshard 2 }",
    "checkpoint layers.* full", "optional compile layers[1:3]", "ignore **.freqs", "place **.w Shard(1)",
    "expect not unit norm", "expect memory.peak <= 70GiB at world = 64, input = 8x4096",
]


@pytest.mark.parametrize("line", PRINTED)
def test_printer_round_trips(line):
    (stmt,), _, diags = parse_text(line, "<p>")
    assert diags == []
    assert printer.statement(stmt) == line
    (again,), _, _ = parse_text(printer.statement(stmt), "<p>")
    assert fmt.strip_spans(again) == fmt.strip_spans(stmt)


def test_rule_names_and_node_str_come_from_the_printer():
    from planc.resolve.resolver import rule_text
    (u, c, d), _, _ = parse_text("optional unit a.* { reshard false }\ncheckpoint b full\ndefaults {}\n", "<p>")
    assert [rule_text(s) for s in (u, c, d)] == ["unit a.*", "checkpoint b", "defaults"]
    assert str(u.target) == printer.text(u.target) == "a.*"
    assert str(u.block.options[0]) == "reshard false"
