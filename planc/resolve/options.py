"""The option vocabulary: names, argument types, defaults, and the FSDP1 spellings.

A block option such as `precision param = bf16, reduce = fp32` is checked here against
`OPTIONS` and turned into assignments of unit settings (`param_dtype = torch.bfloat16`, ...),
each remembering the option that set it. Unknown names and values become P101/P102/P103
diagnostics with "did you mean"; FSDP1 words become their FSDP2 meaning plus a P901 note.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from planc.diagnostics import Diagnostic, Span, suggestion
from planc.lang import syntax as st

Context = Literal["defaults", "unit", "root"]

# Settings every unit has, with the value used when no rule sets them. `None` means
# "FSDP2's own default" (e.g. reshard_after_forward=None: True for inner units, False for
# the root).
SETTING_DEFAULTS: dict[str, Any] = {
    "param_dtype": None,
    "reduce_dtype": None,
    "output_dtype": None,
    "cast_inputs": True,
    "reshard_after_forward": None,
    "offload": False,
    "pin_memory": True,
    "prefetch_forward": None,
    "prefetch_backward": None,
    "checkpoint": None,
    "checkpoint_every": None,
    "compile": None,
    "gradient_divide_factor": None,
    "force_sum_reduction": None,
}

# Settings that transform modules rather than configure `fully_shard`; they make no sense
# on the root (checkpointing or compiling the whole model is a different program).
MODULE_SETTINGS = ("checkpoint", "checkpoint_every", "compile")

DTYPES: dict[str, torch.dtype | None] = {
    "fp32": torch.float32, "float32": torch.float32, "f32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "none": None,
}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", None: "none"}

BOOLS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}

# Activation checkpointing modes (planc/lower/checkpointing.py says what each means).
CHECKPOINT_MODES = ("full", "selective")

# torchtitan's `reshard_after_forward_policy` words (without pipeline parallelism): `default`
# leaves FSDP2's own default (true for inner units, false for the root).
RESHARD_POLICIES: dict[str, bool | None] = {"always": True, "never": False, "default": None}

# FSDP1 sharding strategies and what they become in FSDP2.
FSDP1_RESHARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}
FSDP1_MESH = {"NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"}


@dataclass(frozen=True, slots=True)
class Assignment:
    """One unit setting assigned by one option: `key = value`, set at `span` by `option`."""

    key: str
    value: Any
    span: Span
    option: str


class _Bad(Exception):
    """Raised inside a converter; turned into one diagnostic by `parse_option`."""

    def __init__(self, diag: Diagnostic):
        self.diag = diag


def _err(code: str, message: str, span: Span, label: str = "", help_: tuple[str, ...] = ()) -> _Bad:
    return _Bad(Diagnostic(code=code, severity="error", message=message, span=span, label=label, help=help_))


# ===================================================================== value converters


def _word(v: st.Value, what: str) -> str:
    if isinstance(v, st.Name):
        return v.value
    if isinstance(v, st.String):
        return v.value
    raise _err("P103", f"expected {what}, found `{v}`", v.span, "this value", (f"write {what} here",))


def dtype(v: st.Value) -> torch.dtype | None:
    word = _word(v, "a dtype")
    if word in DTYPES:
        return DTYPES[word]
    raise _err("P102", f"unknown dtype `{word}`", v.span, "not a dtype",
               suggestion(word, DTYPES) or ("dtypes are fp32, bf16, fp16 (or none)",))


def boolean(v: st.Value) -> bool:
    word = _word(v, "`true` or `false`")
    if word.lower() in BOOLS:
        return BOOLS[word.lower()]
    raise _err("P102", f"expected `true` or `false`, found `{word}`", v.span, "not a boolean",
               suggestion(word, ["true", "false"]) or ("write `true` or `false`",))


def reshard(v: st.Value) -> bool | int:
    if isinstance(v, st.Number) and not v.is_bytes and float(v.value).is_integer():
        n = int(v.value)
        if n < 1:
            raise _err("P103", f"reshard group size must be at least 1, found {n}", v.span, "not a group size",
                       ("write `true` to reshard across the whole shard group, or a group size such as `8`",))
        return n
    word = _word(v, "`true`, `false` or a group size")
    if word in FSDP1_RESHARD:
        return FSDP1_RESHARD[word]
    if word in RESHARD_POLICIES:
        return RESHARD_POLICIES[word]
    if word.lower() in BOOLS:
        return BOOLS[word.lower()]
    raise _err("P102", f"expected `true`, `false` or a group size, found `{word}`", v.span, "not a reshard value",
               suggestion(word, ["true", "false", *FSDP1_RESHARD, *RESHARD_POLICIES]) or
               ("write `true` (free after forward), `false` (keep until backward) or a group size such as `8`",))


def compile_backend(v: st.Value) -> str:
    """A `torch.compile` backend by name (`inductor`, `aot_eager`, ...): torch checks it when compiling."""
    return _word(v, "a backend name such as `inductor`")


def prefetch(v: st.Value) -> int | tuple[st.Selector, ...]:
    if isinstance(v, st.SelectorList):
        return v.items
    if isinstance(v, st.Number) and not v.is_bytes and float(v.value).is_integer() and v.value >= 0:
        return int(v.value)
    if isinstance(v, st.Name) and v.value == "none":
        return 0
    raise _err("P103", f"expected a prefetch depth or a list of units, found `{v}`", v.span, "not a prefetch value",
               ("write a depth (`forward = 2`) or units (`forward = [layers.1, layers.2]`)",))


def positive_number(v: st.Value) -> float:
    if isinstance(v, st.Number) and not v.is_bytes and v.value > 0:
        return float(v.value)
    raise _err("P103", f"expected a positive number, found `{v}`", v.span, "not a positive number",
               ("write a number such as `1.0`",))


def positive_int(v: st.Value) -> int:
    if isinstance(v, st.Number) and not v.is_bytes and float(v.value).is_integer() and v.value >= 1:
        return int(v.value)
    raise _err("P103", f"expected a whole number of at least 1, found `{v}`", v.span, "not a count",
               ("write a count such as `2`",))


def enum(*words: str) -> Callable[[st.Value], str]:
    def convert(v: st.Value) -> str:
        word = _word(v, "one of " + ", ".join(f"`{w}`" for w in words))
        if word in words:
            return word
        raise _err("P102", f"unknown value `{word}`", v.span, "expected " + " or ".join(f"`{w}`" for w in words),
                   suggestion(word, words) or ("write " + " or ".join(f"`{w}`" for w in words),))
    convert.words = words  # the accepted words, for editors (planc/lsp completion and hover)
    return convert


# ===================================================================== the options


@dataclass(frozen=True)
class Param:
    """One argument an option takes: its key, converter and the setting it assigns."""

    key: str
    convert: Callable[[st.Value], Any]
    setting: str | None  # the unit setting assigned, or None when `expand` handles it


@dataclass(frozen=True)
class OptionSpec:
    params: tuple[Param, ...]
    positional: tuple[str, ...] = ()   # keys that may be given without `key =`, in order
    bare: dict[str, Any] | None = None  # what the option means with no arguments at all
    expand: Callable[[dict[str, Any], st.Option], list[tuple[str, Any]]] | None = None
    fsdp1: str | None = None            # for FSDP1 spellings: the FSDP2 construct it maps to
    summary: str = ""

    def param(self, key: str) -> Param | None:
        return next((p for p in self.params if p.key == key), None)


def _offload(values: dict[str, Any], opt: st.Option) -> list[tuple[str, Any]]:
    out = [("offload", values.get("device", "cpu") == "cpu")]
    if "pin_memory" in values:
        out.append(("pin_memory", values["pin_memory"]))
    return out


def _compile(values: dict[str, Any], opt: st.Option) -> list[tuple[str, Any]]:
    if values.get("enabled", True) is False:
        return [("compile", None)]
    return [("compile", {k: values[k] for k in ("backend", "fullgraph", "dynamic") if k in values})]


def _checkpoint(values: dict[str, Any], opt: st.Option) -> list[tuple[str, Any]]:
    mode = values.get("mode", "full")
    out = [("checkpoint", None if mode == "none" else mode)]
    if "every" in values:
        out.append(("checkpoint_every", values["every"]))
    return out


def _strategy(values: dict[str, Any], opt: st.Option) -> list[tuple[str, Any]]:
    word = values["strategy"]
    if word in FSDP1_MESH:
        raise _err("P104", f"`{word}` is a mesh setting, not a unit setting", opt.span, "not per unit",
                   (f"write `mesh {word}` at the top level of the plan" +
                    (" with `(shard = N)` ranks per shard group" if "HYBRID" in word else ""),))
    return [("reshard_after_forward", FSDP1_RESHARD[word])]


def _mixed_precision(values: dict[str, Any], opt: st.Option) -> list[tuple[str, Any]]:
    out = []
    for fsdp1, fsdp2 in (("param_dtype", "param_dtype"), ("reduce_dtype", "reduce_dtype"),
                         ("output_dtype", "output_dtype"), ("cast_forward_inputs", "cast_inputs")):
        if fsdp1 in values:
            out.append((fsdp2, values[fsdp1]))
    return out


def _cpu_offload(values: dict[str, Any], opt: st.Option) -> list[tuple[str, Any]]:
    return [("offload", values.get("offload_params", True))]


OPTIONS: dict[str, OptionSpec] = {
    "precision": OptionSpec(
        params=(Param("param", dtype, "param_dtype"), Param("reduce", dtype, "reduce_dtype"),
                Param("output", dtype, "output_dtype"), Param("cast_inputs", boolean, "cast_inputs")),
        positional=("param",),
        summary="mixed precision: parameter, gradient-reduction and output dtypes; input casting"),
    "reshard": OptionSpec(
        params=(Param("after_forward", reshard, "reshard_after_forward"),),
        positional=("after_forward",),
        summary="free unsharded parameters after forward (true), keep them (false), or reshard to N ranks"),
    "offload": OptionSpec(
        params=(Param("device", enum("cpu", "none"), None), Param("pin_memory", boolean, None)),
        positional=("device",), bare={"device": "cpu"}, expand=_offload,
        summary="keep sharded parameters, gradients and optimizer state on the CPU"),
    "prefetch": OptionSpec(
        params=(Param("forward", prefetch, "prefetch_forward"), Param("backward", prefetch, "prefetch_backward")),
        summary="units to all-gather ahead: a depth (next N units) or an explicit list"),
    "checkpoint": OptionSpec(
        params=(Param("mode", enum(*CHECKPOINT_MODES, "none"), None), Param("every", positive_int, None)),
        positional=("mode",), bare={"mode": "full"}, expand=_checkpoint,
        summary="activation checkpointing of each module of the unit (applied before sharding): `full`, or "
                "`selective` (keep matmul and attention outputs, recompute the rest)"),
    "compile": OptionSpec(
        params=(Param("enabled", boolean, None), Param("fullgraph", boolean, None), Param("dynamic", boolean, None),
                Param("backend", compile_backend, None)),
        positional=("enabled",), bare={"enabled": True}, expand=_compile,
        summary="torch.compile each module of the unit (applied before sharding)"),
    "reduction": OptionSpec(
        params=(Param("divide_factor", positive_number, "gradient_divide_factor"),
                Param("force_sum", boolean, "force_sum_reduction")),
        summary="gradient reduction: divide the summed gradients by this factor instead of the data-parallel "
                "size (`1.0`: sum, as torchtitan does), and reduce with a plain SUM"),
    # --- FSDP1 spellings, accepted and mapped (with a P901 note)
    "strategy": OptionSpec(
        params=(Param("strategy", enum(*FSDP1_RESHARD, *sorted(FSDP1_MESH)), None),),
        positional=("strategy",), expand=_strategy, fsdp1="reshard after_forward = true|false",
        summary="FSDP1 sharding_strategy"),
    "mixed_precision": OptionSpec(
        params=(Param("param_dtype", dtype, None), Param("reduce_dtype", dtype, None),
                Param("buffer_dtype", dtype, None), Param("output_dtype", dtype, None),
                Param("cast_forward_inputs", boolean, None)),
        expand=_mixed_precision, fsdp1="precision param = ..., reduce = ...",
        summary="FSDP1 MixedPrecision (buffer_dtype has no FSDP2 equivalent and is dropped)"),
    "cpu_offload": OptionSpec(
        params=(Param("offload_params", boolean, None),), positional=("offload_params",),
        bare={"offload_params": True}, expand=_cpu_offload, fsdp1="offload cpu",
        summary="FSDP1 CPUOffload"),
}
OPTIONS["sharding_strategy"] = OPTIONS["strategy"]


def parse_option(opt: st.Option, context: Context) -> tuple[list[Assignment], list[Diagnostic]]:
    """Check one option against the vocabulary and turn it into setting assignments."""
    spec = OPTIONS.get(opt.name)
    if spec is None:
        return [], [Diagnostic(code="P101", severity="error", message=f"unknown option `{opt.name}`",
                               span=opt.name_span, label="not an option",
                               help=suggestion(opt.name, OPTIONS) or
                               ("options are " + ", ".join(f"`{o}`" for o in OPTIONS if not OPTIONS[o].fsdp1),))]
    try:
        values = _bind(spec, opt)
        if context == "root" and opt.name in MODULE_SETTINGS:
            raise _err("P104", f"`{opt.name}` cannot be set on the root", opt.span, "not on the root",
                       (f"set it on the units that need it, e.g. `unit layers.* {{ {opt.name} }}`",))
        if spec.expand is not None:
            pairs = spec.expand(values, opt)
        else:
            pairs = [(spec.param(k).setting, v) for k, v in values.items()]
    except _Bad as bad:
        return [], [bad.diag]
    diags: list[Diagnostic] = []
    if spec.fsdp1:
        became = ", ".join(f"{k} = {_show(v)}" for k, v in pairs) or "nothing"
        notes = ("FSDP2 has no buffer dtype; buffers keep their own dtype",) \
            if opt.name == "mixed_precision" and "buffer_dtype" in values else ()
        diags.append(Diagnostic(code="P901", severity="note", span=opt.span, label=f"became {became}",
                                message=f"FSDP1 `{opt.name}` mapped to FSDP2", notes=notes,
                                help=(f"the FSDP2 spelling is `{_fsdp2_spelling(pairs) or spec.fsdp1}`",)))
    return [Assignment(k, v, opt.span, opt.name) for k, v in pairs], diags


_PRECISION_KEYS = {"param_dtype": "param", "reduce_dtype": "reduce", "output_dtype": "output",
                   "cast_inputs": "cast_inputs"}


def _fsdp2_spelling(pairs: list[tuple[str, Any]]) -> str:
    """The FSDP2 options that assign `pairs`: `precision param = bf16; reshard after_forward = false`."""
    precision = [f"{_PRECISION_KEYS[k]} = {_show(v)}" for k, v in pairs if k in _PRECISION_KEYS]
    parts = ["precision " + ", ".join(precision)] if precision else []
    for k, v in pairs:
        if k == "reshard_after_forward":
            parts.append(f"reshard after_forward = {_show(v)}")
        elif k == "offload":
            parts.append("offload cpu" if v else "offload none")
    return "; ".join(parts)


def _bind(spec: OptionSpec, opt: st.Option) -> dict[str, Any]:
    """Match positional and keyword arguments to the option's parameters and convert them."""
    if not opt.args:
        if spec.bare is not None:
            return dict(spec.bare)
        keys = ", ".join(f"`{p.key} = ...`" for p in spec.params)
        raise _err("P103", f"`{opt.name}` needs arguments", opt.span, "nothing set", (f"it takes {keys}",))
    values: dict[str, Any] = {}
    positional = list(spec.positional)
    for arg in opt.args:
        if arg.key is None:
            if not positional:
                raise _err("P103", f"unexpected argument `{arg.value}` to `{opt.name}`", arg.span,
                           "no positional argument here",
                           ("write it as `key = value`; keys are " + ", ".join(f"`{p.key}`" for p in spec.params),))
            key, span = positional.pop(0), arg.span
        else:
            key, span = arg.key, arg.key_span
            if spec.param(key) is None:
                raise _err("P103", f"`{opt.name}` has no argument `{key}`", span, "unknown key",
                           suggestion(key, [p.key for p in spec.params]) or
                           ("keys are " + ", ".join(f"`{p.key}`" for p in spec.params),))
            if key in positional:
                positional.remove(key)
        if key in values:
            raise _err("P103", f"`{key}` given twice", span, "repeated", (f"keep one `{key} = ...`",))
        values[key] = spec.param(key).convert(arg.value)
    return values


