"""Parse .plan text into the syntax tree, splice includes, and report syntax errors.

Lark's exceptions never leave this module: each becomes a P001 diagnostic naming what was
expected in the user's terms (`'{'`, not `LBRACE`). After a syntax error the offending line
is blanked and parsing resumes, so one run reports every broken line, not only the first.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import os
from importlib import resources
from pathlib import Path as FsPath

import lark
from lark import Lark, Transformer, v_args

from planc.diagnostics import Diagnostic, PlanError, Span
from planc.lang import syntax as st

MAX_PLAN_BYTES = 1 << 20
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


# ===================================================================== tree -> syntax nodes

# Friendly names for terminals in "expected ..." messages.
_TERMINAL_NAMES = {
    "NAME": "a name", "PATTERN": "a module path", "INT": "an integer", "FLOAT": "a number",
    "QUANTITY": "a size such as `100M` or `8GiB`", "STRING": "a quoted string",
    "MODEL_REF": "a model reference such as `package.module:builder`", "REGEX": 'a regex `re"..."`',
    "CMP": "a comparison (`==`, `<=`, ...)", "_NL": "end of line", "$END": "end of file",
    "STAR": "`*`", "SHAPE": "an input shape such as `2x512` (batch x sequence)",
}


class _ToSyntax(Transformer):
    """Turns lark's parse tree into `planc.lang.syntax` nodes, one method per grammar rule."""

    def __init__(self, file: str):
        super().__init__()
        self.file = file

    def _span(self, meta) -> Span:
        if getattr(meta, "empty", True):
            return Span.point(self.file)
        return Span(self.file, meta.line, meta.column, meta.end_line, meta.end_column)

    def _tok(self, tok: lark.Token) -> Span:
        return Span(self.file, tok.line, tok.column, tok.end_line, tok.end_column)

    # --- file
    def start(self, items):
        return tuple(i for i in items if i is not None)

    # --- statements
    @v_args(meta=True)
    def model_stmt(self, meta, items):
        (tok,) = items
        ref = tok[1:-1] if tok.type == "STRING" else str(tok)
        return st.ModelStmt(span=self._span(meta), ref=ref)

    @v_args(meta=True)
    def include_stmt(self, meta, items):
        return st.IncludeStmt(span=self._span(meta), path=_unquote(items[0]))

    @v_args(meta=True)
    def mesh_stmt(self, meta, items):
        strategy, *dims = items
        return st.MeshStmt(span=self._span(meta), dims=tuple(dims),
                           strategy=str(strategy) if strategy else None,
                           strategy_span=self._tok(strategy) if strategy else None)

    @v_args(meta=True)
    def mesh_strategy(self, meta, items):
        (tok,) = items
        return st.MeshStmt(span=self._span(meta), dims=(), strategy=str(tok), strategy_span=self._tok(tok))

    @v_args(meta=True)
    def mesh_dim(self, meta, items):
        name, size = items
        return st.MeshDim(span=self._span(meta), name=str(name),
                          size=None if size.type == "STAR" else int(size))

    @v_args(meta=True)
    def defaults_stmt(self, meta, items):
        return st.DefaultsStmt(span=self._span(meta), block=items[0])

    @v_args(meta=True)
    def unit_stmt(self, meta, items):
        optional, target, block = items
        return st.UnitStmt(span=self._span(meta), target=target, block=block, optional=optional is not None)

    @v_args(meta=True)
    def root_stmt(self, meta, items):
        return st.RootStmt(span=self._span(meta), block=items[0])

    @v_args(meta=True)
    def root_none(self, meta, items):
        return st.RootStmt(span=self._span(meta), block=None, disabled=True)

    @v_args(meta=True)
    def checkpoint_stmt(self, meta, items):
        optional, selector, mode = items
        return st.CheckpointStmt(span=self._span(meta), selector=selector, optional=optional is not None,
                                 mode=st.Name(span=self._tok(mode), value=str(mode)) if mode else None)

    @v_args(meta=True)
    def compile_stmt(self, meta, items):
        optional, selector = items
        return st.CompileStmt(span=self._span(meta), selector=selector, optional=optional is not None)

    @v_args(meta=True)
    def ignore_stmt(self, meta, items):
        optional, selector = items
        return st.IgnoreStmt(span=self._span(meta), selector=selector, optional=optional is not None)

    @v_args(meta=True)
    def place_stmt(self, meta, items):
        optional, selector, call = items
        return st.PlaceStmt(span=self._span(meta), selector=selector, placement=call,
                            optional=optional is not None)

    @v_args(meta=True)
    def expect_unit(self, meta, items):
        negated, target = items
        return st.ExpectUnit(span=self._span(meta), target=target, negated=negated is not None)

    @v_args(meta=True)
    def expect_metric(self, meta, items):
        (metric, metric_span), op, value, at = items
        where = dict(at or ())
        world = where.get("world")
        shape, shape_span = where.get("input", (None, None))
        return st.ExpectMetric(span=self._span(meta), metric=metric, metric_span=metric_span, op=str(op),
                               value=value, world=world, input_shape=shape, input_span=shape_span)

    def expect_at(self, items):
        return tuple(i for i in items if i is not None)

    def expect_world(self, items):
        return "world", int(items[0])

    def expect_input(self, items):
        (tok,) = items
        return "input", (tuple(int(n) for n in str(tok).lower().split("x")), self._tok(tok))

    @v_args(meta=True)
    def dotted(self, meta, items):
        return ".".join(str(i) for i in items), self._span(meta)

    # --- blocks and options
    @v_args(meta=True)
    def block(self, meta, items):
        return st.Block(span=self._span(meta), options=tuple(items))

    @v_args(meta=True)
    def option(self, meta, items):
        name, *args = items
        return st.Option(span=self._span(meta), name=str(name), name_span=self._tok(name),
                         args=tuple(a for a in args if a is not None))

    @v_args(meta=True)
    def kwarg(self, meta, items):
        key, value = items
        return st.Arg(span=self._span(meta), key=str(key), key_span=self._tok(key), value=value)

    @v_args(meta=True)
    def posarg(self, meta, items):
        return st.Arg(span=self._span(meta), key=None, key_span=None, value=items[0])

    @v_args(meta=True)
    def name(self, meta, items):
        return st.Name(span=self._span(meta), value=str(items[0]))

    @v_args(meta=True)
    def string(self, meta, items):
        return st.String(span=self._span(meta), value=_unquote(items[0]))

    @v_args(meta=True)
    def star(self, meta, items):
        return st.Star(span=self._span(meta))

    @v_args(meta=True)
    def int(self, meta, items):
        return st.Number(span=self._span(meta), value=int(items[0]), text=str(items[0]))

    @v_args(meta=True)
    def float(self, meta, items):
        return st.Number(span=self._span(meta), value=float(items[0]), text=str(items[0]))

    @v_args(meta=True)
    def quantity(self, meta, items):
        value, is_bytes = parse_quantity(str(items[0]))
        return st.Number(span=self._span(meta), value=value, text=str(items[0]), is_bytes=is_bytes)

    @v_args(meta=True)
    def call(self, meta, items):
        name, *args = items
        return st.Call(span=self._span(meta), name=str(name), args=tuple(a for a in args if a is not None))

    @v_args(meta=True)
    def selector_list(self, meta, items):
        return st.SelectorList(span=self._span(meta), items=tuple(items))

    # --- selectors
    @v_args(meta=True)
    def group(self, meta, items):
        return st.Group(span=self._span(meta), selectors=tuple(items))

    @v_args(meta=True)
    def selector(self, meta, items):
        base, guard, where, *exclusions = items
        return st.Selector(span=self._span(meta), base=self._base(base), guard=guard, where=where,
                           exclusions=tuple(exclusions))

    @v_args(meta=True)
    def exclusion(self, meta, items):
        base, guard = items
        return st.Exclusion(span=self._span(meta), base=self._base(base), guard=guard)

    def _base(self, base):
        if isinstance(base, lark.Token):  # REGEX
            return st.Regex(span=self._tok(base), pattern=base[3:-1].replace('\\"', '"'))
        return base

    @v_args(meta=True)
    def path(self, meta, items):
        return st.Path(span=self._span(meta), segments=tuple(items))

    @v_args(meta=True)
    def seg_pattern(self, meta, items):
        return st.Segment(span=self._span(meta), pattern=str(items[0]))

    @v_args(meta=True)
    def seg_index(self, meta, items):
        word, (is_slice, a, b) = items
        if is_slice:
            return st.Segment(span=self._span(meta), pattern=str(word), is_slice=True, start=a, stop=b)
        return st.Segment(span=self._span(meta), pattern=str(word), index=a)

    @v_args(meta=True)
    def seg_alt(self, meta, items):
        return st.Segment(span=self._span(meta), alternatives=tuple(str(i) for i in items))

    def slice_index(self, items):
        return (False, int(items[0]), None)

    def slice_range(self, items):
        a, b = items
        return (True, None if a is None else int(a), None if b is None else int(b))

    @v_args(meta=True)
    def guard(self, meta, items):
        return st.Guard(span=self._span(meta), classes=tuple(str(i) for i in items))

    @v_args(meta=True)
    def where(self, meta, items):
        field, op, value = items
        return st.Where(span=self._span(meta), field=str(field), op=str(op), value=value)


