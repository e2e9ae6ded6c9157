"""`planc lsp` end to end: a real LSP client (pytest-lsp) talks to `planc lsp` over stdio.

Covers diagnostics (open, debounced change, includes, a model that does not build, no
model), hover, completion, go to definition, formatting, positions on a line with
non-ASCII text, and a replay of the parser's fuzz corpus through the server.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest_lsp = pytest.importorskip("pytest_lsp")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402
from lsprotocol import types as T  # noqa: E402
from pygls.protocol import default_converter  # noqa: E402
from pytest_lsp import ClientServerConfig, LanguageClient  # noqa: E402
from pytest_lsp.client import DEFAULT_CLIENT_FEATURES, register_lsp_features  # noqa: E402
from test_fuzz import KEYWORDS, PUNCT, WORDS, plans  # noqa: E402  (the parser's fuzz corpus)

import planc  # noqa: E402
from planc.lang.fmt import format_plan  # noqa: E402
from planc.quantities import show_bytes
from planc.resolve.options import OPTIONS  # noqa: E402

ASYNC = pytest.mark.asyncio(loop_scope="module")  # every test shares the module's server
# the `planc` console script `pip install -e ".[lsp]"` made, as an editor starts it
SCRIPT = pathlib.Path(sys.executable).with_name("planc")
SERVER = ([str(SCRIPT), "lsp", "--stdio"] if SCRIPT.is_file() else
          [sys.executable, "-c", "import sys; from planc.cli.main import main; sys.exit(main(['lsp', '--stdio']))"])
PLANC = [sys.executable, "-c", "import sys; from planc.cli.main import main; sys.exit(main(sys.argv[1:]))"]
TIMEOUT = 30


def make_client() -> LanguageClient:
    """pytest-lsp's test client, also keeping every publishDiagnostics (uri, version) it gets."""
    client = LanguageClient(converter_factory=default_converter)
    client.published = []

    def published(client: LanguageClient, params: T.PublishDiagnosticsParams):
        client.published.append((params.uri, params.version))
        DEFAULT_CLIENT_FEATURES[T.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS](client, params)

    register_lsp_features(client, {**DEFAULT_CLIENT_FEATURES, T.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS: published})
    return client


@pytest_lsp.fixture(scope="module", config=ClientServerConfig(server_command=SERVER, client_factory=make_client))
async def client(lsp_client: LanguageClient, tmp_path_factory):
    root = tmp_path_factory.mktemp("ws")
    await lsp_client.initialize_session(T.InitializeParams(
        capabilities=T.ClientCapabilities(), root_uri=root.as_uri(),
        initialization_options={"debounce": 0.05}))
    lsp_client.root = root
    yield
    await lsp_client.shutdown_session()


_count = iter(range(10**6))


def new_uri(client, name: str | None = None) -> str:
    return (client.root / (name or f"doc{next(_count)}.plan")).as_uri()


