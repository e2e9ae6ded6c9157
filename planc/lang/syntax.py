"""The syntax tree: what a .plan file says, as frozen dataclasses with source spans.

This is what was written, not what it means: selectors are not matched, option names are
not checked. `planc/resolve/resolver.py` turns it into the IR (`planc/resolve/ir.py`);
`planc/lang/printer.py` prints it. Nodes hold tuples, never lists, and no parent pointers;
every node carries the `Span` it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from planc.diagnostics import Span
from planc.lang import printer

_node = dataclass(frozen=True, slots=True, kw_only=True)


def _text(node) -> str:
    """A node's canonical plan text (`planc.lang.printer`)."""
    return printer.text(node)


# ===================================================================== selectors


@_node
class Segment:
    """One dotted part of a path selector.

    `pattern` is a name, a number, a glob with `*`, `*` (one segment of any name) or `**`
    (any number of segments). `alternatives` holds `{a,b}`; `index`/`start`/`stop` an
    index or a Python slice over the children of the module the segment names.
    """

    span: Span
    pattern: str = ""
    alternatives: tuple[str, ...] = ()
    index: int | None = None
    start: int | None = None
    stop: int | None = None
    is_slice: bool = False

    @property
    def is_deep(self) -> bool:
        return self.pattern == "**"

    __str__ = _text


@_node
class Path:
    """A dotted path pattern such as `transformer_layers[-2:]` or `**.mlp`."""

    span: Span
    segments: tuple[Segment, ...]

    __str__ = _text


@_node
class Regex:
    """An explicit regular expression, `re"..."`, matched against the whole dotted path."""

    span: Span
    pattern: str

    __str__ = _text


@_node
class Guard:
    """`: ClassA | ClassB`: limit matches to modules of these classes."""

    span: Span
    classes: tuple[str, ...]

    __str__ = _text


@_node
class Where:
    """`where size >= 100M`: a predicate on the module (FSDP1's size-based wrapping)."""

    span: Span
    field: str
    op: str
    value: "Number"

    __str__ = _text


@_node
class Exclusion:
    """`except PATH [: Class]`: drop these matches."""

    span: Span
    base: Union[Path, Regex]
    guard: Guard | None = None

    __str__ = _text


@_node
class Selector:
    """A module (or parameter) selector with its guard, predicate and exclusions."""

    span: Span
    base: Union[Path, Regex]
    guard: Guard | None = None
    where: Where | None = None
    exclusions: tuple[Exclusion, ...] = ()

    __str__ = _text


@_node
class Group:
    """`[a, b]`: every module matched by any of the selectors becomes one unit."""

    span: Span
    selectors: tuple[Selector, ...]

    __str__ = _text


# ===================================================================== values and options


@_node
class Name:
    span: Span
    value: str

    __str__ = _text


@_node
class Number:
    """An int, a float, or a quantity with a unit (`100M`, `70GiB`); `value` is in units."""

    span: Span
    value: float
    text: str
    is_bytes: bool = False

    __str__ = _text


@_node
class String:
    span: Span
    value: str

    __str__ = _text


@_node
class Star:
    span: Span

    __str__ = _text


@_node
class Call:
    """`Shard(1)`: a name applied to arguments."""

    span: Span
    name: str
    args: tuple["Value", ...]

    __str__ = _text


@_node
class SelectorList:
    """`[a.b, c[1:3]]`: module selectors as an option value (explicit prefetch targets)."""

    span: Span
    items: tuple[Selector, ...]

    __str__ = _text


Value = Union[Name, Number, String, Star, Call, SelectorList]


@_node
class Arg:
    """One option argument, positional (`key` is None) or `key = value`."""

    span: Span
    key: str | None
    key_span: Span | None
    value: Value

    __str__ = _text


@_node
class Option:
    """`precision param = bf16, reduce = fp32` inside a block."""

    span: Span
    name: str
    name_span: Span
    args: tuple[Arg, ...]

    __str__ = _text


@_node
class Block:
    span: Span
    options: tuple[Option, ...]


# ===================================================================== statements