def _show(value: Any) -> str:
    if isinstance(value, torch.dtype) or value is None:
        return DTYPE_NAMES.get(value, str(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):  # an explicit prefetch list: selectors, as the plan wrote them
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)


show_value = _show


def bind_block(block: st.Block | None, table: dict[str, OptionSpec], where: str, example: str,
               diags: list[Diagnostic]) -> list[Assignment]:
    """The options of a `where { ... }` block (`step`, `pipeline`) bound against `table`, in order:
    P101 for an option the block does not take (the fix names `table`'s options and `example`), the
    option's own diagnostic for a bad argument, P207 for a key set twice (`set_twice`)."""
    assigned: list[Assignment] = []
    for opt in block.options if block is not None else ():
        spec = table.get(opt.name)
        if spec is None:
            diags.append(Diagnostic(
                code="P101", severity="error", message=f"unknown option `{opt.name}` in a `{where}` block",
                span=opt.name_span, label=f"not a {where} option",
                help=suggestion(opt.name, table) or
                (f"a `{where}` block takes " + ", ".join(f"`{o}`" for o in table) + f", e.g. `{example}`",)))
            continue
        try:
            assigned += [Assignment(k, v, opt.span, opt.name) for k, v in _bind(spec, opt).items()]
        except _Bad as bad:
            diags.append(bad.diag)
    diags.extend(set_twice(assigned))
    return assigned


def set_twice(assigned: list[Assignment]) -> list[Diagnostic]:
    """P207 (warning): one block sets a key twice; the first assignment has no effect."""
    last = {a.key: a for a in assigned}
    return [Diagnostic(code="P207", severity="warning", span=a.span,
                       message=f"`{a.key}` is set twice in one block: this value has no effect",
                       label="set again later in this block", related=((last[a.key].span, "this one counts"),),
                       help=(f"keep one `{a.option}` for `{a.key}`",))
            for a in assigned if last[a.key] is not a and last[a.key].span != a.span]


def replaced(stale, last, word: str, file: str) -> list[Diagnostic]:
    """P207 (warning) for a `word` line (`mesh`, `model`, `step`, `pipeline`) that a later one replaces;
    none for a line of an included plan (overriding a base plan is what `include` is for)."""
    if stale.span.file != file:
        return []
    return [Diagnostic(code="P207", severity="warning", span=stale.span,
                       message=f"this `{word}` line has no effect: a later `{word}` line replaces it",
                       label="replaced", related=((last.span, "this one counts"),), help=(f"keep one `{word}` line",))]
