"""The pygls wiring of `planc lsp`: documents in, diagnostics, hover, completion, definition and formatting out.

LSP types live only here; the answers come from `analysis`, `hover`, `completion` and
`positions`, which know nothing of the protocol. Every handler is wrapped by `safe`: an
internal error is logged to the client (window/logMessage) and answered with an empty
result, so no input can stop the server.

Initialization options (all optional): `debounce` (seconds to wait after a change before
compiling, default 0.3), `worldSize` (the world size checks and `expect`s default to).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import sys
import traceback
from typing import Any

from lsprotocol import types as T
from pygls.lsp.server import LanguageServer
from pygls.uris import from_fs_path, to_fs_path

from planc import __version__
from planc.diagnostics import Span
from planc.lsp import completion, positions
from planc.lsp.analysis import Analysis, analyze
from planc.lsp.hover import hover
from planc.lsp.positions import contains, span_to_range
from planc.model.cache import ModelCache

log = logging.getLogger("planc.lsp")

SEVERITY = {"error": T.DiagnosticSeverity.Error, "warning": T.DiagnosticSeverity.Warning,
            "note": T.DiagnosticSeverity.Information}
KIND = {"module": T.CompletionItemKind.Module, "index": T.CompletionItemKind.Value,
        "class": T.CompletionItemKind.Class, "option": T.CompletionItemKind.Property,
        "key": T.CompletionItemKind.Field, "value": T.CompletionItemKind.EnumMember,
        "keyword": T.CompletionItemKind.Keyword, "metric": T.CompletionItemKind.Variable}
UNNECESSARY = {"P207"}  # "rule has no effect": editors grey the line out
TRIGGERS = [".", ":", "[", "|", "{"]


class PlanServer(LanguageServer):
    """A language server for .plan files, one `ModelCache` for its whole life."""

    def __init__(self):
        super().__init__("planc", __version__)
        self.cache = ModelCache()
        # Compiling (and building a model, the first time) runs off the event loop, one plan at
        # a time, so the server keeps reading messages meanwhile and no two compiles overlap.
        self.compiler = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="planc-compile")
        self.analyses: dict[str, Analysis] = {}
        self.pending: dict[str, asyncio.Task] = {}
        self.debounce = 0.3
        self.world_size: int | None = None

    # ----------------------------------------------------------------- documents
    @property
    def encoding(self) -> str:
        enc = self.workspace.position_encoding
        return str(getattr(enc, "value", enc) or positions.UTF16)

    def filename(self, uri: str) -> str:
        path = to_fs_path(uri) if uri.startswith("file:") else None
        return path or "<untitled>"

    async def analysis(self, uri: str) -> Analysis:
        """The analysis of the document's text as it is now (compiled if the text changed)."""
        text = self.workspace.get_text_document(uri).source
        found = self.analyses.get(uri)
        if found is None or found.text != text:
            found = await asyncio.get_running_loop().run_in_executor(
                self.compiler, analyze, text, self.filename(uri), self.cache, self.world_size)
            self.analyses[uri] = found
        return found

    async def publish(self, uri: str) -> None:
        version = self.workspace.get_text_document(uri).version  # the version these diagnostics are for
        try:
            diags = to_lsp_diagnostics(await self.analysis(uri), self.encoding, uri)
        except Exception:  # never silent and never fatal: the client hears about it
            self.log_exception("diagnostics")
            diags = []
        self.text_document_publish_diagnostics(T.PublishDiagnosticsParams(uri=uri, diagnostics=diags,
                                                                          version=version))

    def schedule(self, uri: str) -> None:
        """Publish after `debounce` seconds of quiet (each change restarts the wait)."""
        if (task := self.pending.pop(uri, None)) is not None:
            task.cancel()

        async def later():
            await asyncio.sleep(self.debounce)
            self.pending.pop(uri, None)
            await self.publish(uri)

        self.pending[uri] = asyncio.get_running_loop().create_task(later())

    def log_exception(self, where: str) -> None:
        text = f"planc lsp: internal error in {where}:\n{traceback.format_exc()}"
        log.error(text)
        try:
            self.window_log_message(T.LogMessageParams(type=T.MessageType.Error, message=text))
        except Exception:
            pass