def _unquote(tok) -> str:
    body = str(tok)[1:-1]
    return body.replace('\\"', '"').replace("\\\\", "\\")


_UNITS = {"K": (1e3, False), "M": (1e6, False), "B": (1e9, False), "T": (1e12, False),
          "KB": (1e3, True), "MB": (1e6, True), "GB": (1e9, True), "TB": (1e12, True),
          "KiB": (2**10, True), "MiB": (2**20, True), "GiB": (2**30, True), "TiB": (2**40, True)}


def parse_quantity(text: str) -> tuple[float, bool]:
    """`100M` -> (1e8, False) (a count); `70GiB` -> (70 * 2**30, True) (bytes)."""
    i = len(text.rstrip("KMGTBi"))
    scale, is_bytes = _UNITS[text[i:]]
    return float(text[:i]) * scale, is_bytes


# ===================================================================== syntax errors


def _describe_expected(expected) -> str:
    names = []
    p = parser()
    for term in sorted(expected):
        if term in _TERMINAL_NAMES:
            names.append(_TERMINAL_NAMES[term])
            continue
        try:
            pattern = p.get_terminal(term).pattern
        except KeyError:
            names.append(term.lower())
            continue
        if isinstance(pattern, lark.lexer.PatternStr):
            names.append(f"`{pattern.value}`")
        else:
            names.append(term.lower())
    names = sorted(set(names))
    if len(names) > 8:
        names = names[:8] + ["..."]
    return ", ".join(names)


