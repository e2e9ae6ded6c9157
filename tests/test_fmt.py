"""`planc fmt`: canonical layout, comments kept, idempotent, meaning unchanged.

Goldens: each tests/golden/fmt/<name>.plan (a messy input) beside <name>.formatted (what
`format_plan` makes of it). Rewrite them after an intended change with

    PLANC_UPDATE_GOLDENS=1 pytest tests/test_fmt.py

and review the diff.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from planc.cli import fmt as fmt_cli
from planc.diagnostics import PlanError
from planc.lang import fmt, printer
from planc.lang.fmt import format_plan, strip_spans
from planc.lang.parse import parse_text

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "fmt"
from goldens import check_golden  # noqa: E402


def tree(text: str):
    statements, _, diags = parse_text(text, "<t>")
    assert not diags, diags
    return strip_spans(statements)


def comments(text: str) -> list[str]:
    return [c.text.rstrip() for c in parse_text(text, "<t>")[1]]


def assert_formats(text: str) -> str:
    """Format `text` and check the three promises: same tree, comments in order, idempotent."""
    out = format_plan(text, "<t>")
    assert tree(out) == tree(text)
    assert comments(out) == comments(text)
    assert format_plan(out, "<t>") == out
    return out


def run_fmt(*argv: str) -> tuple[int, str]:
    args = argparse.Namespace(plans=[a for a in argv if a != "--check"], check="--check" in argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = fmt_cli.main(args)
    return code, out.getvalue()


# ===================================================================== layout


def test_canonical_spacing():
    text = ("model  planc.zoo:seed_transformer\n"
            "mesh(replicate=1,shard=*)\n"
            "unit [norm,output]{reshard after_forward=false}\n"
            "place   **.experts.w*   Shard( 1 )\n")
    assert assert_formats(text) == ("model planc.zoo:seed_transformer\n\n"
                                    "mesh (replicate = 1, shard = *)\n\n"
                                    "unit [norm, output] { reshard after_forward = false }\n\n"
                                    "place **.experts.w* Shard(1)\n")


def test_blocks_one_option_inline_many_options_indented():
    text = "defaults { precision param = bf16, reduce = fp32; reshard after_forward = true }\n" \
           "unit a {\n\n   offload cpu\n}\nunit b {}\n"
    assert assert_formats(text) == ("defaults {\n"
                                    "  precision param = bf16, reduce = fp32\n"
                                    "  reshard after_forward = true\n"
                                    "}\n\n"
                                    "unit a { offload cpu }\n"
                                    "unit b {}\n")


def test_statement_order_kept_and_semicolons_split():
    text = "unit b ; unit a\nexpect units == 3;expect not unit a\nunit c\n"
    out = assert_formats(text)
    assert out == "unit b\nunit a\n\nexpect units == 3\nexpect not unit a\n\nunit c\n"


def test_blank_lines_collapsed_and_kinds_separated():
    text = "\n\n\nunit a\n\n\n\nunit b\nunit c\ncheckpoint a full\ncompile a\nignore **.bias\n\n\n"
    assert assert_formats(text) == "unit a\n\nunit b\nunit c\n\ncheckpoint a full\ncompile a\n\nignore **.bias\n"


def test_keyword_named_options_on_later_block_lines():
    # `checkpoint` and `compile` are statement keywords too; inside a block, on a later line
    # or after `;`, they must still parse as options (grammar/plan.lark `_bsep`)
    text = "unit a { offload cpu; checkpoint; compile fullgraph = true }\n"
    assert assert_formats(text) == "unit a {\n  offload cpu\n  checkpoint\n  compile fullgraph = true\n}\n"


def test_crlf_and_continuation_lines():
    assert assert_formats("unit a\r\n# c\r\n\r\n\r\nunit \\\r\n  b\r\n") == "unit a\n# c\n\nunit b\n"


def test_fsdp1_spellings_kept():
    text = ("mesh   HYBRID_SHARD(shard=8)\nmesh NO_SHARD\n"
            "unit a{sharding_strategy SHARD_GRAD_OP}\n"
            "unit b { mixed_precision param_dtype=bf16,buffer_dtype=fp32 ; cpu_offload offload_params=true }\n")
    assert assert_formats(text) == ("mesh HYBRID_SHARD (shard = 8)\nmesh NO_SHARD\n\n"
                                    "unit a { sharding_strategy SHARD_GRAD_OP }\n"
                                    "unit b {\n"
                                    "  mixed_precision param_dtype = bf16, buffer_dtype = fp32\n"
                                    "  cpu_offload offload_params = true\n"
                                    "}\n")


def test_selectors_values_and_expects_round_trip():
    text = ('optional unit **.mlp:MLP|Other where size>=1M except transformer_layers.0.mlp except re"x\\"y"\n'
            'unit transformer_layers[-2:] { offload cpu }\nunit layers[1:3]\nunit blocks.{attn,mlp}\n'
            'unit layers[0] { prefetch forward = [a.b, c[1:]], backward = 2 }\n'
            'ignore re"a\\"b\\\\"\n'
            'expect memory.peak<=70GiB at world=64\nexpect unit [a,b]\n'
            'unit x { compile fullgraph = true; checkpoint; precision "bf16" }\n'
            'model "hf:configs/llama.json"\nmodel "hf:my configs/llama.json"\ninclude "base \\"x\\".plan"\n')
    out = assert_formats(text)
    assert 'ignore re"a\\"b\\\\"' in out
    assert "optional unit **.mlp : MLP | Other where size >= 1M except transformer_layers.0.mlp" in out
    assert "expect memory.peak <= 70GiB at world = 64" in out
    assert "model hf:configs/llama.json\n" in out  # quotes only where needed
    assert 'model "hf:my configs/llama.json"' in out


@pytest.mark.parametrize("written,canonical,world,shape", [
    ("at world=64,input=8x4096", "at world = 64, input = 8x4096", 64, (8, 4096)),
    ("at input = 8X4096 ,  world = 64", "at world = 64, input = 8x4096", 64, (8, 4096)),  # world first, `x`
    ("at  input=2x512", "at input = 2x512", None, (2, 512)),
    ("at world=64", "at world = 64", 64, None),
])
def test_expect_at_clause_round_trips(written, canonical, world, shape):
    out = assert_formats(f"expect memory.peak<=70GiB {written}  # why\n")
    assert out == f"expect memory.peak <= 70GiB {canonical}  # why\n"
    (e,), _, _ = parse_text(out, "<t>")
    assert (e.world, e.input_shape) == (world, shape)


def test_include_kept_as_written_not_spliced(tmp_path):
    # the included file does not exist: fmt must not care, it formats this file only
    out = assert_formats('include   "missing/base.plan"\nunit a\n')
    assert out == 'include "missing/base.plan"\n\nunit a\n'


def test_empty_and_comment_only_plans():
    assert format_plan("", "<t>") == ""
    assert format_plan("\n\n  \n", "<t>") == ""
    assert assert_formats("# only\n\n\n# comments\n") == "# only\n\n# comments\n"


# ===================================================================== comments


def test_comments_stay_with_what_they_annotate():
    text = ("# header\n\n"
            "model m:f   # which model\n"
            "# about the units\n"
            "unit a;unit b # after b\n"
            "defaults {   # block head\n"
            "  # before precision\n"
            "  precision bf16    # trailing option\n"
            "  # block footer\n"
            "} # after block\n"
            "# file end\n")
    assert assert_formats(text) == ("# header\n\n"
                                    "model m:f  # which model\n\n"
                                    "# about the units\n"
                                    "unit a\n"
                                    "unit b  # after b\n\n"
                                    "defaults {  # block head\n"
                                    "  # before precision\n"
                                    "  precision bf16  # trailing option\n"
                                    "  # block footer\n"
                                    "}  # after block\n"
                                    "# file end\n")


def test_block_with_one_option_and_a_comment_stays_multiline():
    text = "unit a {\n  offload cpu # why\n}\n"
    assert assert_formats(text) == "unit a {\n  offload cpu  # why\n}\n"


def test_kind_break_goes_before_the_comments_of_the_next_statement():
    text = "unit a\n# checkpoint the blocks\ncheckpoint a\n"
    assert assert_formats(text) == "unit a\n\n# checkpoint the blocks\ncheckpoint a\n"


# ===================================================================== refusals


def test_syntax_errors_refused():
    with pytest.raises(PlanError) as err:
        format_plan("unit [a\nunit b {\n", "<t>")
    assert {d.code for d in err.value.diagnostics} == {"P001"}


def test_cli_check_rewrite_and_exit_codes(tmp_path):
    messy = tmp_path / "messy.plan"
    messy.write_text("unit  a{offload cpu}\n")
    clean = tmp_path / "clean.plan"
    clean.write_text("unit a\n")
    code, out = run_fmt("--check", str(messy), str(clean))
    assert code == 1
    assert f"would reformat {messy}" in out and f"would reformat {clean}" not in out
    assert "+unit a { offload cpu }" in out  # the diff-like hint
    assert messy.read_text() == "unit  a{offload cpu}\n"  # --check never writes

    code, out = run_fmt(str(messy), str(clean))
    assert code == 0 and f"reformatted {messy}" in out
    assert messy.read_text() == "unit a { offload cpu }\n"
    assert run_fmt("--check", str(messy), str(clean))[0] == 0

    broken = tmp_path / "broken.plan"
    broken.write_text("unit [a\n")
    code, out = run_fmt(str(broken))
    assert code == 1 and "error[P001]" in out
    assert broken.read_text() == "unit [a\n"

    code, out = run_fmt(str(tmp_path / "nope.plan"), str(clean))
    assert code == 2 and "error[P002]" in out
    binary = tmp_path / "bin.plan"
    binary.write_bytes(b"\xff\xfe\x00")
    assert run_fmt(str(binary))[0] == 2


def test_cli_stdin_to_stdout(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("unit  a{offload cpu} # c\n"))
    code, out = run_fmt("-")
    assert code == 0 and out == "unit a { offload cpu }  # c\n"


def test_every_shipped_plan_is_formatted():
    plans = sorted((ROOT / "plans").glob("**/*.plan"))
    assert plans
    unformatted = [p.relative_to(ROOT).as_posix() for p in plans
                   if format_plan(p.read_text(encoding="utf-8"), str(p)) != p.read_text(encoding="utf-8")]
    assert not unformatted, f"run `planc fmt {' '.join(unformatted)}`"


# ===================================================================== goldens


GOLDEN_CASES = sorted(GOLDEN.glob("*.plan"))


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=[c.stem for c in GOLDEN_CASES])
def test_golden(case: pathlib.Path):
    text = case.read_text(encoding="utf-8")
    out = assert_formats(text)
    check_golden(case.with_suffix(".formatted"), out)


def test_goldens_exist():
    assert len(GOLDEN_CASES) >= 3


# ===================================================================== property test

_names = hs.sampled_from(["layers", "mlp", "attn", "norm", "output", "unit", "model", "w1", "experts"])
_sp = hs.sampled_from([" ", "  ", "\t"])  # where a space is required
_osp = hs.sampled_from(["", " ", "  "])  # where a space is optional


@hs.composite
def _segment(draw):
    kind = draw(hs.integers(0, 6))
    name = draw(_names)
    if kind == 0:
        return "*"
    if kind == 1:
        return "**"
    if kind == 2:
        return f"{name}[{draw(hs.integers(-3, 5))}]"
    if kind == 3:
        a, b = draw(hs.sampled_from(["", "1", "-2"])), draw(hs.sampled_from(["", "3", "-1"]))
        return f"{name}[{a}:{b}]"
    if kind == 4:
        return "{" + f",{draw(_osp)}".join(draw(hs.lists(_names, min_size=1, max_size=3))) + "}"
    if kind == 5:
        return str(draw(hs.integers(0, 30)))
    return name + draw(hs.sampled_from(["", "*", "_x"]))


@hs.composite
def _selector(draw):
    if draw(hs.integers(0, 5)) == 0:
        body = draw(hs.text(hs.sampled_from('ab.*\\"[]'), max_size=6))
        # a valid REGEX body: escape backslashes and quotes as the lexer requires
        base = 're"' + body.replace("\\", "\\\\").replace('"', '\\"') + '"'
    else:
        base = ".".join(draw(hs.lists(_segment(), min_size=1, max_size=3)))
    out = base
    if draw(hs.booleans()):
        out += f"{draw(_sp)}:{draw(_sp)}" + f"{draw(_osp)}|{draw(_osp)}".join(
            draw(hs.lists(hs.sampled_from(["MLP", "Block", "Linear"]), min_size=1, max_size=2)))
    if draw(hs.booleans()):
        out += f"{draw(_sp)}where{draw(_sp)}size{draw(_osp)}>={draw(_osp)}" + draw(hs.sampled_from(["1M", "100", "2.5B"]))
    for seg in draw(hs.lists(_segment(), max_size=2)):
        out += f"{draw(_sp)}except{draw(_sp)}{seg}"
    return out


@hs.composite
def _value(draw):
    kind = draw(hs.integers(0, 6))
    if kind == 0:
        return draw(hs.sampled_from(["bf16", "true", "cpu", "FULL_SHARD"]))
    if kind == 1:
        return draw(hs.sampled_from(["1", "-2", "0.5", "70GiB", "1M"]))
    if kind == 2:
        body = draw(hs.text(hs.sampled_from('ab \\"n'), max_size=5))
        return '"' + body.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if kind == 3:
        return "*"
    if kind == 4:
        return f"Shard({draw(_osp)}{draw(hs.integers(0, 2))}{draw(_osp)})"
    if kind == 5:
        return "[" + f",{draw(_osp)}".join(draw(hs.lists(_selector(), min_size=1, max_size=2))) + "]"
    return draw(_names)


@hs.composite
def _option(draw):
    name = draw(hs.sampled_from(["precision", "reshard", "offload", "prefetch", "checkpoint", "x"]))
    args = []
    for _ in range(draw(hs.integers(0, 3))):
        key = draw(hs.sampled_from([None, "param", "after_forward", "forward"]))
        value = draw(_value())
        args.append(value if key is None else f"{key}{draw(_osp)}={draw(_osp)}{value}")
    return name + (draw(_sp) + f"{draw(_osp)},{draw(_osp)}".join(args) if args else "")


_comment = hs.text(hs.sampled_from("abc #{}\"'\\;"), max_size=8).map(lambda t: "#" + t)


@hs.composite
def _block(draw):
    opts = draw(hs.lists(_option(), max_size=3))
    if not opts or draw(hs.booleans()):
        return "{" + draw(_osp) + f"{draw(_osp)};{draw(_osp)}".join(opts) + draw(_osp) + "}"
    lines = ["{" + (f" {draw(_comment)}" if draw(hs.booleans()) else "")]
    for opt in opts:
        if draw(hs.integers(0, 3)) == 0:
            lines.append(draw(_osp) + draw(_comment))
        if draw(hs.integers(0, 3)) == 0:
            lines.append("")
        lines.append(draw(_osp) + opt + (f"{draw(_osp)}{draw(_comment)}" if draw(hs.booleans()) else ""))
    if draw(hs.booleans()):
        lines.append(draw(_comment))
    return "\n".join(lines) + "\n}"


@hs.composite
def _statement(draw):
    kind = draw(hs.integers(0, 11))
    opt = draw(hs.sampled_from(["", "optional "]))
    sel = draw(_selector())
    target = sel if draw(hs.booleans()) else \
        "[" + f",{draw(_osp)}".join(draw(hs.lists(_selector(), min_size=1, max_size=3))) + "]"
    if kind == 0:
        return draw(hs.sampled_from(["model planc.zoo:gpt_tiny", 'model "hf:llama tiny"', 'include "base.plan"']))
    if kind == 1:
        dims = draw(hs.lists(hs.tuples(hs.sampled_from(["replicate", "shard"]), hs.sampled_from(["1", "2", "*"])),
                             min_size=1, max_size=2))
        strategy = draw(hs.sampled_from(["", " HYBRID_SHARD"]))
        return f"mesh{strategy}{draw(_osp)}(" + ",".join(f"{n}{draw(_osp)}={draw(_osp)}{v}" for n, v in dims) + ")"
    if kind == 2:
        return f"defaults{draw(_osp)}{draw(_block())}"
    if kind == 3:
        block = f"{draw(_osp)}{draw(_block())}" if draw(hs.booleans()) else ""
        return f"{opt}unit{draw(_sp)}{target}{block}"
    if kind == 4:
        return draw(hs.sampled_from(["root none", "root {}"])) if draw(hs.booleans()) else f"root {draw(_block())}"
    if kind == 5:
        return f"{opt}checkpoint{draw(_sp)}{sel}" + draw(hs.sampled_from(["", " full", " none"]))
    if kind == 6:
        return f"{opt}compile{draw(_sp)}{sel}"
    if kind == 7:
        return f"{opt}ignore{draw(_sp)}{sel}"
    if kind == 8:
        return f"{opt}place{draw(_sp)}{sel}{draw(_sp)}Shard({draw(hs.integers(0, 2))})"
    if kind == 9:
        return f"expect{draw(_sp)}" + draw(hs.sampled_from(["", "not "])) + f"unit{draw(_sp)}{target}"
    if kind == 10:
        return "expect units" + draw(hs.sampled_from(["==", " <= ", ">"])) + draw(hs.sampled_from(["27", "1.5", "3M"]))
    world = f"world{draw(_osp)}={draw(_osp)}64"
    shape = f"input{draw(_osp)}={draw(_osp)}" + draw(hs.sampled_from(["8x4096", "2X512", "0x1", "7", "1x2x3"]))
    at = draw(hs.sampled_from(["", world, shape, f"{world},{draw(_osp)}{shape}", f"{shape}{draw(_osp)},{world}"]))
    return "expect memory.peak <= 70GiB" + (f"{draw(_sp)}at{draw(_sp)}{at}" if at else "")


@hs.composite
def _plan(draw):
    parts = []
    for stmt in draw(hs.lists(_statement(), max_size=8)):
        for _ in range(draw(hs.integers(0, 2))):
            parts.append(draw(hs.sampled_from(["\n", "\n\n\n", f"{draw(_comment)}\n", ";"])))
        trailing = draw(hs.integers(0, 3)) == 0
        parts.append(stmt + (f"{draw(_osp)}{draw(_comment)}" if trailing else ""))
        # a comment runs to the end of its line: only a newline may follow it
        parts.append(draw(hs.sampled_from(["\n", "\n\n"] if trailing else ["\n", "\n", ";", "\n\n"])))
    if parts and parts[-1] == ";" and draw(hs.booleans()):
        parts.append("\n")
    return "".join(parts)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_plan())
def test_property_same_tree_comments_kept_idempotent(text):
    statements, _, diags = parse_text(text, "<t>")
    # the generator writes valid plans; a rejection here is a generator bug worth seeing
    assert not diags, (text, diags[0].message)
    assert_formats(text)


def test_a_printer_bug_is_caught_before_writing(tmp_path, monkeypatch):
    # simulate a formatter bug that drops `optional`: the re-parse check must refuse it
    plan = tmp_path / "p.plan"
    plan.write_text("optional  unit a\n")
    monkeypatch.setattr(printer, "_optional", lambda s: "")
    with pytest.raises(fmt.FormatError):
        format_plan(plan.read_text(), str(plan))
    code, out = run_fmt(str(plan))
    assert code == 2 and "internal error" in out
    assert plan.read_text() == "optional  unit a\n"
