"""Emit the hand-written FSDP2 code a plan stands for: `def apply_plan(model, mesh)`.

`planc emit PLAN` prints a Python module that makes the same calls `planc.apply` makes, in
the same order: activation checkpointing, `module.compile()`, `fully_shard` bottom-up (a
group as one list call, the root last), then the explicit prefetch lists. Runs of units over
a `ModuleList` become loops (`for block in model.layers:`), and a comment before each call
names the plan lines it came from.

The `fully_shard` arguments are not re-derived here: they are read from
`planc.backends.runtime.fully_shard_kwargs`, the function `planc.apply` calls, evaluated on the
meta-built model, and each value is turned back into source. An argument this module does
not know how to print is an error, not a silent omission, so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import inspect
import keyword
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from planc.compiler import CompiledPlan
from planc.resolve.ir import Setting, Unit

LOOP_VAR = "block"
WIDTH = 100  # wrap calls longer than this


class EmitError(Exception):
    """`fully_shard_kwargs` returned something emit cannot print (runtime and emit drifted)."""


# ===================================================================== names -> expressions


def _is_indexed(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.Sequential))


def expression(root: str, base: nn.Module, path: str) -> str:
    """Python source reaching the module or parameter `path` below `base` (named `root`).

    `layers.0.attention.wq.weight` -> `model.layers[0].attention.wq.weight`; a name that is
    not an identifier falls back to `get_submodule`/`get_parameter`.
    """
    if not path:
        return root
    out, module = root, base
    parts = path.split(".")
    for i, part in enumerate(parts):
        child = module._modules.get(part) if module is not None else None
        if part.isdigit() and _is_indexed(module):
            out += f"[{part}]"
        elif part.isidentifier() and not keyword.iskeyword(part):
            out += f".{part}"
        elif isinstance(module, nn.ModuleDict):
            out += f"[{part!r}]"
        else:
            getter = "get_submodule" if child is not None else "get_parameter"
            return f"{root}.{getter}({path!r})"
        module = child
        if module is None and i < len(parts) - 1:
            return f"{root}.get_parameter({path!r})"
    return out


# ===================================================================== kwargs -> source


@dataclass(frozen=True)
class _MeshStandIn:
    """What `fully_shard_kwargs` reads of a mesh, without a process group.

    Emit runs at the command line with no ranks; the kwargs function only stores the mesh
    and reads its device type (pinned memory needs an accelerator).
    """

    device_type: str


def _literal(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value)  # torch.bfloat16
    return repr(value)


def _policy(policy: Any) -> str:
    """`MixedPrecisionPolicy(param_dtype=torch.bfloat16, ...)`: the fields that differ from the defaults."""
    default = type(policy)()
    args = [f"{f.name}={_literal(getattr(policy, f.name))}" for f in dataclasses.fields(policy)
            if getattr(policy, f.name) != getattr(default, f.name)]
    return f"{type(policy).__name__}({', '.join(args)})"


def _source(value: Any) -> str:
    return _policy(value) if dataclasses.is_dataclass(value) else _literal(value)


def _fully_shard_defaults() -> dict[str, str]:
    from torch.distributed.fsdp import fully_shard
    out = {}
    for name, p in inspect.signature(fully_shard).parameters.items():
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty:
            out[name] = _source(p.default)
    return out


@dataclass
class _Call:
    """One emitted statement: the paths it touches (for loops) and how to print it."""

    paths: tuple[str, ...]  # module paths; param paths of placements and ignores
    render: Callable[[Callable[[str], str]], str]  # path -> expression, to the call's source
    comments: tuple[str, ...] = ()


class _Unit:
    """A unit's `fully_shard` call, built from `fully_shard_kwargs` on the meta model."""

    def __init__(self, unit: Unit, compiled: CompiledPlan, model: nn.Module, defaults: dict[str, str]):
        from planc.backends.runtime import fully_shard_kwargs

        self.unit = unit
        # Evaluated for an accelerator mesh and a CPU mesh: where they differ (pinned memory),
        # the emitted code decides from the mesh it is given, as `planc.apply` does.
        accel = fully_shard_kwargs(unit, compiled, model, _MeshStandIn("cuda"))
        cpu = fully_shard_kwargs(unit, compiled, model, _MeshStandIn("cpu"))
        name_of = {id(p): n for n, p in model.named_parameters()}
        self.args: list[tuple[str, Any]] = []  # (kwarg, value); value is source or a param-list marker
        self.param_paths: list[str] = []
        for key, value in accel.items():
            if key in ("reshard_after_forward", "mp_policy") and _source(value) != _source(cpu[key]):
                raise EmitError(f"`fully_shard_kwargs` gives `{key}` that depends on the mesh device")
            if key == "mesh":
                self.args.append((key, "mesh"))
            elif key in ("reshard_after_forward", "mp_policy"):
                self.args.append((key, _source(value)))
            elif key == "offload_policy":
                text = _policy(value)
                if text != _policy(cpu[key]):
                    text = f'{type(value).__name__}(pin_memory=mesh.device_type != "cpu")'
                self.args.append((key, text))
            elif key == "shard_placement_fn":
                if value is None:
                    self.args.append((key, "None"))
                    continue
                # ask the runtime's own function where it places each parameter this call
                # manages (FSDP2 calls it for those only, so the others need no entry)
                placed = []
                for name in unit.params:
                    result = value(model.get_parameter(name))
                    if result is not None:
                        placed.append((name, result.dim))
                self.param_paths += [n for n, _ in placed]
                # a function that answers None for every parameter it sees is FSDP2's default
                self.args.append((key, ("placements", tuple(placed)) if placed else "None"))
            elif key == "ignored_params":
                if not value:
                    self.args.append((key, "None"))
                    continue
                names = sorted(name_of[id(p)] for p in value)
                self.param_paths += names
                self.args.append((key, ("ignored", tuple(names))))
            else:
                raise EmitError(f"`fully_shard_kwargs` returned `{key}`, which emit cannot print yet")
        self.defaults = defaults

    def kwargs(self, expr: Callable[[str], str], hoisted: dict[str, str]) -> list[str]:
        out = []
        for key, value in self.args:
            if isinstance(value, tuple):
                kind, items = value
                if kind == "placements":
                    value = "placement_fn({" + ", ".join(f"{expr(n)}: {d}" for n, d in items) + "})"
                else:
                    value = "{" + ", ".join(expr(n) for n in items) + "}"
            elif value == self.defaults.get(key):
                continue  # fully_shard's own default: leave it out, as a person would
            out.append(f"{key}={hoisted.get(value, value)}")
        return out


