"""Emit the hand-written FSDP2 code a plan stands for: `def apply_plan(model, mesh)`.

`planc emit PLAN` prints a Python module that makes the same calls `planc.apply` makes, in
the same order: activation checkpointing, `module.compile()`, `fully_shard` bottom-up (a
group as one list call, the root last), then the explicit prefetch lists. Runs of units over
a `ModuleList` become loops (`for block in model.layers:`), and a comment before each call
names the plan lines it came from.

Nothing is re-derived here: emit prints the lowered program (`compiled.program`,
planc/lower/), the same operations `planc.apply` executes, one printer per op type. An
op, action or step op this module has no rule for is refused (`READER`: `UnknownKind`), never
silently omitted.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from planc.compiler import CompiledPlan
from planc.lower.job import FORWARD, FULL_BACKWARD, LossParallel, Reader, ShardBatch, UnknownKind
from planc.lower.lowering import tensor_reties
from planc.lower.program import (
    FULLY_SHARD_DEFAULTS,
    AttendOverContext,
    Checkpoint,
    Compile,
    DispatchExperts,
    FullyShard,
    Layout,
    Offload,
    Parallelize,
    Precision,
    SetPrefetch,
    TensorStyle,
    UnitMethod,
)
from planc.resolve.experts import EFSDP
from planc.resolve.ir import Setting
from planc.resolve.mesh import Role
from planc.resolve.styles import ROWS, STYLES

LOOP_VAR = "block"
WIDTH = 100  # wrap calls longer than this


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


# ===================================================================== ops -> source


def _literal(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value)  # torch.bfloat16
    return repr(value)


def _precision(p: Precision) -> str:
    """`MixedPrecisionPolicy(param_dtype=torch.bfloat16, ...)`: the arguments that differ from its defaults."""
    return "MixedPrecisionPolicy(" + ", ".join(f"{k}={_literal(v)}" for k, v in p.changed().items()) + ")"


def _offload(o: Offload) -> str | None:
    """The `offload_policy` argument, or None for FSDP2's default (no offload).

    Pinning needs an accelerator; the code decides from the mesh it is given, as `planc.apply` does.
    """
    if not o.enabled:
        return None
    return 'CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")' if o.pin_memory else \
        "CPUOffloadPolicy(pin_memory=False)"


@dataclass
class _Call:
    """One emitted statement: the paths it touches (for loops) and how to print it."""

    paths: tuple[str, ...]  # module paths; param paths of placements and ignores
    render: Callable[[Callable[[str], str]], str]  # path -> expression, to the call's source
    comments: tuple[str, ...] = ()


class _Unit:
    """A `FullyShard` op's arguments as source, in `fully_shard`'s order, defaults left out."""

    def __init__(self, op: FullyShard, mesh: str = "mesh"):
        self.op = op
        policy = op.policy
        self.param_paths = [n for n, _ in op.placements] + [n for n, _ in op.experts] + list(op.ignored)
        self.mp_policy = _precision(policy.precision) if policy.precision.changed() else None
        # (kwarg, source or a param-list marker); None values are FSDP2's defaults
        self.args: list[tuple[str, Any]] = [
            ("mesh", mesh),
            ("reshard_after_forward", None if policy.reshard_argument == FULLY_SHARD_DEFAULTS["reshard_after_forward"]
             else repr(policy.reshard_argument)),
            ("mp_policy", self.mp_policy),
            ("offload_policy", _offload(policy.offload)),
            ("shard_placement_fn", ("experts", op) if op.experts else
             ("placements", op.placements) if op.placements else None),
            ("ignored_params", ("ignored", op.ignored) if op.ignored else None),
        ]

    def kwargs(self, expr: Callable[[str], str], hoisted: dict[str, str]) -> list[str]:
        out = []
        for key, value in self.args:
            if value is None:
                continue  # fully_shard's own default: leave it out, as a person would
            if isinstance(value, tuple):
                kind, items = value
                if kind == "placements":
                    value = "placement_fn({" + ", ".join(f"{expr(n)}: {d}" for n, d in items) + "})"
                elif kind == "experts":  # a per-parameter mesh: the experts on the expert view's FSDP axes
                    value = ("expert_placement_fn({" + ", ".join(f"{expr(n)}: {d}" for n, d in items.experts)
                             + f"}}, expert_fsdp_mesh, {self.args[0][1]}"
                             + (", {" + ", ".join(f"{expr(n)}: {d}" for n, d in items.placements) + "})"
                                if items.placements else ")"))
                else:
                    value = "{" + ", ".join(expr(n) for n in items) + "}"
            out.append(f"{key}={hoisted.get(value, value)}")
        return out


# ===================================================================== provenance comments

_GROUPS = (("precision", ("param_dtype", "reduce_dtype", "output_dtype", "cast_inputs")),
           ("reshard", ("reshard_after_forward",)), ("offload", ("offload", "pin_memory")))


def _where(span, rule: str) -> str:
    return f"{rule} ({span.file}:{span.line})" if span is not None else rule


def _unit_comments(op: FullyShard) -> tuple[str, ...]:
    if op.is_root:
        head = f"{_where(op.span, op.rule or 'root')}: the whole model, last" if op.span else \
            "the root: the whole model, last (planc's default)"
    else:
        head = _where(op.span, op.rule or f"unit {op.name}")
    origins = []
    for label, keys in _GROUPS:
        settings: list[Setting] = [op.policy.origins[k] for k in keys if op.policy.origins[k].span is not None]
        where = sorted({_where(s.span, s.rule) for s in settings})
        if where:
            origins.append(f"{label} from {', '.join(where)}")
    for label, table in (("placement", op.placement_spans), ("ignored", op.ignored_spans)):
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


class _Submeshes:
    """The submeshes the ops run on, each sliced once from the root `mesh` (as the runtime does,
    `runtime._submesh`): every op's own axes, named as hand-written code names them (`mesh` for
    the whole mesh, `tp_mesh` for the tensor axis, `dp_mesh` for the data-parallel axes)."""

    def __init__(self, program):
        self.whole = tuple(a.name for a in program.mesh.device_axes)
        self.tensor = program.mesh.axis_name(Role.TENSOR)
        self.context = program.mesh.axis_name(Role.CONTEXT)
        self.dp = program.mesh.fsdp_axis_names
        self.flattened = program.mesh.flattened
        used = ([(op.axis,) for op in program.of_type(Parallelize)] + [(op.axis,) for op in program.of_type(AttendOverContext)]
                + [op.axes for op in program.units])
        self.used = list(dict.fromkeys(used))

    def _whole(self, axes: tuple[str, ...]) -> bool:
        return axes == self.whole or (len(axes) == 1 and len(self.whole) == 1)

    def name(self, axes: tuple[str, ...]) -> str:
        if self._whole(axes):
            return "mesh"
        if axes == (self.tensor,):
            return "tp_mesh"
        if axes == (self.context,):
            return "cp_mesh"
        return "dp_mesh" if axes == self.dp else "mesh_" + "_".join(axes)

    def definitions(self) -> list[str]:
        """`name = mesh[...]` for each submesh an op uses, the tensor one first; the flattened
        axes (shard x context) first of all, as the runtime flattens them (`Mesh.flattened`)."""
        out = []
        for name, joined in self.flattened.items():
            out.append(f"# NOTE: FSDP over {' x '.join(joined)} as one axis: on the 2-D submesh it would be HSDP")
            flat = f"mesh[{joined!r}]._flatten({name!r})"
            out.append(f"{self.name((name,))} = {flat}" if (name,) in self.used else flat)
        for axes in sorted(self.used, key=lambda a: a != (self.tensor,)):
            if len(axes) == 1 and axes[0] in self.flattened:
                continue
            if not self._whole(axes):
                index = repr(axes[0]) if len(axes) == 1 else repr(axes)
                out.append(f"{self.name(axes)} = mesh[{index}]")
        return out


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
    plan_path = plan_path or compiled.plan.file
    model_ref = model_ref or compiled.plan.model_ref or type(model).__name__
    if len(compiled.job.parts) > 1:  # pipeline stages: planc/backends/emit_pipeline.py
        from planc.backends.emit_pipeline import emit_pipeline
        return emit_pipeline(compiled, plan_path, model_ref)
    job = READER.compiled(compiled)
    program = job.program
    body = _body(compiled, program, model)
    return _module_text(program, body, plan_path, model_ref, job.step_op(ShardBatch)) + _accumulate_source(job.schedule)


def _accumulate_source(schedule) -> str:
    """`accumulate(model, *batch)` for a plan with several microbatches per step (what
    `AppliedPlan.accumulate` does); nothing for one microbatch."""
    k = schedule.microbatches
    if k == 1:
        return ""
    sync = "True" if schedule.gradient_sync == "every" else f"mb == {k - 1}"
    why = ("gradients reduced after every microbatch" if schedule.gradient_sync == "every" else
           "gradients reduced only after the last\n    (FSDP2 keeps the unsharded ones until then)")
    return f"""