def safe(default: Any = None):
    """Wrap a handler: an exception is logged to the client and `default` is answered."""
    def wrap(f):
        if asyncio.iscoroutinefunction(f):
            @functools.wraps(f)
            async def run_async(ls, params):
                try:
                    return await f(ls, params)
                except Exception:
                    ls.log_exception(f.__name__)
                    return default
            return run_async

        @functools.wraps(f)
        def run(ls, params):
            try:
                return f(ls, params)
            except Exception:
                ls.log_exception(f.__name__)
                return default
        return run
    return wrap


# ===================================================================== conversions


def _range(lines: list[str], span: Span | None, encoding: str) -> T.Range:
    if span is None:
        return T.Range(T.Position(0, 0), T.Position(0, 0))
    (l0, c0), (l1, c1) = span_to_range(lines, span, encoding)
    return T.Range(T.Position(l0, c0), T.Position(l1, c1))


def _location(a: Analysis, span: Span, encoding: str, uri: str) -> T.Location:
    if span.file == a.filename:  # the document itself (`uri`: also for an untitled one)
        return T.Location(uri=uri, range=_range(a.lines, span, encoding))
    source = dict(a.plan.sources).get(span.file, "") if a.plan else ""
    return T.Location(uri=from_fs_path(os.path.abspath(span.file)),
                      range=_range(source.split("\n"), span, encoding))


def _include_span(a: Analysis, file: str) -> Span | None:
    """Where the top file includes `file` (or the include that leads to it)."""
    from planc.lang import syntax as st
    from planc.lang.parse import parse_text
    includes = [s for s in parse_text(a.text, a.filename)[0] if isinstance(s, st.IncludeStmt)]
    for s in includes:
        if os.path.normpath(os.path.join(os.path.dirname(a.filename), s.path)) == os.path.normpath(file):
            return s.span
    return includes[0].span if includes else None


def to_lsp_diagnostics(a: Analysis, encoding: str, uri: str) -> list[T.Diagnostic]:
    """planc diagnostics as LSP ones. `code` is the planc code, `data.explain` the command that
    explains it; help and notes follow the message; a problem inside an included file is
    shown on the `include` line, with the exact place as related information."""
    out = []
    for d in a.diagnostics:
        text = d.message + "".join(f"\nhelp: {h}" for h in d.help) + "".join(f"\nnote: {n}" for n in d.notes)
        related = [T.DiagnosticRelatedInformation(_location(a, s, encoding, uri), label or "here") for s, label in d.related]
        span = d.span
        if span is not None and span.file != a.filename:
            related.insert(0, T.DiagnosticRelatedInformation(_location(a, span, encoding, uri), d.label or d.message))
            text = f"in `{span}`: {text}"
            span = _include_span(a, span.file)
        out.append(T.Diagnostic(
            range=_range(a.lines, span, encoding), message=text, severity=SEVERITY[d.severity], code=d.code,
            source="planc", related_information=related or None,
            tags=[T.DiagnosticTag.Unnecessary] if d.code in UNNECESSARY else None,
            data={"explain": f"planc codes {d.code}"}))
    return out


# ===================================================================== the server