def _syntax_diagnostic(err: lark.exceptions.UnexpectedInput, file: str, text: str, work: str) -> Diagnostic:
    """One P001 for a lark error; `text` is the file as written, `work` what was parsed."""
    if isinstance(err, lark.exceptions.UnexpectedToken) and err.token.type == "$END":
        # lines as lark counts them: only "\n" ends one (not \u2028, \f, ... as splitlines has it)
        lines = (text[:-1] if text.endswith("\n") else text).split("\n")
        line, col = len(lines), len(lines[-1]) + 1
        span = Span(file, line, col, line, col + 1)
        return Diagnostic(code="P001", severity="error", message="unexpected end of file",
                          span=span, label="the plan ends here",
                          help=(f"expected {_describe_expected(err.expected)}",))
    line, col = err.line, err.column
    if isinstance(err, lark.exceptions.UnexpectedToken):
        tok = err.token
        shown = "end of line" if tok.type == "_NL" else f"`{tok}`"
        end_col = col + 1 if tok.type == "_NL" else (tok.end_column or col + len(str(tok)))
        span = Span(file, line, col, line if tok.type == "_NL" else (tok.end_line or line), end_col)
        expected = err.expected
        message = f"unexpected {shown}"
    else:  # UnexpectedCharacters
        char = work[err.pos_in_stream] if err.pos_in_stream < len(work) else "?"
        span = Span(file, line, col, line, col + 1)
        expected = err.allowed or set()
        message = f"unexpected character `{char}`" if char.isprintable() else \
            f"unexpected character {char!r}"
    help_ = (f"expected {_describe_expected(expected)}",) if expected else ()
    return Diagnostic(code="P001", severity="error", message=message, span=span, label="here", help=help_)