async def diagnostics(client, uri: str) -> list[T.Diagnostic]:
    """Wait for the next diagnostics of `uri` (the previous ones are forgotten first)."""
    async def wait():
        while uri not in client.diagnostics:
            await client.wait_for_notification(T.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
        return list(client.diagnostics[uri])
    return await asyncio.wait_for(wait(), TIMEOUT)


async def open_doc(client, text: str, name: str | None = None) -> tuple[str, list[T.Diagnostic]]:
    uri = new_uri(client, name)
    client.diagnostics.pop(uri, None)
    client.text_document_did_open(T.DidOpenTextDocumentParams(T.TextDocumentItem(uri, "plan", 1, text)))
    return uri, await diagnostics(client, uri)


def utf16(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def pos(text: str, needle: str, offset: int = 0) -> T.Position:
    """The LSP position of `needle` in `text` (UTF-16 characters, computed here independently)."""
    i = text.index(needle) + offset
    line = text.count("\n", 0, i)
    start = text.rfind("\n", 0, i) + 1
    return T.Position(line, utf16(text[start:i]))


GPT = """model planc.zoo:gpt_tiny

defaults {
  precision param = bf16, reduce = fp32
}

unit blocks.*
unit [wte, ln_f, lm_head] { reshard after_forward = false }
expect memory.peak <= 1GiB at world = 8
"""


# ===================================================================== diagnostics


@ASYNC
async def test_diagnostics_on_open_with_codes_help_and_utf16_columns(client):
    text = ('model planc.zoo:gpt_tiny\nunit blocks.*\n'
            'unit [wte, lm_head] { offload "\U0001F600é"; precison param = bf16 }\nunit blocks[12]\n')
    uri, diags = await open_doc(client, text)
    by_code = {d.code: d for d in diags}
    assert set(by_code) == {"P102", "P101", "P201"}, [(d.code, d.message) for d in diags]
    p101 = by_code["P101"]
    assert p101.source == "planc" and p101.severity == T.DiagnosticSeverity.Error
    assert p101.data == {"explain": "planc codes P101"}
    assert p101.message.startswith("unknown option `precison`") and "help: did you mean `precision`?" in p101.message
    # after an emoji (2 UTF-16 units, 1 planc column) and an é (1 and 1)
    start = pos(text, "precison")
    assert p101.range == T.Range(start, T.Position(start.line, start.character + len("precison")))
    assert by_code["P201"].range.start == pos(text, "blocks[12]")


@ASYNC
async def test_diagnostics_after_change_are_debounced_to_the_last_text(client):
    uri, diags = await open_doc(client, "unit x { precison x = 1 }\n")
    assert [d.code for d in diags] == ["P101"]  # no model: option checks, no selector matching
    for version, text in enumerate(["unit x { reshard x = 1 }\n", "unit x {\n", "unit x { reshard after_forward = false }\n"], 2):
        client.diagnostics.pop(uri, None)
        client.text_document_did_change(T.DidChangeTextDocumentParams(
            T.VersionedTextDocumentIdentifier(uri=uri, version=version),
            [T.TextDocumentContentChangeWholeDocument(text=text)]))
    before = len(client.published)
    assert await diagnostics(client, uri) == []
    await asyncio.sleep(0.3)  # 6x the debounce: nothing else comes
    # three changes in quick succession: one compile, for the last version
    assert [p for p in client.published[before:] if p[0] == uri] == [(uri, 4)]


@ASYNC
async def test_related_spans_and_untitled_documents(client):
    text = "model planc.zoo:gpt_tiny\nunit [wte, ln_f, lm_head]\nunit wte\n"
    uri = "untitled:Untitled-1"  # a buffer never saved: no file, includes from the working folder
    client.text_document_did_open(T.DidOpenTextDocumentParams(T.TextDocumentItem(uri, "plan", 1, text)))
    [p203] = [d for d in await diagnostics(client, uri) if d.code == "P203"]
    assert p203.range.start.line == 2
    [first] = p203.related_information
    assert first.location.uri == uri and first.location.range.start == T.Position(1, 0)
    assert first.message == "first unit made here"


@ASYNC
async def test_syntax_error(client):
    _, diags = await open_doc(client, "unit [norm, output\n")
    assert [d.code for d in diags] == ["P001"] and diags[0].range.start.line == 0


@ASYNC
async def test_model_that_does_not_build_is_p106_at_the_model_line(client):
    text = "unit blocks.*\nmodel planc.zoo:no_such_model\nunit x { precison x = 1 }\n"
    _, diags = await open_doc(client, text)
    p106 = next(d for d in diags if d.code == "P106")
    assert p106.range.start.line == 1 and "`planc.zoo` has no `no_such_model`" in p106.message
    assert "P101" in {d.code for d in diags}  # the checks that need no model still run
    # the same wording as `planc check`
    path = client.root / "p106.plan"
    path.write_text(text)
    out = subprocess.run(PLANC + ["check", str(path)], capture_output=True, text=True, timeout=120)
    assert p106.message.split("\n")[0] in out.stdout


@ASYNC
async def test_problem_in_an_included_file_shows_on_the_include_line(client):
    base = "model planc.zoo:gpt_tiny\nunit [wte, lm_head] { precison param = bf16 }\n"
    (client.root / "base.plan").write_text(base)
    text = 'include "base.plan"\nunit blocks.*\n'
    uri, diags = await open_doc(client, text)
    [d] = diags
    column = base.split("\n")[1].index("precison")
    assert d.code == "P101" and d.range.start.line == 0 and f"base.plan:2:{column + 1}`" in d.message
    where = d.related_information[0].location
    assert where.uri == (client.root / "base.plan").as_uri() and where.range.start == T.Position(1, column)
    # go to definition on the include path opens the base plan
    loc = await client.text_document_definition_async(T.DefinitionParams(
        T.TextDocumentIdentifier(uri), pos(text, "base.plan")))
    assert loc.uri == (client.root / "base.plan").as_uri()
    none = await client.text_document_definition_async(T.DefinitionParams(
        T.TextDocumentIdentifier(uri), pos(text, "blocks")))
    assert none is None


# ===================================================================== hover


async def hover(client, uri, text, needle, offset=0) -> str:
    h = await client.text_document_hover_async(T.HoverParams(T.TextDocumentIdentifier(uri), pos(text, needle, offset)))
    return h.contents.value if h else ""


@ASYNC
async def test_hover_selector_option_and_expect(client):
    uri, diags = await open_doc(client, GPT)
    assert diags == []
    sel = await hover(client, uri, GPT, "blocks.*", 2)
    assert "`blocks.*` matches **2** modules (2 x GPTBlock)" in sel and "`blocks.0`  GPTBlock  12.70K params" in sel
    assert "in 2 units: `blocks.0`, `blocks.1`" in sel
    assert re.search(r"param_dtype +bf16 +defaults \(doc\d+\.plan:4\)", sel)  # where it was set
    assert re.search(r"reshard_after_forward +true +defaults", sel) is None  # FSDP2 default, effective: true
    assert re.search(r"reshard_after_forward +true +default\n", sel)
    group = await hover(client, uri, GPT, "lm_head")
    assert "becomes unit `[wte, ln_f, lm_head]`" in group and "reshard_after_forward  false      unit [wte" in group
    opt = await hover(client, uri, GPT, "reshard")
    assert OPTIONS["reshard"].summary in opt
    key = await hover(client, uri, GPT, "after_forward")
    assert "accepts `true`, `false`" in key
    # the estimate shown is the one the compiler makes
    expected = planc.compile(planc.loads(GPT), planc.zoo.gpt_tiny()).memory_at(8).metric("memory.peak")
    exp = await hover(client, uri, GPT, "memory.peak")
    assert f"current estimate: **{show_bytes(expected)}** per rank" in exp
    assert await hover(client, uri, GPT, "\n\ndefaults", 1) == ""


CONTEXT = """model planc.zoo:llama_tiny
mesh (shard = *, context = 2)
unit layers.*
parallel layers.*.attention context
expect memory.peak <= 1GiB at world = 4
"""


@ASYNC
async def test_hover_on_style_words_and_the_estimate_of_a_context_plan(client):
    uri, diags = await open_doc(client, CONTEXT)
    assert [d.code for d in diags] == []  # the memory bound is estimated, and holds
    style = await hover(client, uri, CONTEXT, "context\n")
    assert style.startswith("**context**: context parallelism") and "(`context = 2`)" in style
    exp = await hover(client, uri, CONTEXT, "memory.peak")
    assert "current estimate: **" in exp and "(world 4, activations not counted)" in exp
    tp = "model planc.zoo:llama_tiny\nmesh (shard = *, tensor = 2)\nparallel layers.*.attention.wq colwise\n"
    uri, _ = await open_doc(client, tp)
    assert "torch's `ColwiseParallel`" in await hover(client, uri, tp, "colwise")


EXPERT = """model planc.zoo:routed_moe_tiny
mesh (shard = *, expert = 2)
unit layers.*
parallel layers.*.moe.experts expert
expect memory.peak <= 1GiB at world = 2
"""


@ASYNC
async def test_hover_on_the_expert_style_and_an_expert_plan_s_memory(client):
    uri, diags = await open_doc(client, EXPERT)
    assert [d.code for d in diags] == []  # the memory bound is estimated (one expert rank's step) and holds
    style = await hover(client, uri, EXPERT, "expert\n")
    assert style.startswith("**expert**: expert parallelism") and "(`expert = 2`)" in style
    exp = await hover(client, uri, EXPERT, "memory.peak")
    assert "current estimate:" in exp and "per rank" in exp


@ASYNC
async def test_hover_on_the_pipeline_and_stage_lines(client):
    text = ("model planc.zoo:llama_tiny\nmesh (pipeline = 2, shard = *)\npipeline 1F1B { microbatches 4 }\n"
            "unit layers.*\nstage 0: tok_embeddings, layers.0\nstage 1: layers.1, norm, output\n")
    uri, diags = await open_doc(client, text)
    assert diags == []
    whole = await hover(client, uri, text, "pipeline 1F1B")
    assert "2 ranks x 1 stages per rank" in whole and "| 0 | 0 |" in whole and "| 1 | 1 |" in whole
    one = await hover(client, uri, text, "stage 1")
    assert "layers.1, norm, output" in one and "| 0 | 0 |" not in one
    assert "microbatches per optimizer step" in await hover(client, uri, text, "microbatches")
    # under a pipeline FSDP does not reshard after forward: the unit's lowered policy, from its stage
    assert re.search(r"reshard_after_forward +false", await hover(client, uri, text, "layers.*"))
    assert "write `expect memory.peak <= ... at world = N, input = BxS`" in whole  # no input: no peaks


@ASYNC
async def test_hover_on_the_pipeline_shows_each_rank_s_peak(client):
    text = ("model planc.zoo:llama_tiny\nmesh (pipeline = 2, shard = *)\npipeline 1F1B { microbatches 4 }\n"
            "unit tok_embeddings\nunit layers.*\nunit [norm, output]\n"
            "expect memory.peak <= 1GiB at world = 4, input = 8x16\n")
    uri, diags = await open_doc(client, text)
    assert diags == []
    from planc import zoo
    from planc.estimate.role_memory import estimate_pipeline_memory
    compiled = planc.compile(planc.loads(text), zoo.llama_tiny(), 4)
    peaks = [e.peak.total for e in estimate_pipeline_memory(compiled, 4, input_shape=(8, 16))]
    whole = await hover(client, uri, text, "pipeline 1F1B")
    assert "| units | peak/rank | modules |" in whole
    for rank in (0, 1):  # stage, rank, parameters, units, the rank's peak
        assert re.search(rf"\| {rank} \| {rank} \| [^|]+ \| 2 \| {re.escape(show_bytes(peaks[rank]))} \|", whole)
    binding = max(range(2), key=lambda r: peaks[r])
    assert f"peak per rank at world 4, input 8x16 (line 7); binding rank {binding}: {show_bytes(peaks[binding])}" in whole
    exp = await hover(client, uri, text, "memory.peak")
    assert f"current estimate: **{show_bytes(peaks[binding])}** per rank on pipeline rank {binding} of 2 at" in exp


@ASYNC
async def test_hover_on_the_step_line(client):
    text = "model planc.zoo:gpt_tiny\nunit blocks.*\nstep { accumulate 4, sync = last }\n"
    uri, diags = await open_doc(client, text)
    assert diags == []
    assert "4 microbatches per step, gradients reduced once, after the last microbatch" in \
        await hover(client, uri, text, "step")
    assert "gradient accumulation" in await hover(client, uri, text, "accumulate")
    assert "accepts `every`, `last`" in await hover(client, uri, text, "sync")


@ASYNC
async def test_hover_on_a_diagnostic_explains_its_code(client):
    text = "model planc.zoo:gpt_tiny\nunit blocks.* : GPTBlok\n"
    uri, diags = await open_doc(client, text)
    assert [d.code for d in diags] == ["P202"]
    h = await hover(client, uri, text, "GPTBlok")
    assert "**P202** (error): unknown class" in h and "`planc codes P202`" in h


# ===================================================================== completion


async def labels(client, uri, line: int, character: int) -> list[str]:
    got = await client.text_document_completion_async(T.CompletionParams(
        T.TextDocumentIdentifier(uri), T.Position(line, character)))
    items = got.items if isinstance(got, T.CompletionList) else got
    return [i.label for i in items]


@ASYNC
async def test_completion(client):
    lines = ["model planc.zoo:gpt_tiny", "unit blocks.", "unit blocks.0.", "unit blocks[", "unit blocks.* : ",
             "", "expect ", "unit [wte, l", "unit wte { ", "unit wte { precision param = "]
    uri, _ = await open_doc(client, "\n".join(lines) + "\n")
    at = {text: i for i, text in enumerate(lines)}

    async def at_end(text):
        return await labels(client, uri, at[text], utf16(text))

    assert (await at_end("unit blocks."))[:2] == ["0", "1"]
    assert {"attn", "mlp", "ln_1", "ln_2"} <= set(await at_end("unit blocks.0."))
    assert {"0", "1", "-1"} <= set(await at_end("unit blocks["))
    assert {"GPTBlock", "CausalSelfAttention", "Linear"} <= set(await at_end("unit blocks.* : "))
    assert set(OPTIONS) <= set(await at_end("unit wte { "))
    assert {"bf16", "fp32", "fp16"} <= set(await at_end("unit wte { precision param = "))
    assert {"unit", "defaults", "mesh", "expect"} <= set(await at_end(""))
    assert {"memory.peak", "units", "unit"} <= set(await at_end("expect "))
    assert {"wte", "ln_f", "lm_head", "blocks"} <= set(await at_end("unit [wte, l"))
    assert {"planc.zoo:gpt_tiny", "hf:llama-tiny"} <= set(await labels(client, uri, 0, len("model ")))


# ===================================================================== formatting


@ASYNC
async def test_formatting(client):
    text = "model planc.zoo:gpt_tiny\nunit   blocks.*   {reshard after_forward=false}\n\n\n\nroot none\n"
    uri, _ = await open_doc(client, text)
    opts = T.FormattingOptions(tab_size=2, insert_spaces=True)
    [edit] = await client.text_document_formatting_async(T.DocumentFormattingParams(T.TextDocumentIdentifier(uri), opts))
    assert edit.new_text == format_plan(text) and edit.range.start == T.Position(0, 0)
    assert edit.range.end == T.Position(text.count("\n"), 0)
    done, _ = await open_doc(client, format_plan(text))
    # an internal error (here: a document never opened, on no disk) is logged, answered empty
    logged = len(client.log_messages)
    assert await client.text_document_formatting_async(T.DocumentFormattingParams(
        T.TextDocumentIdentifier(new_uri(client, "never-opened.plan")), opts)) is None
    assert any(m.type == T.MessageType.Error and "internal error in on_formatting" in m.message
               for m in client.log_messages[logged:])
    broken, _ = await open_doc(client, "unit [a\n")
    assert await client.text_document_formatting_async(T.DocumentFormattingParams(
        T.TextDocumentIdentifier(broken), opts)) is None
    assert list(await client.text_document_formatting_async(T.DocumentFormattingParams(
        T.TextDocumentIdentifier(done), opts))) == []


# ===================================================================== robustness


SOUP = hs.lists(hs.sampled_from(KEYWORDS + PUNCT + WORDS), max_size=40).map(" ".join)
DOCS = hs.one_of(hs.text(max_size=200), SOUP, plans())


@ASYNC
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=DOCS, points=hs.lists(hs.tuples(hs.integers(0, 12), hs.integers(0, 60)), min_size=1, max_size=3))
async def test_fuzz_corpus_replayed_through_the_server(client, text, points):
    """Any document, any position: the server answers, and keeps answering."""
    uri = new_uri(client, "fuzz.plan")
    logged = len(client.log_messages)
    client.text_document_did_open(T.DidOpenTextDocumentParams(T.TextDocumentItem(uri, "plan", 1, text)))
    for line, character in points:
        at = T.Position(line, character)
        await client.text_document_hover_async(T.HoverParams(T.TextDocumentIdentifier(uri), at))
        await client.text_document_completion_async(T.CompletionParams(T.TextDocumentIdentifier(uri), at))
    client.text_document_did_change(T.DidChangeTextDocumentParams(
        T.VersionedTextDocumentIdentifier(uri=uri, version=2), [T.TextDocumentContentChangeWholeDocument(text=text[::-1])]))
    await client.text_document_formatting_async(T.DocumentFormattingParams(
        T.TextDocumentIdentifier(uri), T.FormattingOptions(tab_size=2, insert_spaces=True)))
    client.text_document_did_close(T.DidCloseTextDocumentParams(T.TextDocumentIdentifier(uri)))
    errors = [m.message for m in client.log_messages[logged:] if m.type == T.MessageType.Error]
    assert not errors, errors[0]


@ASYNC
async def test_server_still_answers_after_the_replay(client):
    uri, diags = await open_doc(client, GPT)
    assert diags == [] and "matches **2** modules" in await hover(client, uri, GPT, "blocks.*", 2)
    # no internal error in the whole session but the one test_formatting provokes on purpose
    errors = [m.message for m in client.log_messages if m.type == T.MessageType.Error]
    assert [e for e in errors if "never-opened.plan" not in e] == []


def test_without_the_extra_planc_lsp_says_how_to_install_it(tmp_path):
    blocked = tmp_path / "pygls"
    blocked.mkdir()
    (blocked / "__init__.py").write_text("raise ImportError('pygls is not installed here')\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run(SERVER, capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == 'planc: error: `planc lsp` needs the lsp extra (pygls 2): pip install "planc[lsp]"\n'
