"""The shape-level check by simulation: one training step of the whole plan on a fake process group.

`planc check --simulate` runs it. The plan is applied by the real runtime (`planc.apply`:
tensor parallelism on the tensor submesh, then `fully_shard` on the data-parallel one) to
the model built on meta, in a fake process group of the plan's world size (torch's
`FakeStore`, backend "fake": any size, one process, rank 0, and the last rank too when a
tensor-parallel dim is split unevenly); the parameters become fake
tensors (`FakeTensorMode`) and one step runs: forward, the loss, backward,
`clip_grad_norm_` and the optimizer step. Fake tensors carry shapes and no data, so a
reshape that cannot work at this tensor-parallel degree fails here exactly as it would on
a cluster (tp-facts.md: a 4-head block at tp = 8 fails in one process).

A failure is never shown as a traceback: it becomes a located diagnostic on the plan line
that caused it. While the step runs, global module hooks keep the stack of modules in
forward (the module that was running when the exception came), the input shapes of each
module, and the tensor-parallel modules that finished (with their output's local and
global shapes); in backward torch's `ModTracker` says which module's backward was running.
The module is mapped to a `Parallelize` op of the lowered program, whose `origin` is the
`parallel` statement:

    P440  the step fails at a tensor-parallel module (e.g. a view with the global head count)
    P441  the tensor-parallel degree does not divide the head count (read off the failing view)
    P442  a style or `fully_shard` could not be applied to its module (the op that was running)
    P443  clipping or the optimizer step fails: parameters on different meshes (suggest `replicate`)
    P444  the step fails where no tensor-parallel rule is involved (the model or the input)
"""

from __future__ import annotations

import logging
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from planc.checks.tensor import STATIC_TENSOR_CODES
from planc.checks.tensor_holes import HOLE_CODES
from planc.diagnostics import Diagnostic, PlanError, Span
from planc.estimate.trace import Example, LossFn, default_loss, known_cause
from planc.lower.job import FORWARD, FULL_BACKWARD, LossParallel, Reader, ShardBatch
from planc.lower.program import (
    AttendOverContext,
    Checkpoint,
    Compile,
    DispatchExperts,
    FullyShard,
    Parallelize,
    SetPrefetch,
    UnitMethod,
)
from planc.resolve.mesh import Role
from planc.resolve.styles import OUT, STYLES

__all__ = ["check_step", "default_input_shape", "simulation_world"]

# `shape '[2, 16, -1, 16]' is invalid for input of size 256` (view / reshape)
_VIEW = re.compile(r"shape '\[([-0-9, ]+)\]' is invalid for input of size (\d+)")
_HEAD_ATTRS = (("query", ("num_attention_heads", "num_heads", "n_heads", "n_head")),
               ("KV", ("num_key_value_heads", "num_kv_heads", "n_kv_heads")))


def simulation_world(mesh) -> int:
    """The world size to simulate a plan at when none is given: the axes that multiply into the
    world, fixed, with 2 for a `*` axis; with a fixed expert axis (it borrows its ranks), the `*`
    axis is the smallest that leaves the experts' FSDP degree at 2."""
    from planc.resolve.mesh import RULE, Role

    axes = [a for a in mesh.axes if RULE[a.role].multiplies]
    fixed = math.prod(a.size for a in axes if a.size is not None)
    if not any(a.size is None for a in axes):
        return fixed
    star = 2
    expert = mesh.axis(Role.EXPERT)
    if expert is not None and expert.size is not None:
        lent = math.prod(a.size for a in axes if a.role in RULE[Role.EXPERT].borrows and a.size is not None)
        while (lent * star) % (2 * expert.size):
            star += 1
    return fixed * star