_CLOSERS = {"{": "}", "[": "]", "(": ")"}
# Words that start a statement and can never name a block option (`checkpoint` and `compile`
# are both, so they do not count).
_STATEMENT_WORDS = {"model", "include", "mesh", "defaults", "unit", "root", "ignore", "place", "expect",
                    "optional"}


def _open_brackets(text: str, line: int, column: int | None = None) -> list[tuple[str, int, int]]:
    """Brackets still open just before (`line`, `column`): (bracket, line, column), innermost last.

    Skips comments and quoted strings; a stray closer is ignored (the parser reports it).
    """
    stack: list[tuple[str, int, int]] = []
    for n, row in enumerate(text.split("\n")[:line], start=1):
        limit = len(row) if n < line or column is None else column - 1
        i = 0
        while i < limit:
            ch = row[i]
            if ch == "#":
                break
            if ch == '"':
                i += 1
                while i < len(row) and row[i] != '"':
                    i += 2 if row[i] == "\\" else 1
            elif ch in _CLOSERS:
                stack.append((ch, n, i + 1))
            elif stack and ch == _CLOSERS[stack[-1][0]]:
                stack.pop()
            i += 1
    return stack


def _blank_lines(text: str, first: int, last: int) -> str:
    """Replace lines `first`..`last` with spaces, keeping every offset of the other lines."""
    lines = text.split("\n")
    for n in range(max(first, 1), min(last, len(lines)) + 1):
        lines[n - 1] = " " * len(lines[n - 1])
    return "\n".join(lines)


def _close_block_before(text: str, line: int) -> str:
    """Insert `}` at the end of the last code line before `line` (offsets after it unchanged)."""
    lines = text.split("\n")
    for n in range(line - 1, 0, -1):
        code = lines[n - 1].split("#", 1)[0]
        if code.strip():
            lines[n - 1] = code.rstrip() + " }" + lines[n - 1][len(code.rstrip()):]
            return "\n".join(lines)
    return text


def _closing_line(text: str, opener: tuple[str, int, int]) -> int | None:
    """The line where the bracket opened at `opener` closes, or None if it never does."""
    bracket, line, column = opener
    depth = 0
    for n, row in enumerate(text.split("\n")[line - 1:], start=line):
        start = column - 1 if n == line else 0
        for ch in row[start:].split("#", 1)[0]:
            if ch == bracket:
                depth += 1
            elif ch == _CLOSERS[bracket]:
                depth -= 1
                if depth == 0:
                    return n
    return None