def build_server() -> PlanServer:
    server = PlanServer()

    @server.feature(T.INITIALIZE)
    @safe()
    def initialize(ls: PlanServer, params: T.InitializeParams):
        opts = params.initialization_options if isinstance(params.initialization_options, dict) else {}
        if isinstance(opts.get("debounce"), (int, float)) and opts["debounce"] >= 0:
            ls.debounce = float(opts["debounce"])
        if isinstance(opts.get("worldSize"), int) and opts["worldSize"] >= 1:
            ls.world_size = opts["worldSize"]

    @server.feature(T.TEXT_DOCUMENT_DID_OPEN)
    @safe()
    async def did_open(ls: PlanServer, params: T.DidOpenTextDocumentParams):
        await ls.publish(params.text_document.uri)

    @server.feature(T.TEXT_DOCUMENT_DID_CHANGE)
    @safe()
    def did_change(ls: PlanServer, params: T.DidChangeTextDocumentParams):
        ls.schedule(params.text_document.uri)

    @server.feature(T.TEXT_DOCUMENT_DID_SAVE)
    @safe()
    async def did_save(ls: PlanServer, params: T.DidSaveTextDocumentParams):
        await ls.publish(params.text_document.uri)

    @server.feature(T.TEXT_DOCUMENT_DID_CLOSE)
    @safe()
    def did_close(ls: PlanServer, params: T.DidCloseTextDocumentParams):
        uri = params.text_document.uri
        ls.analyses.pop(uri, None)
        if (task := ls.pending.pop(uri, None)) is not None:
            task.cancel()
        ls.text_document_publish_diagnostics(T.PublishDiagnosticsParams(uri=uri, diagnostics=[]))

    @server.feature(T.TEXT_DOCUMENT_HOVER)
    @safe()
    async def on_hover(ls: PlanServer, params: T.HoverParams):
        a = await ls.analysis(params.text_document.uri)
        line, col = positions.from_lsp(a.lines, params.position.line, params.position.character, ls.encoding)
        found = hover(a, line, col)
        if found is None:
            return None
        text, span = found
        return T.Hover(contents=T.MarkupContent(kind=T.MarkupKind.Markdown, value=text),
                       range=_range(a.lines, span, ls.encoding) if span and span.file == a.filename else None)

    @server.feature(T.TEXT_DOCUMENT_COMPLETION, T.CompletionOptions(trigger_characters=TRIGGERS))
    @safe(default=[])
    async def on_completion(ls: PlanServer, params: T.CompletionParams):
        uri = params.text_document.uri
        # the model of the last analysis: completing must not recompile a plan per keystroke
        a = ls.analyses.get(uri) or await ls.analysis(uri)
        lines = ls.workspace.get_text_document(uri).source.split("\n")
        line, col = positions.from_lsp(lines, params.position.line, params.position.character, ls.encoding)
        return T.CompletionList(is_incomplete=False, items=[
            T.CompletionItem(label=i.label, kind=KIND[i.kind], detail=i.detail or None, insert_text=i.insert)
            for i in completion.complete(lines, line, col, a.graph)])

    @server.feature(T.TEXT_DOCUMENT_DEFINITION)
    @safe()
    async def on_definition(ls: PlanServer, params: T.DefinitionParams):
        from planc.lang import syntax as st
        from planc.lang.parse import parse_text
        a = await ls.analysis(params.text_document.uri)
        line, col = positions.from_lsp(a.lines, params.position.line, params.position.character, ls.encoding)
        for s in parse_text(a.text, a.filename)[0]:
            if isinstance(s, st.IncludeStmt) and contains(s.span, line, col):
                target = os.path.abspath(os.path.join(a.folder, s.path))
                if os.path.isfile(target):
                    return T.Location(uri=from_fs_path(target), range=T.Range(T.Position(0, 0), T.Position(0, 0)))
        return None

    @server.feature(T.TEXT_DOCUMENT_FORMATTING)
    @safe()
    def on_formatting(ls: PlanServer, params: T.DocumentFormattingParams):
        from planc.diagnostics import PlanError
        from planc.lang.fmt import FormatError, format_plan
        uri = params.text_document.uri
        text = ls.workspace.get_text_document(uri).source
        try:
            new = format_plan(text, ls.filename(uri))
        except (PlanError, FormatError) as err:  # a plan with syntax errors is left as it is
            ls.window_log_message(T.LogMessageParams(type=T.MessageType.Info,
                                                     message=f"planc fmt: not formatted: {str(err).splitlines()[0]}"))
            return None
        if new == text:
            return []
        lines = text.split("\n")
        end = positions.to_lsp(lines, len(lines), len(lines[-1]) + 1, ls.encoding)
        return [T.TextEdit(range=T.Range(T.Position(0, 0), T.Position(*end)), new_text=new)]

    return server


def serve() -> int:
    """Serve over stdio. The protocol keeps the real stdout; anything else printed (a model
    builder's `print`, a C library) goes to stderr, so it cannot corrupt the stream."""
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="planc lsp: %(message)s")
    protocol_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    build_server().start_io(sys.stdin.buffer, protocol_out)
    return 0
