"""Parse one file's plan text into syntax nodes, reporting every syntax error (P001, P005).

The parser is lark's LALR over `grammar/plan.lark`. The three jobs around it have their own
modules: `transform` (parse tree -> `planc.lang.syntax` nodes), `errors` (lark's
exceptions -> P001 diagnostics in the user's terms), `recover` (what to parse next after
an error, so one run reports every broken line); `load` reads files and splices includes.
Lark's exceptions never leave this module.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
from importlib import resources

import lark
from lark import Lark

from planc.diagnostics import Diagnostic, Span
from planc.lang import syntax as st
from planc.lang.errors import syntax_diagnostic
from planc.lang.recover import deepest_nesting, recover
from planc.lang.transform import ToSyntax, parse_quantity  # noqa: F401  (parse_quantity: public)

MAX_SYNTAX_ERRORS = 10

_comments: contextvars.ContextVar[list] = contextvars.ContextVar("planc_comments")


def _collect_comment(token: lark.Token) -> None:
    sink = _comments.get(None)
    if sink is not None:
        sink.append(token)


@functools.lru_cache(maxsize=1)
def parser() -> Lark:
    """The plan parser, built once: LALR, contextual lexer, positions on every node."""
    text = resources.files("planc.grammar").joinpath("plan.lark").read_text(encoding="utf-8")
    return Lark(text, parser="lalr", lexer="contextual", propagate_positions=True,
                maybe_placeholders=True, lexer_callbacks={"COMMENT": _collect_comment})


@contextlib.contextmanager
def _no_gc():
    """Pause the cycle collector: the parse tree is millions of young objects and no cycles,
    and collecting them again and again doubled the time of a 100k-statement plan."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def parse_text(text: str, file: str) -> tuple[tuple, tuple[st.Comment, ...], list[Diagnostic]]:
    """Parse one file's text (no includes). Returns statements, comments and diagnostics."""
    text = text.removeprefix("\ufeff")
    diags: list[Diagnostic] = []
    seen: set[str] = set()
    work = text
    while True:
        comments: list[lark.Token] = []
        token = _comments.set(comments)
        try:
            with _no_gc():
                tree = parser().parse(work)
                transformer = ToSyntax(file)
                statements = transformer.transform(tree)
            diags.extend(transformer.diags)
            break
        except lark.exceptions.UnexpectedInput as err:
            d, work_next = recover(err, syntax_diagnostic(err, file, text, work, parser()), file, work)
            diags.append(d)
            # NOTE: each recovery blanks a line or closes a block, so text only repeats if
            # recovery made no progress; stop then rather than loop.
            if work_next is None or work_next in seen or work_next == work or len(diags) >= MAX_SYNTAX_ERRORS:
                return (), (), diags
            seen.add(work_next)
            work = work_next
        except RecursionError:
            diags.append(_too_deep(file, text))
            return (), (), diags
        except lark.exceptions.VisitError as err:  # an error inside a transformer method
            if isinstance(err.orig_exc, RecursionError):
                diags.append(_too_deep(file, text))
                return (), (), diags
            raise
        finally:
            _comments.reset(token)
    if diags:
        return (), (), diags
    spans = tuple(st.Comment(span=Span(file, c.line, c.column, c.end_line, c.end_column), text=str(c))
                  for c in comments)
    return statements, spans, diags


def _too_deep(file: str, text: str) -> Diagnostic:
    """P005, pointing at the line that nests deepest."""
    best, best_line = deepest_nesting(text)
    return Diagnostic(code="P005", severity="error", message=f"plan nests brackets {best} deep",
                      span=Span.point(file, best_line), label="nesting starts here",
                      help=("flatten the nested brackets; no plan construct needs more than a few levels",))


# Reading files and splicing includes live in `planc.lang.load`; these names stay importable
# from here (loaded lazily: `load` imports this module).
_LOAD_NAMES = ("MAX_PLAN_BYTES", "read_plan_file", "loads_with_diagnostics", "load_with_diagnostics",
               "loads", "load")


def __getattr__(name: str):
    if name in _LOAD_NAMES:
        from planc.lang import load as _load
        return getattr(_load, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