def _recover(err, d: Diagnostic, file: str, work: str) -> tuple[Diagnostic, str | None]:
    """Improve the diagnostic for unclosed brackets and say how to go on parsing.

    Returns the diagnostic and the text to parse next (None: give up). The common causes of
    a cascade get one diagnostic each: a statement continued on the next line (statements
    are one line; only `{}` blocks span lines), and a `{` block that is never closed.
    """
    tok = getattr(err, "token", None)
    line = d.span.line
    is_eol = tok is not None and tok.type == "_NL"
    opened = _open_brackets(work, line, None if is_eol or tok is None or tok.type == "$END" else d.span.column)
    blocks = [o for o in opened if o[0] == "{"]
    # `[`/`(` never legally span a line end (except after `\`), wherever they were opened
    inner = [o for o in opened if o[0] != "{"]
    if is_eol and inner:
        bracket, bline, bcol = inner[-1]
        closer = _CLOSERS[bracket]
        end = _closing_line(work, inner[-1])
        d = dataclasses.replace(
            d, message=f"unexpected end of line: `{bracket}` is not closed on this line",
            label=f"expected `{closer}` before the end of the line",
            related=((Span(file, bline, bcol, bline, bcol + 1), "opened here"),),
            help=("statements end at the end of a line (only `{}` blocks span lines): write it on "
                  "one line, or end the line with `\\` to continue it",))
        return d, _blank_lines(work, min(bline, line), end if end is not None else line)
    stmt = _statement_start(work, blocks[-1][1], line) if blocks and tok is not None else None
    if blocks and tok is not None and (stmt is not None or tok.type == "$END"):
        # NOTE: a statement keyword inside a block cannot be an option, so the first line
        # that starts with one is where the block should have ended, even when the parser
        # only fails later (`unit a` reads as an option `unit` with argument `a`).
        _, bline, bcol = blocks[-1]
        if stmt is not None:
            sline, scol, word = stmt
            span, where, label = Span(file, sline, scol, sline, scol + len(word)), f"`{word}`", \
                "a new statement starts here"
        else:
            span, where, label = d.span, "the end of the file", "the block would end here"
        d = dataclasses.replace(
            d, span=span, message=f"unclosed `{{`: the block on line {bline} has no `}}` before {where}",
            label=label, related=((Span(file, bline, bcol, bline, bcol + 1), "this `{` is never closed"),),
            help=(f"add `}}` to close the block that starts on line {bline}",))
        if stmt is None:
            return d, None
        return d, _close_block_before(work, stmt[0])
    if d.message == "unexpected end of file":
        return d, None
    return d, _blank_lines(work, line, line)


def _statement_start(text: str, after: int, upto: int) -> tuple[int, int, str] | None:
    """The first line in (after, upto] that starts with a statement-only keyword."""
    lines = text.split("\n")
    for n in range(after + 1, min(upto, len(lines)) + 1):
        row = lines[n - 1]
        word = row.lstrip().split("#", 1)[0].split(None, 1)
        if word and word[0] in _STATEMENT_WORDS:
            return n, len(row) - len(row.lstrip()) + 1, word[0]
    return None


def parse_text(text: str, file: str) -> tuple[tuple, tuple[st.Comment, ...], list[Diagnostic]]:
    """Parse one file's text (no includes). Returns statements, comments and diagnostics."""
    diags: list[Diagnostic] = []
    seen: set[str] = set()
    work = text
    while True:
        comments: list[lark.Token] = []
        token = _comments.set(comments)
        try:
            tree = parser().parse(work)
            statements = _ToSyntax(file).transform(tree)
            break
        except lark.exceptions.UnexpectedInput as err:
            d, work_next = _recover(err, _syntax_diagnostic(err, file, text, work), file, work)
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
    best, best_line, depth = 0, 1, 0
    for n, row in enumerate(text.split("\n"), start=1):
        for ch in row.split("#", 1)[0]:
            if ch in "([{":
                depth += 1
                if depth > best:
                    best, best_line = depth, n
            elif ch in ")]}":
                depth = max(0, depth - 1)
    return Diagnostic(code="P005", severity="error", message=f"plan nests brackets {best} deep",
                      span=Span.point(file, best_line), label="nesting starts here",
                      help=("flatten the nested brackets; no plan construct needs more than a few levels",))


# ===================================================================== files and includes


