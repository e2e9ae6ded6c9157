"""Resolve a `parallel` statement's style and block to a `TensorStyle` (tensor parallelism).

    parallel layers.*.attention.wo rowwise { output shard(1) }
    parallel output colwise { input shard(1); loss_parallel }
    parallel layers.*.attention prepare_input { input shard(1), none; desired_input replicate, none }

The style word names one of torch's `ParallelStyle`s (`STYLE_KINDS`); the block's options
are that style's arguments. Each option is accepted only by the styles torch accepts it for,
so a `sequence_dim` on a colwise style is a located P108, not a `TypeError` at apply time.
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.diagnostics import Diagnostic, suggestion
from planc.lang import syntax as st
from planc.lang import vocabulary as vocab
from planc.resolve.styles import REPLICATE, STYLES, TENSOR_STYLES, Layout

__all__ = ["REPLICATE", "STYLE_KINDS", "STYLE_OPTIONS", "Layout", "TensorStyle", "tensor_style"]


# The tensor-parallel styles a plan can name, each one of torch's `ParallelStyle`s, or planc's
# `ReplicateParallel` for `replicate` (torchtitan's NoParallel): the table's tensor rows
# (`planc/resolve/styles.py`, which also holds `Layout`).
STYLE_KINDS = TENSOR_STYLES


@dataclass(frozen=True)
class TensorStyle:
    """One tensor-parallel style and its arguments as the plan set them (None: torch's default).

    Layout tuples are positional (None entries: inputs left alone); kwarg layouts are
    (keyword, layout) pairs in the plan's order. `loss_parallel` marks the output projection
    whose vocabulary-sharded logits the loss is computed on (`loss_parallel()` context).
    """

    kind: str
    input_layouts: tuple[Layout | None, ...] | None = None
    output_layouts: tuple[Layout | None, ...] | None = None
    desired_input_layouts: tuple[Layout | None, ...] | None = None
    desired_output_layouts: tuple[Layout | None, ...] | None = None
    input_kwarg_layouts: tuple[tuple[str, Layout | None], ...] = ()
    desired_input_kwarg_layouts: tuple[tuple[str, Layout | None], ...] = ()
    use_local_output: bool | None = None
    sequence_dim: int | None = None
    loss_parallel: bool = False



# option -> (TensorStyle field, what it holds); which styles take it is their rows' `options`
_OPTION_FIELDS: dict[str, tuple[str, str]] = {
    "input": ("input_layouts", "layouts"),
    "output": ("output_layouts", "layouts"),
    "desired_input": ("desired_input_layouts", "layouts"),
    "desired_output": ("desired_output_layouts", "layouts"),
    "input_kwargs": ("input_kwarg_layouts", "kwarg layouts"),
    "desired_input_kwargs": ("desired_input_kwarg_layouts", "kwarg layouts"),
    "local_output": ("use_local_output", "bool"),
    "sequence_dim": ("sequence_dim", "int"),
    "loss_parallel": ("loss_parallel", "flag"),
}
# option -> (TensorStyle field, the styles that take it, what it holds)
STYLE_OPTIONS: dict[str, tuple[str, tuple[str, ...], str]] = {
    option: (field, tuple(k for k in STYLE_KINDS if option in STYLES[k].options), holds)
    for option, (field, holds) in _OPTION_FIELDS.items()}
_BOOLS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}


def _bad(span, message: str, label: str, *help_: str) -> Diagnostic:
    return Diagnostic(code="P108", severity="error", message=message, span=span, label=label, help=help_)


def _layout(value, diags: list[Diagnostic]) -> tuple[bool, Layout | None]:
    """(ok, layout) for `replicate`, `partial`, `none` or `shard(N)`."""
    if isinstance(value, st.Name) and value.value in ("replicate", "partial"):
        return True, Layout(value.value)
    if isinstance(value, st.Name) and value.value == "none":
        return True, None
    if (isinstance(value, st.Call) and value.name == "shard" and len(value.args) == 1
            and isinstance(value.args[0], st.Number) and float(value.args[0].value).is_integer()):
        return True, Layout("shard", int(value.args[0].value))
    torch = value.name if isinstance(value, st.Call) else getattr(value, "value", None)
    habit = (f"layouts are plan words: write `{vocab.TORCH_LAYOUTS[torch]}"
             + (f"({', '.join(map(str, value.args))})`" if isinstance(value, st.Call) and value.args else "`")
             + f" for torch's `{value}`",) if torch in vocab.TORCH_LAYOUTS else ()
    diags.append(_bad(value.span, f"`{value}` is not a layout", "expected a layout", *habit,
                      "layouts are `replicate`, `shard(N)` (the dimension split), `partial` and `none`"))
    return False, None


def _style_habit(kind: str) -> tuple[str, ...]:
    """The plan's spelling of a torch style class or a Hugging Face `tp_plan` style name, or ()."""
    torch = {r.torch_class: r.word for r in STYLES.values() if r.torch_own}
    if kind in torch:
        return (f"styles are plan words: write `{torch[kind]}` for torch's `{kind}`",)
    from planc.importers.hf_tp import STYLES as HF_STYLES
    if kind in HF_STYLES:
        word, options = HF_STYLES[kind]
        written = f"{word} {{ {'; '.join(options)} }}" if options else word
        return (f"`{kind}` is Hugging Face's name: write `{written}`, the layouts its style uses"
                + (f" (plain `{word}` would keep the output sharded)" if options and word == "colwise" else "")
                + (f" (plain `{word}` would expect a sharded input)" if options and word == "rowwise" else ""),)
    return ()


def _option_habit(name: str) -> tuple[str, ...]:
    """The plan's name for a style option written as torch's keyword (`input_layouts` -> `input`), or ()."""
    torch = {field: option for option, (field, _, _) in STYLE_OPTIONS.items()}
    if name in torch and name != torch[name]:
        return (f"write `{torch[name]}` for torch's `{name}`",)
    return ()


def tensor_style(stmt: st.ParallelStmt, diags: list[Diagnostic]) -> TensorStyle | None:
    """The style a `parallel` statement asks for, or None (with diagnostics) when it is wrong."""
    kind = stmt.style.value
    if kind not in STYLE_KINDS:
        diags.append(Diagnostic(code="P107", severity="error", message=f"unknown tensor-parallel style `{kind}`",
                                span=stmt.style.span, label="not a style",
                                help=_style_habit(kind) or suggestion(kind, STYLE_KINDS)
                                or ("styles are " + ", ".join(STYLE_KINDS),)))
        return None
    fields: dict = {}
    ok = True
    for opt in stmt.block.options if stmt.block else ():
        spec = STYLE_OPTIONS.get(opt.name)
        if spec is None:
            diags.append(_bad(opt.name_span, f"unknown option `{opt.name}` for a tensor-parallel style",
                              "not a style option", *(_option_habit(opt.name) or suggestion(opt.name, STYLE_OPTIONS)
                                                      or ("style options are " + ", ".join(STYLE_OPTIONS),))))
            ok = False
            continue
        field, takers, holds = spec
        if kind not in takers:
            diags.append(_bad(opt.name_span, f"`{opt.name}` does not apply to a {kind} style", f"not a {kind} option",
                              f"`{opt.name}` is taken by " + ", ".join(takers)))
            ok = False
            continue
        if field in fields:
            diags.append(_bad(opt.name_span, f"`{opt.name}` given twice", "repeated", f"keep one `{opt.name}`"))
            ok = False
            continue
        positional = [a for a in opt.args if a.key is None]
        keyed = [a for a in opt.args if a.key is not None]
        if holds == "flag":
            if opt.args:
                diags.append(_bad(opt.span, f"`{opt.name}` takes no value", "a flag", f"write `{opt.name}` alone"))
                ok = False
                continue
            fields[field] = True
        elif holds == "layouts":
            if keyed or not positional:
                diags.append(_bad(opt.span, f"`{opt.name}` takes positional layouts", "expected layouts",
                                  f"write e.g. `{opt.name} shard(1)`, one layout per positional input"))
                ok = False
                continue
            if STYLES[kind].one_layout and len(positional) > 1:
                diags.append(_bad(opt.span, f"a {kind} style takes one `{opt.name}` layout", f"{len(positional)} layouts",
                                  "a linear layer has one input and one output; keep one layout"))
                ok = False
                continue
            results = [_layout(a.value, diags) for a in positional]
            ok &= all(r[0] for r in results)
            fields[field] = tuple(r[1] for r in results)
        elif holds == "kwarg layouts":
            if positional or not keyed:
                diags.append(_bad(opt.span, f"`{opt.name}` takes `name = layout` pairs", "expected keyword layouts",
                                  f"write e.g. `{opt.name} freqs_cis = replicate`"))
                ok = False
                continue
            pairs = [(a.key, _layout(a.value, diags)) for a in keyed]
            ok &= all(r[0] for _, r in pairs)
            fields[field] = tuple((k, r[1]) for k, r in pairs)
        else:
            value = positional[0].value if len(positional) == 1 and not keyed else None
            if holds == "bool" and isinstance(value, st.Name) and value.value in _BOOLS:
                fields[field] = _BOOLS[value.value]
            elif holds == "int" and isinstance(value, st.Number) and float(value.value).is_integer():
                fields[field] = int(value.value)
            else:
                diags.append(_bad(opt.span, f"`{opt.name}` takes {'true or false' if holds == 'bool' else 'an integer'}",
                                  "bad value", f"write e.g. `{opt.name} {'false' if holds == 'bool' else '1'}`"))
                ok = False
                continue
    if not ok:
        return None
    if fields.get("loss_parallel"):
        if fields.get("output_layouts", (Layout("shard", -1),)) != (Layout("shard", -1),) or fields.get("use_local_output"):
            diags.append(_bad(stmt.span, "`loss_parallel` needs the logits sharded on the vocabulary",
                              "conflicting output", "leave `output` and `local_output` out: loss parallel sets "
                              "`output shard(-1)` and `local_output false`"))
            return None
        fields["output_layouts"] = (Layout("shard", -1),)
        fields["use_local_output"] = False
    return TensorStyle(kind=kind, **fields)
