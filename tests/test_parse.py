"""The parser: syntax tree shapes and spans, quantities, includes, and syntax-error recovery."""

from __future__ import annotations

import pytest

from planc.diagnostics import PlanError
from planc.lang import syntax as st
from planc.lang.parse import loads, loads_with_diagnostics, parse_quantity


def one(text: str):
    plan = loads(text)
    assert len(plan.statements) == 1
    return plan.statements[0]


def errors(text: str) -> list:
    plan, diags = loads_with_diagnostics(text)
    return diags


# ===================================================================== statements


def test_unit_with_block_and_spans():
    s = one("unit layers[-2:] { reshard after_forward = false }")
    assert isinstance(s, st.UnitStmt) and not s.optional
    seg = s.target.base.segments[0]
    assert (seg.pattern, seg.is_slice, seg.start, seg.stop) == ("layers", True, -2, None)
    assert (s.span.line, s.span.column, s.span.end_column) == (1, 1, 51)
    (opt,) = s.block.options
    assert opt.name == "reshard" and opt.args[0].key == "after_forward" and opt.args[0].value.value == "false"
    assert (opt.name_span.column, opt.name_span.end_column) == (20, 27)


def test_selector_forms_round_trip():
    for text in ["**.mlp", "layers.*", "layers[0]", "layers[1:3]", "blocks.{attn,mlp}", "layers.*.w*",
                 "** : A | B", 're"layers\\.\\d+"', "** where size >= 100M", "layers.* except layers.0 : X"]:
        assert str(one(f"unit {text}").target) == text


def test_group_and_optional():
    s = one("optional unit [norm, output]")
    assert s.optional and isinstance(s.target, st.Group)
    assert [str(x) for x in s.target.selectors] == ["norm", "output"]


def test_keywords_are_names_inside_selectors():
    s = one("unit model.unit.root.mesh.where.none")
    assert [seg.pattern for seg in s.target.base.segments] == ["model", "unit", "root", "mesh", "where", "none"]


def test_mesh_forms():
    m = one("mesh (replicate = 2, shard = *)")
    assert [(d.name, d.size) for d in m.axes] == [("replicate", 2), ("shard", None)] and m.strategy is None
    m = one("mesh HYBRID_SHARD (shard = 8)")
    assert m.strategy == "HYBRID_SHARD" and m.axes[0].size == 8
    assert one("mesh NO_SHARD").strategy == "NO_SHARD"


def test_expect_forms():
    e = one("expect memory.peak <= 70GiB at world = 64")
    assert (e.metric, e.op, e.value.value, e.value.is_bytes, e.world) == ("memory.peak", "<=", 70 * 2**30, True, 64)
    e = one("expect not unit norm")
    assert isinstance(e, st.ExpectUnit) and e.negated


@pytest.mark.parametrize("clause,world,shape,where", [
    ("at world = 64, input = 8x4096", 64, (8, 4096), (52, 58)),
    ("at input = 8x4096, world = 64", 64, (8, 4096), (40, 46)),
    ("at input = 2x512", None, (2, 512), (40, 45)),
    ("at world = 64", 64, None, None),
    ("at input=8X4096 ,world=64", 64, (8, 4096), (38, 44)),  # spacing and an upper-case X
    ("", None, None, None),
])
def test_expect_world_and_input_in_either_order(clause, world, shape, where):
    e = one(f"expect memory.peak <= 70GiB {clause}")
    assert (e.world, e.input_shape) == (world, shape)
    # the span covers the shape token, for diagnostics about it
    span = e.input_span
    assert (None if span is None else (span.column, span.end_column)) == where


def test_expect_input_of_any_arity_parses_validation_judges_it():
    assert one("expect memory.peak <= 1GiB at input = 512").input_shape == (512,)
    assert one("expect memory.peak <= 1GiB at input = 0x1x2").input_shape == (0, 1, 2)


@pytest.mark.parametrize("text,expected", [
    ("expect memory.peak <= 1GiB at input = 2x512, input = 2x3", "`world`"),  # each clause once
    ("expect memory.peak <= 1GiB at world = 2, world = 3", "`input`"),
    ("expect memory.peak <= 1GiB at input = -2x3", "an input shape such as `2x512`"),
    ("expect memory.peak <= 1GiB at input = 2x", "end of line"),
    ("expect memory.peak <= 1GiB at input = 2 x 512", "end of line"),
    ("expect memory.peak <= 1GiB at input", "`=`"),
])
def test_bad_at_clauses_are_syntax_errors(text, expected):
    (d,) = errors(text)
    assert d.code == "P001" and expected in d.help[-1], d