def accumulate(model, *batch):
    \"\"\"The plan's step: {k} microbatches, {why}.

    Yields each microbatch's slices of `batch` (split on dim 0); divide each loss by {k}:

        for tokens, labels in accumulate(model, tokens, labels):
            (loss_fn(model(tokens), labels) / {k}).backward()
        optimizer.step()
    \"\"\"
    from torch.distributed.fsdp import FSDPModule

    chunks = [t.chunk({k}) for t in batch]
    for mb in range({k}):
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_requires_gradient_sync({sync}, recurse=False)
        yield tuple(c[mb] for c in chunks)
"""


def _sections(program) -> list[tuple[tuple, list]]:
    """The ops in program order, as sections of one kind each (the program keeps kinds together)."""
    sections: list[tuple[tuple, list]] = []
    for op in program.ops:
        if not isinstance(op, _PRINTABLE):  # READER refused it above; kept for a kind added to READER only
            raise UnknownKind(READER.interpreter, op)
        kind = (type(op), getattr(op, "direction", None))
        if sections and sections[-1][0] == kind:
            sections[-1][1].append(op)
        else:
            sections.append((kind, [op]))
    return sections


def _body(compiled: CompiledPlan, program, model, expert_mesh_given: bool = False) -> list[str]:
    """The lines of `apply_plan`'s body: the submeshes, then each section of ops as calls.
    `expert_mesh_given`: the body takes the expert view as an argument `expert_mesh` (a pipeline's
    `build_pipeline` builds it once on every rank) instead of building it."""
    meshes = _Submeshes(program)
    units = [_Unit(op, meshes.name(op.axes)) for op in program.units]
    handle = {op.name: ("" if op.is_root else op.modules[0]) for op in program.units}
    body: list[str] = []
    ind = "    "
    if program.of_type(Parallelize):
        body += [f"{ind}# NOTE: tensor parallelism first, on the tensor axis; FSDP then shards on the data-parallel",
                 f"{ind}# submesh of the same root mesh."]
    body += [f"{ind}{line}" for line in meshes.definitions()]
    if program.of_type(Checkpoint) or program.of_type(Compile):
        body.append(f"{ind}# NOTE: checkpointing and compile wrap the plain modules before `fully_shard` hooks them.")
    for (kind, direction), ops in _sections(program):
        if kind is Parallelize:
            body += _emit_calls([_Call((op.module,), lambda e, op=op: f"parallelize_module({e(op.module)}, "
                                       f"{meshes.name((op.axis,))}, "
                                       f"{style_source(op.style)})", (_where(op.origin.span, op.origin.rule),))
                                 for op in ops], model, ind)
            for alias, canon in tensor_reties(program, compiled.graph):
                body.append(f"{ind}# NOTE: parallelize_module gives each owner of a tied parameter its own copy: tie again")
                body += _wrap(f"{expression('model', model, alias)} = {expression('model', model, canon)}", ind)
        elif kind is AttendOverContext:
            body += ["", f"{ind}# context parallelism: causal SDPA gathers K/V over the context axis (hooks; each",
                     f"{ind}# forward needs `positions=`, see `shard_batch` below)"]
            body += _emit_calls([_Call((op.module,), lambda e, op=op: f"attend_over_context({e(op.module)}, "
                                       f"{meshes.name((op.axis,))}.get_group())",
                                       (_where(op.origin.span, op.origin.rule),)) for op in ops], model, ind)
        elif kind is DispatchExperts:
            body += _experts_section(program, ops, model, ind, expert_mesh_given)
        elif kind is Checkpoint:
            body += _emit_calls([_Call((op.module,), lambda e, op=op: f"checkpoint({e(op.module)}"
                                       + (", context_fn=selective_checkpoint_context)" if op.mode == "selective" else ")"),
                                       (_where(op.origin.span, op.origin.rule),)) for op in ops], model, ind)
        elif kind is Compile:
            body += _emit_calls([_Call((op.module,), lambda e, op=op: f"{e(op.module)}.compile(" +
                                       ", ".join(f"{k}={v!r}" for k, v in op.options) + ")",
                                       (_where(op.origin.span, op.origin.rule),)) for op in ops], model, ind)
        elif kind is FullyShard:
            body += _fully_shard_section(ops, units, model, ind, bool(body))
        elif kind is SetPrefetch:
            body += ["", f"{ind}# explicit {direction} prefetch (all-gather these units ahead)"]
            pre = [_Call((handle[op.unit], *[handle[t] for t in op.targets]) if handle[op.unit] else (),
                         lambda e, s=handle[op.unit], ts=tuple(handle[t] for t in op.targets), d=direction:
                         f"{e(s)}.set_modules_to_{d}_prefetch([{', '.join(e(t) for t in ts)}])")
                   for op in ops]
            body += _emit_calls(pre, model, ind)
        else:  # UnitMethod
            body += ["", f"{ind}# FSDP2 settings made by method calls, once every unit is sharded"]
            body += _emit_calls([_Call((handle[op.unit],) if handle[op.unit] else (),
                                       lambda e, op=op: f"{e(handle[op.unit])}.{op.method}("
                                       + ", ".join(_literal(a) for a in op.args) + ")",
                                       (_where(op.origin.span, op.origin.rule),)) for op in ops], model, ind)
    return body + [f"{ind}return model"]


def expert_mesh_call(program, axis: str) -> str:
    """The call that builds the expert view of `mesh`'s ranks (with a pipeline axis: this stage's submesh)."""
    view = tuple(a.name for a in program.mesh.device_axes if a.role is Role.REPLICATE)
    pipeline = program.mesh.axis_name(Role.PIPELINE)
    return (f"expert_mesh_of(mesh, {program.mesh.axis(Role.EXPERT).size}, {view + (EFSDP, axis)!r}"
            + (f", pipeline={pipeline!r})" if pipeline is not None else ")"))


def _experts_section(program, ops, model, ind: str, given: bool = False) -> list[str]:
    """The expert view as a mesh of the same ranks (or `given` as the argument `expert_mesh`), and
    each experts container dispatched on it."""
    view = tuple(a.name for a in program.mesh.device_axes if a.role is Role.REPLICATE)
    names = view + (EFSDP, ops[0].axis)
    expert = program.mesh.axis(Role.EXPERT).size
    fsdp = next((u.expert_axes for u in program.units if u.expert_axes), (EFSDP,))
    fsdp_index = repr(fsdp[0]) if len(fsdp) == 1 else repr(fsdp)
    lines = ["", f"{ind}# expert parallelism: the expert view of the same ranks, {' x '.join(names)}; each expert rank",
             f"{ind}# keeps experts / {expert} whole experts, their rows arrive and leave by all-to-all",
             f"{ind}# `expert_mesh`: this stage's expert view, built by build_pipeline on every rank" if given else
             f"{ind}expert_mesh = {expert_mesh_call(program, ops[0].axis)}",
             f"{ind}expert_fsdp_mesh = expert_mesh[{fsdp_index}]"]
    if ops[0].tensor is not None:
        lines += [f"{ind}# with tensor parallelism each MoE layer runs on its tensor rank's part of the group's tokens",
                  f"{ind}expert_tp_mesh = mesh[{ops[0].tensor!r}]"]

    def call(e, op) -> str:
        split = "" if op.tensor is None else f", expert_tp_mesh, {e(op.layer)}"
        return (f"dispatch_experts({e(op.module)}, expert_mesh, {op.axis!r}{split}"
                f"{'' if op.averaged else ', averaged=False'})")
    return lines + _emit_calls([_Call((op.module,) if op.layer is None else (op.module, op.layer),
                                      lambda e, op=op: call(e, op), (_where(op.origin.span, op.origin.rule),))
                                for op in ops], model, ind)


def _fully_shard_section(ops, units: list["_Unit"], model, ind: str, after_code: bool) -> list[str]:
    """The `fully_shard` calls, bottom-up, a `MixedPrecisionPolicy` several calls share named once."""
    counts: dict[str, int] = {}
    for u in units:
        if u.mp_policy is not None:
            counts[u.mp_policy] = counts.get(u.mp_policy, 0) + 1
    shared = [v for v, n in counts.items() if n > 1]
    hoisted = {v: ("mp_policy" if len(shared) == 1 else f"mp_policy_{i}") for i, v in enumerate(shared, 1)}
    unit_of = {u.op.name: u for u in units}
    lines = [""] if after_code else []
    for value, name in hoisted.items():
        lines += _wrap(f"{name} = {value}", ind)
    lines.append(f"{ind}# NOTE: bottom-up: a call owns the parameters of its subtree not claimed by an earlier call.")
    calls = []
    for op in ops:
        u = unit_of[op.name]

        def render(e, u=u):
            op = u.op
            target = "model" if op.is_root else (
                "[" + ", ".join(e(m) for m in op.modules) + "]" if op.is_group else e(op.modules[0]))
            return f"fully_shard({', '.join([target] + u.kwargs(e, hoisted))})"
        paths = () if op.is_root else tuple(op.modules) + tuple(u.param_paths)
        calls.append(_Call(paths, render, _unit_comments(op)))
    return lines + _emit_calls(calls, model, ind)


def _module_text(program, body: list[str], plan_path: str, model_ref: str, shard_ops: tuple = ()) -> str:
    """The module around `apply_plan`'s body: docstring, the imports its code uses, helpers."""
    uses = "\n".join(line for line in body if not line.lstrip().startswith("#"))  # code, not comments
    imports = ["import torch"] if "torch." in uses else []
    if program.of_type(Checkpoint):
        imports.append("from torch.distributed._composable import checkpoint")
    # NOTE: whole names: `OffloadPolicy(` is also the tail of `CPUOffloadPolicy(`
    fsdp = sorted({n for n in ("CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy")
                   if re.search(rf"\b{n}\(", uses)})
    imports.append("from torch.distributed.fsdp import " + ", ".join(fsdp + ["fully_shard"]))
    placements = sorted({n for n in ("Partial", "Replicate", "Shard") if re.search(rf"\b{n}\(", uses)})
    if "placement_fn(" in uses:  # the helper printed above the function builds `Shard(dim)`
        placements = sorted({*placements, "Shard"})
    if placements:
        imports.append("from torch.distributed.tensor import " + ", ".join(placements))
    if program.of_type(Parallelize):
        styles = sorted({n for n in _TORCH_STYLES if re.search(rf"\b{n}\(", uses)})
        imports.append("from torch.distributed.tensor.parallel import " + ", ".join(styles + ["parallelize_module"]))
        if "ReplicateParallel(" in uses:
            imports.append("from planc.backends.runtime import ReplicateParallel  # torchtitan's NoParallel")
    shard_batch = _shard_batch_source(shard_ops)
    if program.of_type(AttendOverContext) or shard_batch:
        imports.append("from planc.backends.context import " + ", ".join(
            (["attend_over_context"] if program.of_type(AttendOverContext) else [])
            + (["shard", "shard_positions"] if shard_batch else [])))
    if program.of_type(DispatchExperts):
        imports.append("from planc.backends.experts import dispatch_experts, expert_mesh_of, expert_placement_fn")
    selective = "context_fn=selective_checkpoint_context" in uses
    if selective:
        imports.append("from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts")
        if "import torch" not in imports:
            imports.insert(0, "import torch")
    names = tuple(a.name for a in program.mesh.device_axes)
    mesh_doc = (f"a {len(names)}-D device mesh (" + ", ".join(f'"{n}"' for n in names) + ")") if len(names) > 1 \
        else "a 1-D device mesh"
    ours = [i for i in imports if i.startswith("from planc")]  # first-party imports after a blank line
    imports = [i for i in imports if i not in ours] + ([""] + ours if ours else [])
    head = [
        f'"""FSDP2 sharding of `{model_ref}` as `{plan_path}` plans it: {len(program.units)} units.',
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
    if selective:
        text += "\n\n" + _selective_source()
    text += "\n\n\ndef apply_plan(model, mesh):\n"
    text += f'    """Shard `model` in place on `mesh` ({mesh_doc}) and return it."""\n'
    return text + "\n".join(body) + "\n" + shard_batch


def _shard_batch_source(ops: tuple) -> str:
    """`shard_batch(tokens, labels, mesh)` for the job's `ShardBatch` step op ("" without one):
    what `AppliedPlan.shard_batch` does, for a hand-written training loop."""
    if not ops:
        return ""
    op = ops[0]
    dims = dict(op.tensors)
    return f'''

def shard_batch(tokens, labels, mesh):
    """This rank's {op.balance} share of a (batch, seq) batch on the `{op.axis}` axis, and its global positions.

    Call the model as `model(tokens, positions=positions)`; the loss is the mean over this
    rank's tokens (FSDP averages the gradients over the flattened data x context ranks).
    """
    cp_mesh = mesh[{op.axis!r}]
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    positions = shard_positions(tokens.shape[{dims["tokens"]}], cp, rank).to(tokens.device)
    return shard(tokens, {dims["tokens"]}, cp, rank), shard(labels, {dims["labels"]}, cp, rank), positions
'''


_PRINTABLE = (Parallelize, AttendOverContext, DispatchExperts, Checkpoint, Compile, FullyShard, SetPrefetch, UnitMethod)
# What emit prints: every op as `apply_plan`'s calls; the step (forward, backward, the loss in
# `loss_parallel()`) is the user's training loop, as with `planc.apply`; several microbatches
# per step add `accumulate(model, *batch)`, as `AppliedPlan.accumulate`; `ShardBatch` a
# `shard_batch` function that loop calls on each batch.
READER = Reader("emit", _PRINTABLE, (FORWARD, FULL_BACKWARD), (LossParallel, ShardBatch))

_TORCH_STYLES = tuple(r.torch_class for r in ROWS if r.torch_own)  # what `torch.distributed.tensor.parallel` gives


def _placement(layout: Layout | None) -> str:
    if layout is None:
        return "None"
    return f"Shard({layout.dim})" if layout.kind == "shard" else f"{layout.kind.capitalize()}()"


def style_source(style: TensorStyle) -> str:
    """The torch `ParallelStyle` constructor call a plan style stands for (what the runtime builds)."""
    row = STYLES[style.kind]
    args: list[str] = []
    linear = row.one_layout
    for name, layouts in (("input_layouts", style.input_layouts), ("desired_input_layouts", style.desired_input_layouts),
                          ("output_layouts", style.output_layouts), ("desired_output_layouts", style.desired_output_layouts)):
        if layouts is not None:
            one = linear or len(layouts) == 1
            args.append(f"{name}=" + (_placement(layouts[0]) if one else
                                      "(" + ", ".join(_placement(x) for x in layouts) + ("," if len(layouts) == 1 else "") + ")"))
    for name, pairs in (("input_kwarg_layouts", style.input_kwarg_layouts),
                        ("desired_input_kwarg_layouts", style.desired_input_kwarg_layouts)):
        if pairs:
            args.append(f"{name}={{" + ", ".join(f"{k!r}: {_placement(v)}" for k, v in pairs) + "}")
    if style.sequence_dim is not None:
        args.append(f"sequence_dim={style.sequence_dim}")
    if style.use_local_output is not None:
        args.append(f"use_local_output={style.use_local_output}")
    return f"{row.torch_class}({', '.join(args)})"


def _selective_source() -> str:
    """`selective` checkpointing as planc/lower/checkpointing.py defines it: its op set and its
    two functions, printed from their source (one definition for apply, the trace and emit)."""
    import inspect

    from planc.lower import checkpointing
    ops = sorted(f"torch.ops.aten.{op.__name__}" for op in checkpointing.SAVED_OPS)
    lines = ["# Ops whose outputs `selective` checkpointing keeps (planc/lower/checkpointing.py)",
             "SAVED_OPS = frozenset({", *(f"    {op}," for op in ops), "})", "", "", ""]
    return "\n".join(lines) + "\n\n\n".join(inspect.getsource(f).rstrip() for f in (
        checkpointing.save_compute_heavy_ops, checkpointing.selective_checkpoint_context))