# ===================================================================== provenance comments

_GROUPS = (("precision", ("param_dtype", "reduce_dtype", "output_dtype", "cast_inputs")),
           ("reshard", ("reshard_after_forward",)), ("offload", ("offload", "pin_memory")))


def _where(span, rule: str) -> str:
    return f"{rule} ({span.file}:{span.line})" if span is not None else rule


def _unit_comments(u: Unit, compiled: CompiledPlan, params: list[str]) -> tuple[str, ...]:
    if u.is_root:
        head = f"{_where(u.span, u.rule or 'root')}: the whole model, last" if u.span else \
            "the root: the whole model, last (planc's default)"
    else:
        head = _where(u.span, u.rule or f"unit {u.name}")
    origins = []
    for label, keys in _GROUPS:
        settings: list[Setting] = [u.settings[k] for k in keys if u.settings[k].span is not None]
        where = sorted({_where(s.span, s.rule) for s in settings})
        if where:
            origins.append(f"{label} from {', '.join(where)}")
    res = compiled.resolution
    for label, table in (("placement", {n: res.placements[n][1] for n in params if n in res.placements}),
                         ("ignored", {n: res.ignored[n] for n in params if n in res.ignored})):
        lines = sorted({f"{s.file}:{s.line}" for s in table.values()})
        if lines:
            origins.append(f"{label} from {', '.join(lines)}")
    if not origins:
        return (head,)
    joined = "; ".join(origins)
    return (head, joined) if len(joined) <= WIDTH - 10 else (head, *origins)


# ===================================================================== loops