def test_input_and_world_are_names_outside_the_at_clause():
    plan = loads("unit input.world\nmesh (input = 2)\nunit x { input 2 }\n")
    assert [seg.pattern for seg in plan.statements[0].target.base.segments] == ["input", "world"]
    assert plan.statements[1].axes[0].name == "input"
    assert plan.statements[2].block.options[0].name == "input"


@pytest.mark.parametrize("text,value,is_bytes", [
    ("100M", 1e8, False), ("1.5B", 1.5e9, False), ("70GiB", 70 * 2**30, True), ("512MB", 512e6, True),
    ("2KiB", 2048, True), ("3T", 3e12, False)])
def test_quantities(text, value, is_bytes):
    assert parse_quantity(text) == (value, is_bytes)


def test_statements_separated_by_semicolons_and_continuations():
    plan = loads("unit a; unit b\nunit [c, \\\n d]\n")
    assert [str(s.target) for s in plan.statements] == ["a", "b", "[c, d]"]


def test_comments_are_kept_with_spans():
    plan = loads("# head\nunit a  # tail\n")
    assert [(c.text, c.span.line, c.span.column) for c in plan.comments] == [("# head", 1, 1), ("# tail", 2, 9)]


def test_blocks_span_lines():
    s = one("defaults {\n  precision param = bf16\n  reshard after_forward = true\n}")
    assert [o.name for o in s.block.options] == ["precision", "reshard"]


# ===================================================================== includes


def test_include_splices_in_place(tmp_path):
    (tmp_path / "base.plan").write_text("unit a\nunit b\n")
    (tmp_path / "top.plan").write_text('unit first\ninclude "base.plan"\nunit last\n')
    from planc.lang.parse import load
    plan = load(tmp_path / "top.plan")
    assert [str(s.target) for s in plan.statements] == ["first", "a", "b", "last"]
    assert {f.rsplit("/", 1)[-1] for f, _ in plan.sources} == {"top.plan", "base.plan"}
    assert plan.statements[1].span.file.endswith("base.plan")


def test_include_from_string_is_relative_to_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    diags = errors('include "missing.plan"')
    assert [d.code for d in diags] == ["P003"]


# ===================================================================== syntax errors and recovery


def test_every_broken_line_is_reported():
    diags = errors("unit a\nunit )\nunit b\nunt c\n")
    assert [(d.code, d.span.line) for d in diags] == [("P001", 2), ("P001", 4)]


def test_expected_tokens_in_user_terms():
    (d,) = errors("unit [a, b")
    assert "`]`" in d.help[0] and "RSQB" not in d.help[0]


def test_statement_continued_on_next_line_is_one_error():
    (d,) = errors("unit [a,\n  b]\nunit c\n")
    assert d.message == "unexpected end of line: `[` is not closed on this line"
    assert d.related[0][0].column == 6
    assert "end the line with `\\`" in d.help[0]


def test_unclosed_block_is_one_error_and_parsing_goes_on():
    diags = errors("defaults {\n  precision param = bf16\nunit a\nunit )\n")
    assert [d.span.line for d in diags] == [3, 4]
    assert diags[0].message == "unclosed `{`: the block on line 1 has no `}` before `unit`"
    assert diags[0].related[0][0].line == 1


def test_unclosed_block_at_end_of_file():
    (d,) = errors("unit a {\n reshard after_forward = false\n")
    assert d.message.startswith("unclosed `{`") and "end of the file" in d.message


def test_braces_in_strings_and_comments_do_not_count():
    (d,) = errors('model "a{b"  # {\nunit [x,\n')
    assert d.span.line == 2 and "`[` is not closed" in d.message


def test_unexpected_character():
    (d,) = errors("unit a @")
    assert d.message == "unexpected character `@`" and d.span.column == 8


def test_nesting_too_deep_is_p005():
    (d,) = errors("place w " + "Shard(" * 5000 + "0" + ")" * 5000)
    assert d.code == "P005" and "5000" in d.message


def test_loads_raises_plan_error_with_all_diagnostics():
    with pytest.raises(PlanError) as exc:
        loads("unit )\nunit (\n")
    assert len(exc.value.diagnostics) == 2 and "error[P001]" in str(exc.value)


@pytest.mark.parametrize("text", ["model x\u2028model", "unit a\x0cunit b {", "unit a {\r\n"])
def test_end_of_file_position_counts_only_newlines(text):
    (d,) = errors(text)  # \u2028 and \f are not line ends for the parser, so not for spans either
    assert d.span.line == text.rstrip("\n").count("\n") + 1
