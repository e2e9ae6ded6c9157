"""Property tests: whatever the input, planc answers with a plan or diagnostics, never a traceback.

Hypothesis feeds the parser arbitrary text, bytes read back as a file, deep bracket nests and
soups of the grammar's own tokens, and feeds the compiler random but well-formed plans over a
tiny model. Every diagnostic must carry a registered code and a span inside the file it
names. Budget: about 20 s in total (see `settings` below).
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planc import zoo
from planc.compiler import CompiledPlan
from planc.diagnostics import CODES
from planc.diagnostics.render import render_github, render_json, render_text
from planc.lang.parse import MAX_PLAN_BYTES, load_with_diagnostics, loads_with_diagnostics
from planc.model.graph import ModelGraph

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# The grammar's vocabulary, as a user might mistype it.
KEYWORDS = ["model", "include", "mesh", "defaults", "unit", "root", "checkpoint", "compile", "ignore",
            "place", "expect", "optional", "not", "none", "except", "where", "at", "world", "units"]
PUNCT = ["{", "}", "[", "]", "(", ")", ",", ";", ":", ".", "=", "==", "<=", ">=", "<", ">", "!=", "|",
         "*", "**", "\n", "\\\n", "#", "\"", "re\"", "-", "\t", "\r\n"]
WORDS = ["blocks", "layers", "0", "-1", "1:", ":2", "w*", "mlp", "attn", "lm_head", "wte", "precision",
         "param", "bf16", "reshard", "after_forward", "true", "false", "offload", "cpu", "prefetch",
         "forward", "backward", "Shard", "100M", "70GiB", "1.5", "size", "planc.zoo:gpt_tiny",
         "\"base.plan\"", "re\"blocks\\.\\d+\"", "HYBRID_SHARD", "replicate", "shard", "GPTBlock",
         "full", "memory.peak", "é", "\x00", "\u2028", "\ud800"]


@pytest.fixture(scope="module")
def graph() -> ModelGraph:
    return ModelGraph.from_module(zoo.gpt_tiny())


def assert_well_formed(diags, sources: dict[str, str], fallback: str) -> None:
    """Registered codes; every span inside the text of the file it names; every renderer copes."""
    render_text(diags, sources)
    json.loads(render_json(diags))
    render_github(diags)
    for d in diags:
        assert d.code in CODES, d
        assert d.severity in ("error", "warning", "note")
        if d.span is None:
            continue
        text = sources.get(d.span.file, sources.get(fallback, ""))
        lines = text.split("\n")
        assert 1 <= d.span.line <= len(lines), (d, len(lines))
        width = len(lines[d.span.line - 1])
        assert 1 <= d.span.column <= width + 2, (d, width)
        assert (d.span.end_line, d.span.end_column) >= (d.span.line, d.span.column), d


def parse(text: str):
    plan, diags = loads_with_diagnostics(text, "<fuzz>")
    sources = dict(plan.sources) if plan is not None else {"<fuzz>": text}
    assert_well_formed(diags, sources, "<fuzz>")
    return plan, diags


# ===================================================================== parser


@FAST
@given(st.text(max_size=400))
def test_arbitrary_text(text):
    parse(text)


@FAST
@given(st.lists(st.sampled_from(KEYWORDS + PUNCT + WORDS), max_size=60),
       st.lists(st.sampled_from([" ", "", "\n", " \n"]), min_size=1, max_size=60))
def test_token_soup(tokens, seps):
    text = "".join(t + seps[i % len(seps)] for i, t in enumerate(tokens))
    parse(text)


@SLOW
@given(st.binary(max_size=300))
def test_binary_file(data):
    fd, path = tempfile.mkstemp(suffix=".plan")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        plan, diags = load_with_diagnostics(path)
        sources = dict(plan.sources) if plan is not None else {}
        assert_well_formed(diags, sources, path)
        if plan is None:
            assert [d.code for d in diags] == ["P002"]
    finally:
        os.unlink(path)


@SLOW
@given(st.integers(1, 4000), st.sampled_from(["[", "(", "{", "[(", "Shard(", "{ a "]),
       st.sampled_from(["unit ", "place x ", "defaults ", "unit a { prefetch forward = ", ""]),
       st.booleans())
def test_deep_nesting(depth, opener, prefix, closed):
    closers = {"[": "]", "(": ")", "{": "}", "[(": ")]", "Shard(": ")", "{ a ": "}"}
    text = prefix + opener * depth + "x" + (closers[opener] * depth if closed else "")
    parse(text)


def test_huge_input_is_refused_not_parsed():
    plan, diags = loads_with_diagnostics("unit a\n" * (MAX_PLAN_BYTES // 7 + 1), "<huge>")
    assert plan is None and [d.code for d in diags] == ["P002"]


def test_large_valid_plan_parses():
    text = "model planc.zoo:gpt_tiny\n" + "unit blocks.* { reshard after_forward = false }\n" * 5000
    plan, diags = parse(text)
    assert not diags and len(plan.statements) == 5001


def test_many_errors_are_capped():
    plan, diags = parse("unit )\n" * 500)
    assert 1 <= len(diags) <= 10 and all(d.code == "P001" for d in diags)


# ===================================================================== pathological families

LOOKALIKE_CHARS = ["\u0440", "\u0430", "\u2212", "\u00a0", "\u200b", "\ufeff", "\u201c", "\uff1d", "\u00d7"]
VALID = "model planc.zoo:gpt_tiny\nmesh (replicate = 1, shard = *)\nunit blocks.* { reshard after_forward = false }\n" \
        "expect memory.peak <= 1GiB at world = 8, input = 2x16\nplace **.c_fc.weight Shard(0)\n"


@FAST
@given(st.integers(0, len(VALID)), st.sampled_from(LOOKALIKE_CHARS), st.booleans())
def test_unicode_lookalikes_and_boms(position, char, bom):
    text = ("\ufeff" if bom else "") + VALID[:position] + char + VALID[position:]
    parse(text)


@FAST
@given(st.sampled_from(["mesh (shard = {})", "expect units == {}", "expect memory.peak <= 1GiB at world = {}",
                        "unit a[{}]", "unit a[-{}:]", "unit a {{ reshard {} }}", "unit a where size >= {}M",
                        "expect memory.peak <= {}.5GiB", "expect memory.peak <= 1GiB at input = {}x{}"]),
       st.integers(1, 6000))
def test_huge_integers(template, digits):
    number = "9" * digits
    plan, diags = parse(template.format(number, number))
    if digits > 19:
        assert [d.code for d in diags] == ["P103"], diags


@SLOW
@given(st.integers(2, 12), st.data())
def test_include_graphs(n, data):
    """Random include graphs over n files: cycles, diamonds, missing files, FIFOs, directories."""
    with tempfile.TemporaryDirectory() as folder:
        for i in range(n):
            targets = data.draw(st.lists(st.integers(0, n + 2), max_size=4), label=f"includes of f{i}")
            body = "".join(f'include "f{t}.plan"\n' for t in targets) + f"unit u{i}\n"
            with open(os.path.join(folder, f"f{i}.plan"), "w") as f:
                f.write(body)
        special = data.draw(st.sampled_from(["none", "fifo", "dir"]), label="special file")
        if special == "fifo" and hasattr(os, "mkfifo"):
            os.mkfifo(os.path.join(folder, f"f{n}.plan"))
        elif special == "dir":
            os.mkdir(os.path.join(folder, f"f{n}.plan"))
        plan, diags = load_with_diagnostics(os.path.join(folder, "f0.plan"))
        sources = dict(plan.sources) if plan is not None else {}
        assert_well_formed(diags, sources, os.path.join(folder, "f0.plan"))
        assert all(d.code in ("P003", "P004", "P006") for d in diags), diags


def test_exponential_includes_are_cut_short():
    with tempfile.TemporaryDirectory() as folder:
        for i in range(30):
            with open(os.path.join(folder, f"d{i}.plan"), "w") as f:
                f.write(f'include "d{i + 1}.plan"\ninclude "d{i + 1}.plan"\n')
        with open(os.path.join(folder, "d30.plan"), "w") as f:
            f.write("unit a\n")
        _, diags = load_with_diagnostics(os.path.join(folder, "d0.plan"))
        assert [d.code for d in diags] == ["P006"]


# ===================================================================== compiler on random plans

SEGMENTS = ["blocks", "*", "**", "0", "1", "-1", "mlp", "attn", "w*", "{mlp,attn}", "ln_*", "blocks[0]",
            "blocks[-1:]", "blocks[1:9]", "qkv", "wte", "lm_head", "nope", "unit", "model"]
SUFFIXES = ["", " : GPTBlock", " : Linear | LayerNorm", " : Nope", " where size >= 1K", " where size < 100",
            " except blocks.0", " except re\"blocks\\.1.*\"", " where bogus > 1"]
OPTIONS = ["", " { reshard after_forward = false }", " { precision param = bf16, reduce = fp32 }",
           " { offload cpu }", " { prefetch forward = 2 }", " { prefetch forward = [blocks.0, ln_f] }",
           " { checkpoint; compile }", " { reshard after_forward = 3 }", " { strategy SHARD_GRAD_OP }",
           " { precision param = bf16, output = fp32, cast_inputs = true }", " { precison x = 1 }"]
OTHER = ["root none", "root { reshard after_forward = false }", "mesh (replicate = 2, shard = *)",
         "mesh (replicate = *, shard = *)", "mesh HYBRID_SHARD (shard = 2)", "expect units == 4",
         "expect memory.peak <= 1GiB at world = 8", "expect memory.peak <= 1GiB at input = 2x16, world = 2",
         "expect memory.activations <= 1MiB at input = 2x8", "expect memory.peak <= 1GiB at input = 0x9",
         "expect memory.peak <= 1GiB at input = 1x4096", "ignore lm_head.weight", "ignore **.bias",
         "place blocks.*.mlp.w_in.weight Shard(1)", "place wte.weight Shard(3)", "checkpoint blocks.*",
         "compile blocks.* ", "expect not unit blocks.0", "defaults { precision param = bf16 }",
         "unit [wte, lm_head]", "unit [ln_f, lm_head] { reshard after_forward = false }", "unit re\"(\""]


@st.composite
def selectors(draw):
    path = ".".join(draw(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=4)))
    return path + draw(st.sampled_from(SUFFIXES))


@st.composite
def plans(draw):
    lines = ["model planc.zoo:gpt_tiny"]
    for _ in range(draw(st.integers(1, 8))):
        if draw(st.booleans()):
            lines.append(draw(st.sampled_from(OTHER)))
        else:
            opt = "optional " if draw(st.booleans()) else ""
            lines.append(f"{opt}unit {draw(selectors())}{draw(st.sampled_from(OPTIONS))}")
    return "\n".join(lines) + "\n"


@SLOW
@given(plans(), st.sampled_from([None, 1, 2, 3, 8]))
def test_compile_random_plans(graph, text, world):
    plan, diags = loads_with_diagnostics(text, "<fuzz>")
    if plan is None or any(d.is_error for d in diags):
        assert_well_formed(diags, {"<fuzz>": text}, "<fuzz>")
        return
    compiled = CompiledPlan(plan, graph, world)
    assert_well_formed(compiled.diagnostics, dict(plan.sources), "<fuzz>")
    if compiled.ok:  # a plan without errors resolves to units FSDP2 can apply in order
        seen: set[str] = set()
        for u in compiled.units:
            assert not seen & set(u.params)
            seen |= set(u.params)
        assert compiled.units[-1].is_root or compiled.resolution.root_disabled