@_node
class ModelStmt:
    """`model package.module:callable` or `model "hf:configs/llama.json"`."""

    span: Span
    ref: str


@_node
class IncludeStmt:
    span: Span
    path: str


@_node
class MeshAxis:
    span: Span
    name: str
    size: int | None  # None for `*`: filled from the world size


@_node
class MeshStmt:
    """`mesh (replicate = 2, shard = *)`; `strategy` holds an FSDP1 word if one was used."""

    span: Span
    axes: tuple[MeshAxis, ...]
    strategy: str | None = None
    strategy_span: Span | None = None


@_node
class DefaultsStmt:
    span: Span
    block: Block


@_node
class UnitStmt:
    span: Span
    target: Union[Selector, Group]
    block: Block | None
    optional: bool = False


@_node
class RootStmt:
    """`root { ... }` sets the root unit's options; `root none` makes the root no unit."""

    span: Span
    block: Block | None
    disabled: bool = False


@_node
class CheckpointStmt:
    span: Span
    selector: Selector
    mode: Name | None
    optional: bool = False


@_node
class ParallelStmt:
    """`parallel <selector> <style> [{ layouts }]`: a tensor-parallel style on each matched module."""

    span: Span
    selector: Selector
    style: Name
    block: Block | None
    optional: bool = False


@_node
class StepStmt:
    """`step { accumulate 4, sync = last }`: what one optimizer step runs (planc/resolve/step.py)."""

    span: Span
    block: Block


@_node
class PipelineStmt:
    """`pipeline 1F1B { microbatches 8 }`: the pipeline schedule and its options (planc/resolve/pipeline.py)."""

    span: Span
    schedule: Name
    block: Block | None


@_node
class StageStmt:
    """`stage 0: tok_embeddings, layers[0:4]`: the modules of one pipeline stage (planc/resolve/pipeline.py)."""

    span: Span
    index: int
    index_span: Span
    selectors: tuple[Selector, ...]


@_node
class CompileStmt:
    span: Span
    selector: Selector
    optional: bool = False


@_node
class IgnoreStmt:
    span: Span
    selector: Selector
    optional: bool = False


@_node
class PlaceStmt:
    span: Span
    selector: Selector
    placement: Call
    optional: bool = False


@_node
class ExpectUnit:
    """`expect unit SEL` / `expect not unit SEL`."""

    span: Span
    target: Union[Selector, Group]
    negated: bool = False


@_node
class ExpectMetric:
    """`expect units == 27`, `expect memory.peak <= 70GiB at world = 64, input = 8x4096`.

    `world` and `input_shape` are the `at` clause (either may be absent; written in either
    order). `input_shape` holds the sizes as written (`8x4096` -> (8, 4096)); whether they
    make a usable (batch, sequence) is for validation to say, at `input_span`.
    """

    span: Span
    metric: str
    metric_span: Span
    op: str
    value: Number
    world: int | None = None
    input_shape: tuple[int, ...] | None = None
    input_span: Span | None = None


Statement = Union[
    ModelStmt, IncludeStmt, MeshStmt, DefaultsStmt, UnitStmt, RootStmt, CheckpointStmt,
    CompileStmt, IgnoreStmt, PlaceStmt, StepStmt, PipelineStmt, StageStmt, ExpectUnit, ExpectMetric,
]


@_node
class Comment:
    span: Span
    text: str


@_node
class Plan:
    """A parsed plan with its includes spliced in place.

    `statements` holds every statement in effect order: an included file's statements stand
    where its `include` line stood, so the including plan overrides its base. `sources`
    maps each file name to its text, for rendering diagnostics; `comments` are those of the
    top file only (the formatter keeps them).
    """

    file: str
    statements: tuple[Statement, ...]
    sources: tuple[tuple[str, str], ...]
    comments: tuple[Comment, ...] = ()

    @property
    def model_ref(self) -> str | None:
        refs = [s.ref for s in self.statements if isinstance(s, ModelStmt)]
        return refs[-1] if refs else None

    def source(self, file: str) -> str | None:
        return dict(self.sources).get(file)