def _block_of(path: str) -> tuple[str, int, str] | None:
    """(`layers`, 3, `mlp`) for `layers.3.mlp`: the first numeric segment splits it."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and i > 0:
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1:])
    return None


def _loop_key(call: _Call, model: nn.Module) -> tuple[str, int] | None:
    """The block (`layers`, 3) a call is about: that of its first path inside a ModuleList."""
    for path in call.paths:
        block = _block_of(path)
        if block is None:
            continue
        try:
            container = model.get_submodule(block[0])
        except AttributeError:
            return None
        return block[:2] if _is_indexed(container) or _is_numbered_dict(container) else None
    return None


def _is_numbered_dict(module: nn.Module) -> bool:
    """A ModuleDict keyed "0", "1", ... in order (torchtitan's `layers`): loopable with `.values()`."""
    return isinstance(module, nn.ModuleDict) and list(module.keys()) == [str(i) for i in range(len(module))]


def _render_body(group: list[_Call], key: tuple[str, int], model: nn.Module, indexed: bool
                 ) -> tuple[tuple[str, ...], bool]:
    """The calls of one block with its paths relative to the loop variables.

    Paths in the block become `block...` (`layers[i]...` when `indexed`); paths in a sibling
    block become `model.layers[i + k]...`; all others stay absolute. Returns the source
    and whether it needs the index `i`.
    """
    prefix, index = key
    seq = expression("model", model, prefix)
    needs_index = indexed

    def rel(path: str) -> str:
        nonlocal needs_index
        block = _block_of(path)
        if block is None or block[0] != prefix:
            return expression("model", model, path)
        offset = block[1] - index
        module = model.get_submodule(f"{prefix}.{block[1]}")
        if offset == 0:
            return expression(f"{seq}[i]" if indexed else LOOP_VAR, module, block[2])
        needs_index = True
        sign = "+" if offset > 0 else "-"
        return expression(f"{seq}[i {sign} {abs(offset)}]", module, block[2])
    return tuple(c.render(rel) for c in group), needs_index


def _emit_calls(calls: list[_Call], model: nn.Module, indent: str) -> list[str]:
    """Source lines for calls in order, folding runs over consecutive blocks into loops."""
    # chunks: consecutive calls on the same block (prefix, index), or single calls
    chunks: list[tuple[tuple[str, int] | None, list[_Call]]] = []
    for call in calls:
        key = _loop_key(call, model)
        if key is not None and chunks and chunks[-1][0] == key:
            chunks[-1][1].append(call)
        else:
            chunks.append((key, [call]))

    out: list[str] = []
    i = 0
    while i < len(chunks):
        key, group = chunks[i]
        j = i + 1
        step = 0
        if key is not None:
            sig = _render_body(group, key, model, indexed=True)[0]
            while j < len(chunks) and chunks[j][0] is not None and chunks[j][0][0] == key[0]:
                d = chunks[j][0][1] - chunks[j - 1][0][1]
                if d not in (1, -1) or (step and d != step) or \
                        _render_body(chunks[j][1], chunks[j][0], model, indexed=True)[0] != sig:
                    break
                step = d
                j += 1
        if j - i < 2:
            for call in group:
                out += [f"{indent}# {c}" for c in call.comments]
                out += _wrap(call.render(lambda p: expression("model", model, p)), indent)
            i = j
            continue
        prefix = key[0]
        lo, hi = sorted((key[1], chunks[j - 1][0][1]))
        seq = expression("model", model, prefix)
        container = model.get_submodule(prefix)
        whole = lo == 0 and hi == len(container) - 1
        text, needs_index = _render_body(group, key, model, indexed=False)
        if isinstance(container, nn.ModuleDict):
            # keyed by strings: only a whole, in-order run reads well (`.values()`)
            if not (whole and step == 1 and not needs_index):
                for _, g in chunks[i:j]:
                    for call in g:
                        out += [f"{indent}# {c}" for c in call.comments]
                        out += _wrap(call.render(lambda p: expression("model", model, p)), indent)
                i = j
                continue
            seq += ".values()"
        if step == 1 and not needs_index:
            header = f"for {LOOP_VAR} in {seq}{'' if whole else f'[{lo}:{hi + 1}]'}:"
        else:
            text = _render_body(group, key, model, indexed=True)[0]
            rng = f"range({lo}, {hi + 1})" if step == 1 else f"range({hi}, {lo - 1}, -1)"
            header = f"for i in {rng}:"
        if len(group) == 1:
            out += [f"{indent}# {c}" for c in _dedupe(c for _, g in chunks[i:j] for c in g[0].comments)]
            out.append(indent + header)
            out += _wrap(text[0], indent + "    ")
        else:
            out.append(indent + header)
            for n, line in enumerate(text):
                out += [f"{indent}    # {c}" for c in _dedupe(c for _, g in chunks[i:j] for c in g[n].comments)]
                out += _wrap(line, indent + "    ")
        i = j
    return out


def _dedupe(items) -> list[str]:
    seen: dict[str, None] = {}
    for item in items:
        seen.setdefault(item, None)
    return list(seen)


def _wrap(text: str, indent: str) -> list[str]:
    """One statement, wrapped at WIDTH: arguments packed after the opening bracket and aligned with it."""
    lines = _wrap_at(text, len(indent))
    return [indent + lines[0]] + lines[1:]


def _wrap_at(text: str, col: int) -> list[str]:
    """Lines for `text` starting at column `col`; later lines carry their own indentation."""
    if col + len(text) <= WIDTH:
        return [text]
    open_at = _first_bracket(text)
    if open_at is None:
        return [text]
    close_at = _matching(text, open_at)
    head, inner, tail = text[:open_at + 1], text[open_at + 1:close_at], text[close_at:]
    pieces = _split_args(inner)
    hang = col + len(head)
    lines = [head]

    def end_col() -> int:  # the column after the last line's text
        return col + len(lines[0]) if len(lines) == 1 else len(lines[-1])

    fresh = True  # nothing yet after the bracket (or after a new line's indentation)
    for n, piece in enumerate(pieces):
        piece += "," if n < len(pieces) - 1 else ""
        glue = "" if fresh else " "
        if not fresh and end_col() + 1 + len(piece) > WIDTH:
            lines.append(" " * hang)
            glue = ""
        sub = _wrap_at(piece, end_col() + len(glue))
        lines[-1] += glue + sub[0]
        lines += sub[1:]
        fresh = False
    lines[-1] += tail
    return lines


def _first_bracket(text: str) -> int | None:
    quote = None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote and text[i - 1] != "\\":
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            return i
    return None


def _scan(text: str, start: int = 0):
    """Yield (index, char, bracket depth before it) for characters outside string literals."""
    depth, quote = 0, None
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            if ch == quote and text[i - 1] != "\\":
                quote = None
            continue
        if ch in "'\"":
            quote = ch
            continue
        yield i, ch, depth
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1


def _matching(text: str, open_at: int) -> int:
    """The index of the bracket closing the one at `open_at` (or the end of the text)."""
    return next((i for i, ch, depth in _scan(text, open_at) if ch in ")]}" and depth == 1), len(text))


def _split_args(text: str) -> list[str]:
    """Split at top-level commas (not inside brackets or strings)."""
    out, start = [], 0
    for i, ch, depth in _scan(text):
        if ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    out.append(text[start:].strip())
    return out


# ===================================================================== the module


PLACEMENT_FN = '''

def placement_fn(dims):
    """A `shard_placement_fn` for `fully_shard`: `Shard(dim)` for the given parameters.

    The others get FSDP2's default, `Shard(0)`. Parameters are matched by identity.
    """
    by_id = {id(param): dim for param, dim in dims.items()}

    def shard_placement_fn(param):
        dim = by_id.get(id(param))
        return None if dim is None else Shard(dim)
    return shard_placement_fn
'''


def emit_python(compiled: CompiledPlan, *, plan_path: str | None = None, model_ref: str | None = None) -> str:
    """The Python source of `apply_plan(model, mesh)` for a compiled plan.

    Args:
        compiled: the plan compiled against a model built on any device (meta is fine); it
            must have no errors. `compiled.graph.model` is the model the code is written for.
        plan_path: how to name the plan in the docstring (default: the plan's file name).
        model_ref: how to name the model (default: the plan's `model` line).

    Returns:
        A module's source: docstring, imports, and `apply_plan(model, mesh)`, which makes the
        calls `planc.apply(model, plan, mesh=mesh)` makes and returns the model.
    """
    model = compiled.graph.model
    if model is None:
        raise ValueError("emit needs a plan compiled against a model")
    compiled.raise_for_errors()
    res = compiled.resolution
    plan_path = plan_path or compiled.plan.file
    model_ref = model_ref or compiled.plan.model_ref or type(model).__name__
    defaults = _fully_shard_defaults()
    units = [_Unit(u, compiled, model, defaults) for u in compiled.units]

    # a MixedPrecisionPolicy shared by several calls is named once
    counts: dict[str, int] = {}
    for u in units:
        for key, value in u.args:
            if key == "mp_policy" and value != defaults.get(key):
                counts[value] = counts.get(value, 0) + 1
    shared = [v for v, n in counts.items() if n > 1]
    hoisted = {v: ("mp_policy" if len(shared) == 1 else f"mp_policy_{i}") for i, v in enumerate(shared, 1)}

    body: list[str] = []
    ind = "    "
    if res.checkpoint or res.compile:
        body.append(f"{ind}# NOTE: checkpointing and compile wrap the plain modules before `fully_shard` hooks them.")
    ckpt = [_Call((path,), lambda e, p=path: f"checkpoint({e(p)})", (_where(s.span, s.rule),))
            for path, s in res.checkpoint.items()]
    body += _emit_calls(ckpt, model, ind)
    comp = [_Call((path,), lambda e, p=path, s=s: f"{e(p)}.compile(" +
                  ", ".join(f"{k}={v!r}" for k, v in (s.value or {}).items()) + ")", (_where(s.span, s.rule),))
            for path, s in res.compile.items()]
    body += _emit_calls(comp, model, ind)
    if body:
        body.append("")
    for value, name in hoisted.items():
        body += _wrap(f"{name} = {value}", ind)
    body.append(f"{ind}# NOTE: bottom-up: a call owns the parameters of its subtree not claimed by an earlier call.")
    calls = []
    for u in units:
        def render(e, u=u):
            target = "model" if u.unit.is_root else (
                "[" + ", ".join(e(m) for m in u.unit.modules) + "]" if u.unit.is_group else e(u.unit.modules[0]))
            return f"fully_shard({', '.join([target] + u.kwargs(e, hoisted))})"
        paths = () if u.unit.is_root else tuple(u.unit.modules) + tuple(u.param_paths)
        calls.append(_Call(paths, render, _unit_comments(u.unit, compiled, u.param_paths)))
    body += _emit_calls(calls, model, ind)

    handle = {u.name: ("" if u.is_root else u.modules[0]) for u in compiled.units}
    for direction, table in (("forward", res.prefetch_forward), ("backward", res.prefetch_backward)):
        if not table:
            continue
        body += ["", f"{ind}# explicit {direction} prefetch (all-gather these units ahead)"]
        pre = [_Call((handle[src], *[handle[t] for t in targets]) if handle[src] else (),
                     lambda e, s=handle[src], ts=tuple(handle[t] for t in targets), d=direction:
                     f"{e(s)}.set_modules_to_{d}_prefetch([{', '.join(e(t) for t in ts)}])")
               for src, targets in table.items()]
        body += _emit_calls(pre, model, ind)
    body += [f"{ind}return model"]

    uses = "\n".join(line for line in body if not line.lstrip().startswith("#"))  # code, not comments
    imports = ["import torch"] if "torch." in uses else []
    if res.checkpoint:
        imports.append("from torch.distributed._composable import checkpoint")
    # NOTE: whole names: `OffloadPolicy(` is also the tail of `CPUOffloadPolicy(`
    fsdp = sorted({n for n in ("CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy")
                   if re.search(rf"\b{n}\(", uses)})
    imports.append("from torch.distributed.fsdp import " + ", ".join(fsdp + ["fully_shard"]))
    if "placement_fn(" in uses:
        imports.append("from torch.distributed.tensor import Shard")
    mesh_doc = "a 2-D device mesh (\"replicate\", \"shard\")" if res.mesh.is_hsdp else "a 1-D device mesh"
    head = [
        f'"""FSDP2 sharding of `{model_ref}` as `{plan_path}` plans it: {len(compiled.units)} units.',
        "",
        f"Generated by `planc emit {plan_path}`. `apply_plan(model, mesh)` makes the calls",
        f'`planc.apply(model, "{plan_path}", mesh=mesh)` makes, in the same order.',
        '"""',
        "",
        *imports,
    ]
    text = "\n".join(head)
    if "placement_fn(" in uses:
        text += "\n" + PLACEMENT_FN.rstrip("\n")
    text += "\n\n\ndef apply_plan(model, mesh):\n"
    text += f'    """Shard `model` in place on `mesh` ({mesh_doc}) and return it."""\n'
    return text + "\n".join(body) + "\n"