def default_input_shape(tp: int, cp: int = 1) -> tuple[int, int]:
    """2 sequences of 16 tokens, the sequence rounded up to a multiple of 2 x cp x tp (context parallelism
    cuts it into 2 x cp chunks, sequence parallelism splits a rank's share by tp)."""
    step = 2 * cp * tp if cp > 1 else tp
    return 2, -(-16 // step) * step


def _describe(t: Any) -> str | None:
    """`(2, 16, 32)` for a tensor; `(2, 16, 32) local of (2, 16, 64), (Shard(dim=2),)` for a DTensor."""
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        return f"{tuple(t.to_local().shape)} local of {tuple(t.shape)} {tuple(t.placements)}"
    if isinstance(t, torch.Tensor):
        return str(tuple(t.shape))
    return None


def _shapes(value: Any) -> list[str]:
    from torch.utils._pytree import tree_flatten
    return [d for d in (_describe(x) for x in tree_flatten(value)[0]) if d is not None][:4]


@dataclass
class _Tracker:
    """Global forward hooks: the modules in forward, each module's last input shapes, finished TP modules."""

    paths: dict[int, str]
    tensor_parallel: set[str]
    stack: list[str] = field(default_factory=list)
    inputs: dict[str, list[str]] = field(default_factory=dict)
    finished: list[tuple[str, list[str]]] = field(default_factory=list)  # (TP module, output shapes), in order

    def pre(self, module, args, kwargs=None):
        path = self.paths.get(id(module))
        if path is not None:
            self.stack.append(path)
            self.inputs[path] = _shapes((args, kwargs or {}))

    def post(self, module, args, output):
        path = self.paths.get(id(module))
        if path is not None:
            if self.stack and self.stack[-1] == path:
                self.stack.pop()
            if path in self.tensor_parallel:
                self.finished.append((path, _shapes(output)))

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        self._handles = [register_module_forward_pre_hook(self.pre), register_module_forward_hook(self.post)]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def _within(path: str, ancestor: str) -> bool:
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def _model_span(plan) -> Span | None:
    # the last `model` line is the one in force (an including plan's overrides an included one's)
    stmt = next((s for s in reversed(plan.statements) if getattr(s, "ref", None) is not None), None)
    return stmt.span if stmt is not None else (plan.statements[0].span if plan.statements else None)


def _generalize(paths: list[str]) -> list[str]:
    """`layers.0.norm`, `layers.1.norm` -> `layers.*.norm`: the selectors a fix would write, in first-seen order."""
    return list(dict.fromkeys(".".join("*" if part.isdigit() else part for part in p.split(".")) for p in paths))


def _op_text(op) -> str:
    return f"`{op.module or '<root>'}` {op.style.kind}"


# What the shape check runs: the applied plan and one forward, loss (in `loss_parallel()`),
# backward and optimizer step on fake tensors; with a context axis the batch cut by
# `applied.shard_batch` (the fake group's all-gathers return the right shapes, not the data);
# expert parallelism's dispatch with balanced routing (a fake process group cannot fill the
# split sizes: `experts.balanced_routing`).
READER = Reader("the shape check", (FullyShard, Parallelize, AttendOverContext, DispatchExperts, Checkpoint, Compile,
                                    SetPrefetch, UnitMethod), (FORWARD, FULL_BACKWARD), (LossParallel, ShardBatch))


class _Step:
    """One simulated step of an applied plan, with what is needed to say where it failed."""

    def __init__(self, compiled, model: nn.Module, world: int, tp: int, rank: int = 0):
        self.compiled, self.model, self.world, self.tp = compiled, model, world, tp
        self.ops = {op.module: op for op in READER.compiled(compiled).program.of_type(Parallelize)}
        self.where = (f"at world {world}" + (f" (tensor {tp})" if compiled.mesh.axis(Role.TENSOR) else "")
                      + (f" on rank {rank}, which holds the smallest uneven shards" if rank else ""))

    # ------------------------------------------------------------ which rule
    def culprit(self, module: str | None, finished: list[tuple[str, list[str]]]):
        """The `Parallelize` op most likely behind a failure in `module`: its own, the last TP
        module that finished inside it, the nearest TP ancestor, else the last TP module that ran."""
        if module is None:  # outside every module: the loss, on the output the last TP module made
            return (self.ops[finished[-1][0]], finished[-1][1]) if finished else (None, None)
        if module in self.ops:
            return self.ops[module], None
        inside = [(p, s) for p, s in finished if _within(p, module)]
        if inside:
            return self.ops[inside[-1][0]], inside[-1][1]
        parts = module.split(".")
        for i in range(len(parts) - 1, -1, -1):
            anc = ".".join(parts[:i])
            if anc in self.ops:
                return self.ops[anc], None
        if finished:
            return self.ops[finished[-1][0]], finished[-1][1]
        return None, None

    def _heads(self, module: str) -> list[tuple[str, int]]:
        """Head counts read off the failing module, its ancestors, or the model's config."""
        found = []
        parts = module.split(".") if module else []
        owners = [self.model.get_submodule(".".join(parts[:i])) for i in range(len(parts), -1, -1)]
        for what, names in _HEAD_ATTRS:
            for owner in owners:
                holders = (owner, getattr(owner, "config", None))
                value = next((getattr(h, n) for h in holders if h is not None for n in names
                              if isinstance(getattr(h, n, None), int) and not isinstance(getattr(h, n), bool)), None)
                if value is not None:
                    found.append((what, value))
                    break
        return found

    def _cache_help(self) -> tuple[str, ...]:
        """Why a checkpointed Hugging Face model with `use_cache=True` fails in backward, and the fix."""
        from planc.lower.program import Checkpoint
        if not getattr(getattr(self.model, "config", None), "use_cache", False):
            return ()
        if not self.compiled.program.of_type(Checkpoint):
            return ()
        return ("the model's config has `use_cache=True`: each forward fills a KV cache, and activation "
                "checkpointing's recomputation fills it again, so the recomputed keys are longer than the saved "
                "ones; set `model.config.use_cache = False` for training (planc does so for `hf:` models)",)

    # ------------------------------------------------------------ diagnostics
    def forward_failure(self, err: BaseException, phase: str, module: str | None, tracker: _Tracker) -> Diagnostic:
        op, out_shapes = self.culprit(module, tracker.finished)
        reason = _first_line(err)
        at = f"`{module or '<root>'}`" if module is not None else "the model's output"
        if phase == "loss" and op is not None:
            lp = " inside `loss_parallel()`" if op.style.loss_parallel else ""
            return Diagnostic(
                code="P440", severity="error", span=op.span,
                message=f"one training step fails in the simulation {self.where}: the loss{lp} cannot be computed on "
                        f"the output {_op_text(op)} leaves: {reason}",
                label=f"{_op_text(op)} here",
                notes=tuple(f"output of `{op.module}` ({op.style.kind}): {s}" for s in (out_shapes or [])[:1]),
                help=("for a loss on vocabulary-sharded logits write `{ loss_parallel }` (output shard(-1), not local: the "
                      "training loop computes the loss in `applied.loss_parallel()`); else `{ output replicate }`",))
        if op is None:
            return Diagnostic(
                code="P444", severity="error", span=_model_span(self.compiled.plan),
                message=f"one training step fails in the simulation {self.where}, in the {phase} of {at}, where no "
                        f"`parallel` rule is involved: {reason}",
                label="this model",
                notes=(f"inputs of {at}: {', '.join(tracker.inputs[module])}",)
                if module is not None and tracker.inputs.get(module) else (),
                help=self._cache_help() or ((known_cause(reason),) if known_cause(reason) else ()) or (
                    "the model does not run on this input: pass `--input-shape BxS` (token ids) that fits it",
                    "or run the model once without the plan to see its own error"))
        notes = [f"{phase} of {at}: {reason}"]
        if module is not None and tracker.inputs.get(module):
            notes.append(f"inputs of {at}: {', '.join(tracker.inputs[module])}")
        if out_shapes:
            notes.append(f"output of `{op.module}` ({op.style.kind}): {', '.join(out_shapes)}")
        view = _VIEW.search(str(err))
        heads = self._heads(module or "")
        indivisible = [(w, n) for w, n in heads if n % self.tp]
        tensor_axis = self.compiled.mesh.axis_name(Role.TENSOR)
        if view is not None and STYLES[op.style.kind].splits == OUT:  # colwise: heads split over the ranks
            dims = [int(x) for x in view.group(1).split(",")]
            local = int(view.group(2))
            head_dim = dims[-1] if len(dims) >= 2 and dims[-1] > 0 else None
            known = math.prod(d for d in dims[:-2] if d > 0) if len(dims) > 2 else 1
            features = local // known if known else None
            global_features = features * self.tp if features is not None else None
            n_heads = global_features // head_dim if global_features and head_dim and global_features % head_dim == 0 else None
            if -1 in dims and n_heads is not None and n_heads % self.tp:
                counted = [(w, n) for w, n in indivisible] or [("", n_heads)]
                what = " and ".join(f"{n} {w} heads".replace("  ", " ") for w, n in counted)
                divisors = [d for d in range(1, counted[0][1] + 1) if counted[0][1] % d == 0]
                return Diagnostic(
                    code="P441", severity="error", span=op.span,
                    message=f"tensor parallelism {self.where} splits `{op.module}` into {self.tp} but it has {what}: "
                            f"each rank gets {features} of {global_features} features, not a whole number of heads of "
                            f"{head_dim}",
                    label=f"{_op_text(op)} here", notes=tuple(notes),
                    help=(f"use a tensor size that divides {counted[0][1]}: {', '.join(map(str, divisors))} "
                          f"(`{tensor_axis} = {max(d for d in divisors if d <= self.tp)}` in the mesh)",
                          f"or leave `{op.module}` out of tensor parallelism"))
            if -1 not in dims and n_heads is not None and len(dims) >= 2 and dims[-2] == n_heads:
                given = dims[-2]
                return Diagnostic(
                    code="P440", severity="error", span=op.span,
                    message=f"one training step fails in the simulation {self.where}: the forward of {at} reshapes "
                            f"the output of `{op.module}` to {given} heads, the global count, but {op.style.kind} leaves "
                            f"{given // self.tp if given % self.tp == 0 else f'{given}/{self.tp}'} per rank",
                    label=f"{_op_text(op)} here", notes=tuple(notes),
                    help=(f"make the model's forward use the local head count: `view(b, s, -1, {head_dim})` "
                          f"(torchtitan, Hugging Face), or set its head counts to n_heads // {self.tp} after "
                          "parallelizing (the PyTorch TP tutorial)",
                          f"or leave `{op.module}` out of tensor parallelism"))
        if "mixed torch.Tensor and DTensor" in str(err) and module is not None and op.module != module:
            return Diagnostic(
                code="P440", severity="error", span=op.span,
                message=f"one training step fails in the simulation {self.where}: `{module}` has tensor-parallel "
                        f"parameters from {_op_text(op)} but gets plain tensors as inputs",
                label=f"{_op_text(op)} here", notes=tuple(notes),
                help=(f"a style converts the inputs of the module it is on, and `{op.module}` is not the module that "
                      f"is called: put the rule on `{module}` (e.g. `parallel {_generalize([module])[0]} "
                      f"{op.style.kind}`)",))
        if indivisible:
            what = " and ".join(f"{n} {w} heads" for w, n in indivisible)
            return Diagnostic(
                code="P441", severity="error", span=op.span,
                message=f"tensor parallelism {self.where} does not divide the {what} of {at}: the step fails in "
                        f"{phase}",
                label=f"{_op_text(op)} here", notes=tuple(notes),
                help=(f"use a tensor size that divides {indivisible[0][1]}", f"or leave `{op.module}` out of tensor parallelism"))
        return Diagnostic(
            code="P440", severity="error", span=op.span,
            message=f"one training step fails in the simulation {self.where}, in the {phase} of {at}, after "
                    f"{_op_text(op)}: {reason}",
            label=f"{_op_text(op)} here", notes=tuple(notes),
            help=("the module's forward must work on the local shapes this style leaves it (colwise: out features / tp "
                  "per rank; rowwise: in features / tp), and layouts must chain (colwise, then rowwise)",
                  f"or leave `{op.module}` out of tensor parallelism"))

    def mesh_failure(self, err: BaseException, phase: str) -> Diagnostic:
        """Clipping or the optimizer step: usually parameters that are not all on the same meshes."""
        from torch.distributed.tensor import DTensor
        tensor_axis = self.compiled.mesh.axis_name(Role.TENSOR)
        off = []
        for name, p in self.model.named_parameters():
            names = tuple(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
            if tensor_axis is not None and tensor_axis not in names:
                off.append(name.rpartition(".")[0] or "<root>")
        modules = _generalize(off)
        span = self.compiled.mesh.span or _model_span(self.compiled.plan)
        shown = ", ".join(f"`{m}`" for m in modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
        return Diagnostic(
            code="P443", severity="error", span=span,
            message=f"the {phase} fails in the simulation {self.where}: {_first_line(err)}",
            label="this mesh",
            notes=((f"parameters not on the tensor axis: {shown}",) if modules else ()),
            help=((f"give each a style on the tensor axis, e.g. `parallel {modules[0]} replicate` "
                   "(torchtitan's NoParallel), so every parameter lives on the same meshes",) if modules else
                  ("every parameter must live on the same meshes: give modules left out of tensor parallelism "
                   "`replicate`",)))

    def apply_failure(self, err: BaseException) -> Diagnostic:
        """A failure inside `planc.apply`: the program op that was running, read off the traceback."""
        from planc.backends import runtime
        op = None
        tb = err.__traceback__
        while tb is not None:  # the innermost frame of `runtime.run` that holds the op it executes
            frame = tb.tb_frame
            if frame.f_code is runtime.run.__code__ and isinstance(frame.f_locals.get("op"), (Parallelize, FullyShard)):
                op = frame.f_locals["op"]
            tb = tb.tb_next
        reason = _first_line(err)
        if isinstance(op, Parallelize):
            cls = type(self.model.get_submodule(op.module)).__name__
            return Diagnostic(
                code="P442", severity="error", span=op.span,
                message=f"{op.style.kind} cannot be applied to `{op.module}` ({cls}) {self.where}: {reason}",
                label=f"{_op_text(op)} here",
                help=("colwise and rowwise take `nn.Linear` and `nn.Embedding` modules; put the rule on those, "
                      "or use `replicate`, `sequence` or a `prepare_*` style here",))
        if isinstance(op, FullyShard):
            return Diagnostic(
                code="P442", severity="error", span=op.span,
                message=f"`fully_shard` of unit `{op.name}` fails after tensor parallelism {self.where}: {reason}",
                label="this unit",
                help=("FSDP2 composes with one tensor-parallel axis on the same root mesh; check the `parallel` "
                      "rules of the modules in this unit",))
        return Diagnostic(code="P442", severity="error", span=_model_span(self.compiled.plan),
                          message=f"applying the plan fails in the simulation {self.where}: {reason}", label="this model",
                          help=("run `planc emit` and the printed calls on the model to see where",))


def _layout(p: torch.Tensor) -> tuple:
    from torch.distributed.tensor import DTensor
    if isinstance(p, DTensor):
        return (p.device_mesh.mesh_dim_names, tuple(p.device_mesh.shape), tuple(p.placements),
                tuple(p.to_local().shape), tuple(p.shape), p.dtype)
    return (None, (), (), tuple(p.shape), tuple(p.shape), p.dtype)


def _one_per_layout(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The first parameter of each distinct layout, in order."""
    seen: dict[tuple, torch.Tensor] = {}
    for p in params:
        seen.setdefault(_layout(p), p)
    return list(seen.values())


def check_step(plan, build: Callable[[], nn.Module], world: int, *, input_shape: tuple[int, int] | None = None,
               inputs: Callable[[nn.Module], Any] | None = None, loss: LossFn | None = None,
               optimizer: str = "adamw", after_static: bool = False) -> list[Diagnostic]:
    """Apply `plan` at `world` ranks on a fake process group and run one training step on fake tensors.

    Args:
        plan: a parsed `Plan` (or a path), without errors at this world size.
        build: builds the model (called under `torch.device("meta")`).
        world: the world size to simulate.
        input_shape: batch x sequence of token ids (default: `default_input_shape(tp)`).
        inputs: instead of token ids, a factory `fn(model) -> args / kwargs / Example`.
        loss: the step's loss (default: as the memory model takes it, `default_loss`).
        optimizer: `adamw` (foreach), `sgd` or `none`.
        after_static: simulate even when the static tensor-parallel checks (P410-P422,
            `planc/checks/tensor.py`) found errors, to see what the step itself does with them
            (`planc check --simulate` never does: a static finding is reported first, and faster).

    Returns:
        The diagnostics of the step: empty when it runs; else one, located on the plan line
        behind the failure (P440-P444); or the plan's own errors at this world size, when it
        has any (then nothing is simulated).
    """
    found, uneven = _check_as(plan, build, world, 0, input_shape, inputs, loss, optimizer, after_static)
    if not found and uneven and world > 1:
        # a dim tensor parallelism does not divide: DTensor shards it unevenly and the last
        # rank holds the smallest shard, so it is simulated too
        found, _ = _check_as(plan, build, world, world - 1, input_shape, inputs, loss, optimizer, after_static)
    return found


def _check_as(plan, build, world: int, rank: int, input_shape, inputs, loss, optimizer,
              after_static: bool = False) -> tuple[list[Diagnostic], bool]:
    """`check_step` as one rank; also whether some tensor-parallel dim is split unevenly."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import planc
    from planc.analysis.simulate import fake_step_inputs, init_fake, sequence_shard, zoo_inputs
    from planc.backends.experts import balanced_routing
    from planc.backends.runtime import apply, build_mesh, run
    from planc.lower.lowering import tensor_dims

    init_fake(world, rank)
    uneven = False
    quiet = warnings.catch_warnings()
    quiet.__enter__()
    warnings.simplefilter("ignore")  # FSDP's and DTensor's advice on a step that is not a real run
    # torch logs what it is about to raise (fake tensors) and advice (DTensor): the diagnostic says it
    loggers = [logging.getLogger(name) for name in ("torch.distributed", "torch._subclasses.fake_tensor")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with torch.device("meta"):
            model = build()
        compiled = planc.compile(plan, model, world, strict=False, check_memory=False)
        errors = [d for d in compiled.errors if not (after_static and d.code in STATIC_TENSOR_CODES | HOLE_CODES)]
        if errors:
            # nothing to simulate; at a world size the caller did not compile for (the default
            # one) these are news, and located as the compile locates them
            return errors, False
        sizes = compiled.mesh.sizes(world) or {}
        tp = sizes.get("tensor", 1)
        graph = compiled.graph
        uneven = any(graph.params[n].shape[d] % tp for n, d in tensor_dims(compiled.program, graph).items())
        step = _Step(compiled, model, world, tp, rank)
        mesh = build_mesh(compiled.mesh, world, "cpu")  # NOTE: outside fake mode
        try:
            # past static errors the program is run as lowered (`apply` refuses a plan with errors)
            applied = run(compiled.program, model, mesh, compiled) if after_static else apply(model, compiled, mesh=mesh)
        except PlanError as err:  # what `apply` refuses on the live model (P6xx), located
            return list(err.errors), uneven
        except Exception as err:  # torch refused an op of the program: locate it
            return [_safely(step.apply_failure, err)], uneven
        paths = {id(m): p for p, m in model.named_modules()}
        shape = input_shape or default_input_shape(tp, sizes.get("context", 1))
        with FakeTensorMode(allow_non_fake_inputs=True) as fake, balanced_routing():
            example = sequence_shard(applied, fake_step_inputs(model, inputs or zoo_inputs(shape), fake))
            return _run(step, applied, example, loss, optimizer, paths), uneven
    finally:
        dist.destroy_process_group()
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        quiet.__exit__(None, None, None)


def _run(step: _Step, applied, example: Example, loss: LossFn | None, optimizer: str, paths) -> list[Diagnostic]:
    import torch._dynamo
    from torch.distributed._tools.mod_tracker import ModTracker

    model = step.model
    tracker = _Tracker(paths, set(step.ops))
    step_loss = loss or default_loss(model)
    params = [p for p in model.parameters() if p.requires_grad]
    phase = "forward"
    mods = ModTracker()
    try:
        # `compile` rules run eagerly here: the check is about shapes, and tracing fake DTensors
        # through dynamo would only cost time (and report dynamo's errors as the plan's)
        with tracker, mods, torch._dynamo.config.patch(disable=True):
            out = model(*example.args, **example.kwargs)
            with applied.loss_parallel():
                phase = "loss"
                value = step_loss(out, example)
                phase = "backward"
                value.backward()
    except Exception as err:
        return [_safely(step.forward_failure, err, phase, _failing_module(phase, mods, tracker), tracker)]
    return _after_backward(step, params, optimizer, applied)


def _failing_module(phase: str, mods, tracker: _Tracker) -> str | None:
    """The module running when the step failed: in forward the top of the hook stack; in backward
    the innermost module whose backward `ModTracker` saw start; None outside every module."""
    if phase == "backward":
        inner = max(mods.parents - {"Global"}, key=len, default="")
        return inner.split(".", 1)[1] if "." in inner else ("" if inner else None)
    return tracker.stack[-1] if tracker.stack else None


def _after_backward(step: _Step, params: list, optimizer: str, applied) -> list[Diagnostic]:
    """Clipping (with experts on their own mesh: `applied.clip_grad_norm_`) and the optimizer step,
    on one parameter of each layout.

    DTensor's foreach ops cost a sharding propagation per parameter (most of a 126-block
    model's step), and what can fail there -- parameters on different meshes in one call --
    depends on the layouts, not on how many share one: every layout (mesh, placements, local
    shape, dtype) is in the call.
    """
    params = _one_per_layout(params)
    phase = "gradient clipping (clip_grad_norm_)"
    try:
        grads = [p for p in params if p.grad is not None]
        if grads and applied.expert_mesh is not None:  # torch's refuses two meshes: what the user calls
            applied.clip_grad_norm_(1.0, grads)
        elif grads:
            torch.nn.utils.clip_grad_norm_(grads, 1.0, foreach=True)
        phase = f"optimizer step ({optimizer})"
        if optimizer in ("adamw", "adam"):
            cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
            opt: torch.optim.Optimizer | None = cls(params, lr=1e-3, foreach=True)
        elif optimizer == "sgd":
            opt = torch.optim.SGD(params, lr=1e-3, foreach=True)
        else:
            opt = None
        if opt is not None:
            opt.step()
    except Exception as err:
        return [_safely(step.mesh_failure, err, phase)]
    return []


def _safely(diagnose, err: BaseException, *args) -> Diagnostic:
    """`diagnose(err, *args)`; if reading the failure fails too, the plain located fact (never a traceback)."""
    try:
        return diagnose(err, *args)
    except Exception:
        step = diagnose.__self__
        return Diagnostic(code="P444", severity="error", span=_model_span(step.compiled.plan),
                          message=f"one training step fails in the simulation {step.where}: {_first_line(err)}",
                          label="this model", help=("run `planc emit` and the printed calls on the model to see where",))
