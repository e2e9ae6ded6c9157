"""Turn lark's parse tree into `planc.lang.syntax` nodes, one method per grammar rule.

Numbers are checked here, where their tokens are: an integer beyond `MAX_INT` (or a rank
count beyond `MAX_RANKS`) is a located P103, never a Python conversion error or a search
over a trillion divisors later.
"""

from __future__ import annotations

import lark
from lark import Transformer, v_args

from planc.diagnostics import Diagnostic, Span
from planc.lang import syntax as st
from planc.limits import MAX_RANKS  # mesh dimension sizes and `at world =`: a million ranks

MAX_INT = 2**63 - 1  # a 64-bit integer: every size, index and count in a plan fits
_MAX_DIGITS = len(str(MAX_INT))


class ToSyntax(Transformer):
    """Turns lark's parse tree into `planc.lang.syntax` nodes, one method per grammar rule."""

    def __init__(self, file: str):
        super().__init__()
        self.file = file
        self.diags: list[Diagnostic] = []

    def _int(self, tok: lark.Token, limit: int = MAX_INT, what: str = "an integer") -> int:
        """The token's integer value; past `limit` a P103 (and 1, so the tree still builds)."""
        text = str(tok)
        digits = text.lstrip("-").lstrip("0")
        value = int(text) if len(digits) <= _MAX_DIGITS else None
        if value is not None and abs(value) <= limit:
            return value
        shown = text if len(text) <= 24 else f"{text[:12]}...({len(digits)} digits)"
        self.diags.append(Diagnostic(
            code="P103", severity="error", message=f"{what} `{shown}` is too large", span=self._tok(tok),
            label=f"more than {limit:,}", help=(f"write {what} of at most {limit:,}",)))
        return 1

    def _number(self, tok: lark.Token) -> None:
        """A float or quantity token with an integer part beyond `MAX_INT` is a P103 too."""
        whole = str(tok).lstrip("-").split(".", 1)[0].lstrip("0")
        whole = "".join(ch for ch in whole if ch.isdigit())
        if len(whole) > _MAX_DIGITS or (whole and int(whole) > MAX_INT):
            self.diags.append(Diagnostic(
                code="P103", severity="error", message="number is too large", span=self._tok(tok),
                label=f"more than {MAX_INT:,}", help=("write a number below 2**63 (sizes take units: `70GiB`)",)))

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
        return st.IncludeStmt(span=self._span(meta), path=unquote(items[0]))

    @v_args(meta=True)
    def mesh_stmt(self, meta, items):
        strategy, *axes = items
        return st.MeshStmt(span=self._span(meta), axes=tuple(axes),
                           strategy=str(strategy) if strategy else None,
                           strategy_span=self._tok(strategy) if strategy else None)

    @v_args(meta=True)
    def mesh_strategy(self, meta, items):
        (tok,) = items
        return st.MeshStmt(span=self._span(meta), axes=(), strategy=str(tok), strategy_span=self._tok(tok))

    @v_args(meta=True)
    def mesh_axis(self, meta, items):
        name, size = items
        return st.MeshAxis(span=self._span(meta), name=str(name),
                          size=None if size.type == "STAR" else
                          self._int(size, MAX_RANKS, "a mesh size"))

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
    def parallel_stmt(self, meta, items):
        optional, selector, style, block = items
        return st.ParallelStmt(span=self._span(meta), selector=selector, optional=optional is not None,
                               style=st.Name(span=self._tok(style), value=str(style)), block=block)

    @v_args(meta=True)
    def step_stmt(self, meta, items):
        return st.StepStmt(span=self._span(meta), block=items[0])

    @v_args(meta=True)
    def pipeline_stmt(self, meta, items):
        name, block = items
        return st.PipelineStmt(span=self._span(meta), schedule=st.Name(span=self._tok(name), value=str(name)),
                               block=block)

    @v_args(meta=True)
    def stage_stmt(self, meta, items):
        index, *selectors = items
        return st.StageStmt(span=self._span(meta), index=self._int(index), index_span=self._tok(index),
                            selectors=tuple(selectors))

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
        return "world", self._int(items[0], MAX_RANKS, "a world size")

    def expect_input(self, items):
        (tok,) = items
        sizes = str(tok).lower().split("x")
        if any(len(n.lstrip("0")) > _MAX_DIGITS or int(n) > MAX_INT for n in sizes):
            self._int(lark.Token("SHAPE", max(sizes, key=len), line=tok.line, column=tok.column,
                                 end_line=tok.end_line, end_column=tok.end_column), what="an input size")
            sizes = ["1"] * len(sizes)
        return "input", (tuple(int(n) for n in sizes), self._tok(tok))

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
        return st.String(span=self._span(meta), value=unquote(items[0]))

    @v_args(meta=True)
    def star(self, meta, items):
        return st.Star(span=self._span(meta))

    @v_args(meta=True)
    def int(self, meta, items):
        return st.Number(span=self._span(meta), value=self._int(items[0]), text=str(items[0]))

    @v_args(meta=True)
    def float(self, meta, items):
        self._number(items[0])
        return st.Number(span=self._span(meta), value=float(items[0]), text=str(items[0]))

    @v_args(meta=True)
    def quantity(self, meta, items):
        self._number(items[0])
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
        return (False, self._int(items[0], what="an index"), None)

    def slice_range(self, items):
        a, b = items
        return (True, None if a is None else self._int(a, what="an index"),
                None if b is None else self._int(b, what="an index"))

    @v_args(meta=True)
    def guard(self, meta, items):
        return st.Guard(span=self._span(meta), classes=tuple(str(i) for i in items))

    @v_args(meta=True)
    def where(self, meta, items):
        field, op, value = items
        return st.Where(span=self._span(meta), field=str(field), op=str(op), value=value)


def unquote(tok) -> str:
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