def _read(path: str, span: Span | None) -> tuple[str | None, Diagnostic | None]:
    def fail(message, help_=()):
        code = "P003" if span is not None else "P002"
        return None, Diagnostic(code=code, severity="error", message=message, span=span,
                                label="included here" if span else "", help=help_)
    try:
        size = os.path.getsize(path)
        if size > MAX_PLAN_BYTES:
            return fail(f"`{path}` is {size} bytes; plans are limited to {MAX_PLAN_BYTES} bytes",
                        ("split the plan into smaller files joined with `include`",))
        raw = FsPath(path).read_bytes()
    except FileNotFoundError:
        return fail(f"no such plan file `{path}`", ("check the path; includes are relative to the including plan",)
                    if span is not None else ("check the path",))
    except IsADirectoryError:
        return fail(f"`{path}` is a directory, not a plan file", ("name a `.plan` file",))
    except OSError as err:
        return fail(f"cannot read `{path}`: {err.strerror or err}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        return fail(f"`{path}` is not UTF-8 text (byte 0x{raw[err.start]:02x} at line {line}, column {column})",
                    ("save the plan as UTF-8",))
    if "\x00" in text:
        return fail(f"`{path}` is not a text file (it contains NUL bytes)", ("is this a plan file?",))
    return text, None


def _assemble(text: str, file: str, stack: tuple[str, ...], sources: dict[str, str],
              diags: list[Diagnostic]) -> tuple[tuple, tuple]:
    """Parse `text` and splice every include in place, depth first, detecting cycles."""
    sources[file] = text
    statements, comments, errs = parse_text(text, file)
    diags.extend(errs)
    out: list = []
    base_dir = os.path.dirname(file) if not file.startswith("<") else "."
    for stmt in statements:
        if not isinstance(stmt, st.IncludeStmt):
            out.append(stmt)
            continue
        target = os.path.normpath(os.path.join(base_dir, stmt.path))
        key = os.path.abspath(target)
        if key in stack:
            chain = " -> ".join([os.path.basename(s) for s in stack[stack.index(key):]] + [os.path.basename(key)])
            diags.append(Diagnostic(code="P004", severity="error", message=f"include cycle: {chain}",
                                    span=stmt.span, label="this include closes the cycle",
                                    help=("a base plan must not include the plans that include it",)))
            continue
        sub, err = _read(target, stmt.span)
        if err is not None:
            diags.append(err)
            continue
        inner, _ = _assemble(sub, target, stack + (key,), sources, diags)
        out.extend(inner)
    return tuple(out), comments


def loads_with_diagnostics(text: str, filename: str = "<string>") -> tuple[st.Plan | None, list[Diagnostic]]:
    """Parse plan text and its includes; never raises for bad input."""
    diags: list[Diagnostic] = []
    if len(text.encode("utf-8", "surrogatepass")) > MAX_PLAN_BYTES:
        diags.append(Diagnostic(code="P002", severity="error", span=Span.point(filename),
                                message=f"plan is larger than {MAX_PLAN_BYTES} bytes",
                                help=("split the plan into smaller files joined with `include`",)))
        return None, diags
    if "\x00" in text:
        diags.append(Diagnostic(code="P002", severity="error", span=Span.point(filename),
                                message="plan is not text (it contains NUL bytes)", help=("is this a plan file?",)))
        return None, diags
    sources: dict[str, str] = {}
    root = (os.path.abspath(filename),) if not filename.startswith("<") else ()
    statements, comments = _assemble(text, filename, root, sources, diags)
    plan = st.Plan(file=filename, statements=statements, sources=tuple(sources.items()),
                   comments=comments)
    return plan, diags


def load_with_diagnostics(path: str | os.PathLike) -> tuple[st.Plan | None, list[Diagnostic]]:
    """Read and parse a plan file; a missing or unreadable file is a P002 diagnostic."""
    path = os.fspath(path)
    text, err = _read(path, None)
    if err is not None:
        return None, [err]
    return loads_with_diagnostics(text, filename=path)


def _raise_on_errors(plan, diags) -> st.Plan:
    if plan is None or any(d.is_error for d in diags):
        sources = dict(plan.sources) if plan is not None else {}
        raise PlanError(diags, sources)
    return plan


def loads(text: str, *, filename: str = "<string>") -> st.Plan:
    """Parse plan text; raises `PlanError` with every syntax and include diagnostic."""
    return _raise_on_errors(*loads_with_diagnostics(text, filename))


def load(path: str | os.PathLike) -> st.Plan:
    """Read and parse a plan file; raises `PlanError` with every diagnostic."""
    return _raise_on_errors(*load_with_diagnostics(path))
