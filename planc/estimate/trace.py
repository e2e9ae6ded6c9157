"""Record one training step of a plan: unit hooks in execution order and live bytes per op.

The memory model (`planc/estimate/memory.py`) replays FSDP2's schedule over these events. With an
input, the events come from a forward and backward of the model on fake CPU tensors (shapes
only, no memory), each unit's precision and checkpointing applied; without one, from the
module order alone (activations not counted).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from planc.lower.fsdp import root_index, unit_of_module
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
from planc.resolve.step import MicrobatchError, check_splits  # noqa: F401  (MicrobatchError: re-exported)

# What the trace records: the units' hooks (`FullyShard`), checkpointing, each tensor style's
# local shapes and layouts; prefetch lists, `compile` and unit methods change no byte it records
# (the memory replay plays the prefetches). One forward and one backward of the one part, the
# loss (in `loss_parallel()`) as one tensor rank computes it; under context parallelism one
# context rank's sequence shard (the caller cuts the example: `context_local.shard_example`)
# and each styled attention's K/V gathers (`AttendOverContext`). Under expert parallelism
# (`DispatchExperts`), one expert rank's local experts and its token dispatch with balanced
# routing (`planc/estimate/expert_local.py`).
READER = Reader("the trace", (FullyShard, Checkpoint, Parallelize, AttendOverContext, DispatchExperts, Compile,
                             SetPrefetch, UnitMethod),
                (FORWARD, FULL_BACKWARD), (LossParallel, ShardBatch))


@dataclass
class Event:
    """One moment of the step: `kind` is fwd_pre/fwd_post/bwd_pre/bwd_post (of `unit`),
    `op` (live non-parameter bytes after an op), `end_backward` or `step`."""

    kind: str
    unit: int = -1
    live: int = 0       # activations + temporaries (+ unsharded grads in `grads`) after the op
    grads: int = 0      # unsharded gradient bytes among `live`
    where: str = ""     # module the op ran in
    params: tuple[str, ...] | None = None  # bwd_post: the parameters reduce-scattered (None: all)


@dataclass
class Trace:
    """The events of one forward + backward, and what drove it."""

    events: list[Event]
    input_bytes: int = 0
    source: str = "module order (no input: activations not counted)"


def compress(trace: Trace) -> Trace:
    """The trace with each run of op events (between two unit events) cut to its largest live,
    its largest live less gradients, and its last: between unit events only the live bytes
    change, so a replay's moments at the kept events are the full replay's, its peak and its
    largest activations the same. A kept op with no module of its own (`where` empty: the
    replay labels it by the last module an op named) takes the module the dropped ops before
    it in the run named, so its label is the full replay's too."""
    out: list[Event] = []
    run: list[Event] = []

    def flush():
        if not run:
            return
        keep = {id(max(run, key=lambda e: e.live)), id(max(run, key=lambda e: e.live - e.grads)), id(run[-1])}
        named = ""
        for ev in run:
            named = ev.where or named
            if id(ev) in keep:
                out.append(ev if ev.where or not named else dataclasses.replace(ev, where=named))
        run.clear()
    for ev in trace.events:
        if ev.kind == "op":
            run.append(ev)
        else:
            flush()
            out.append(ev)
    flush()
    return Trace(out, trace.input_bytes, trace.source)


def synthetic_trace(compiled) -> Trace:
    """Events in module order (pre-order forward, reverse backward), no activations."""
    graph, units = compiled.graph, READER.compiled(compiled).program.units
    of = unit_of_module(units)
    root = root_index(units)
    remaining = {i: len(u.modules) for i, u in enumerate(units) if not u.is_root}
    fwd: list[Event] = []
    post_order: list[int] = []
    started: set[int] = set()

    def visit(path: str) -> None:
        i = of.get(path)
        if i is not None and i not in started:
            started.add(i)
            fwd.append(Event("fwd_pre", i))
        if i is not None:
            fwd.append(Event("op", i, where=path))
        for child in graph.children(path):
            visit(child)
        if i is not None:
            remaining[i] -= 1
            if remaining[i] == 0:
                fwd.append(Event("fwd_post", i))
                post_order.append(i)

    for child in graph.children(""):
        visit(child)
    events = ([Event("fwd_pre", root)] if root is not None else []) + fwd
    if root is not None:
        events += [Event("op", root, where=""), Event("fwd_post", root), Event("bwd_pre", root)]
    for i in reversed(post_order):
        events += [Event("bwd_pre", i), Event("op", i, where=units[i].modules[0]), Event("bwd_post", i)]
    events.append(Event("end_backward"))
    return Trace(events)


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensors created by ops (parameters are never op outputs)."""

    def __init__(self, on_op):
        super().__init__()
        self.live = 0
        self.grad_storages: set[int] = set()
        self.grads = 0
        self._seen: dict[int, int] = {}
        self._pinned: list = []
        self._on_op = on_op

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Tensors that exist before the step (parameters, inputs): their views cost nothing."""
        for t in tensors:
            st = t.untyped_storage()
            self._pinned.append(st)  # keeps the id valid
            self._seen[id(st)] = 0

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        if key in self.grad_storages:
            self.grad_storages.discard(key)
            self.grads -= nbytes
        self._seen.pop(key, None)

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self._seen:
            return
        nbytes = st.nbytes()
        self._seen[key] = nbytes
        self.live += nbytes
        weakref.finalize(st, self._free, key, nbytes)

    def mark_grad(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self._seen and key not in self.grad_storages:
            self.grad_storages.add(key)
            self.grads += self._seen[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        self._on_op(func)
        return out


class TraceError(Exception):
    """The model could not run one step on the given inputs (the message says why)."""


def known_cause(reason: str) -> str | None:
    """The cause and fix of a trace failure planc recognises from torch's message, or None.

    `_grouped_mm` (transformers' default experts kernel for MoE models) has a fake-tensor
    (meta) kernel that refuses every dtype but bf16, while the real kernels run fp32: on CPU
    (torch 2.13) and on an H200 (torch 2.11+cu130, measured 2026-12-04, fp32/bf16/fp16 all
    ran). So an fp32 MoE trains, but planc's fake-tensor trace of it fails.
    """
    if "Expected inputs of BF16 type" in reason:
        return ("the cause is the dtype, not the input: the experts run torch's `_grouped_mm` (transformers' default "
                "for MoE models), whose fake-tensor kernel, which planc traces with, takes only bf16, and this "
                "plan's parameters are fp32 there. A real run is fine (CPUs and GPUs run fp32 `_grouped_mm`); to "
                "estimate or simulate it give the model bf16 parameters (`defaults { precision param = bf16 }`) "
                "or build it with `experts_implementation=\"eager\"`")
    return None


@dataclass(frozen=True)
class Example:
    """Example inputs of one step: positional and keyword arguments of `model(...)`.

    Only shapes and dtypes matter (fake tensors, meta tensors or real ones). An input factory
    (`planc explain --inputs pkg.module:fn`) returns one of these, a tuple (positional) or a
    dict (keywords); anything else that the model takes (a flex-attention `BlockMask`, a
    pixel tensor, decoder ids) goes through as given.
    """

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    @classmethod
    def of(cls, value: Any) -> "Example":
        if isinstance(value, Example):
            return value
        if isinstance(value, dict):
            return cls((), dict(value))
        if isinstance(value, (tuple, list)):
            return cls(tuple(value))
        return cls((value,))

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in tree_flatten((self.args, self.kwargs))[0] if isinstance(t, torch.Tensor)]

    def key(self) -> tuple:
        """What a cached trace depends on: the structure, shapes and dtypes."""
        leaves, spec = tree_flatten((self.args, self.kwargs))
        return (str(spec), tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t)
                                 for t in leaves))

    def map(self, fn) -> "Example":
        from torch.utils._pytree import tree_map
        args, kwargs = tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, (self.args, self.kwargs))
        return Example(tuple(args), kwargs)

    def microbatch(self, microbatches: int, index: int = 0) -> "Example":
        """Microbatch `index` of `microbatches` equal ones of this step's batch: every tensor's
        first dimension (the batch) divided, as the training loop splits it (`AppliedPlan.accumulate`).

        Raises:
            MicrobatchError: a tensor's batch does not divide into the microbatches.
        """
        if microbatches == 1:
            return self
        if not 0 <= index < microbatches:
            raise ValueError(f"microbatch {index} of {microbatches}")
        for t in self.tensors():
            check_splits(tuple(t.shape), microbatches)
        return self.map(lambda t: t.chunk(microbatches)[index])


# A step's loss: (model output, the example) -> scalar tensor. `--loss pkg.module:fn`.
LossFn = Callable[[Any, Example], torch.Tensor]


def _output_tensor(out: Any) -> torch.Tensor:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t
    raise TypeError("the model returned no floating-point tensor to take a loss of")


def _labels(logits: torch.Tensor, example: Example, vocab: set[int]) -> torch.Tensor | None:
    """The token ids an LM loss takes as labels: an integer input shaped like the logits
    without their last dim, when that last dim is a vocabulary (an embedding's row count)."""
    if logits.dim() < 2 or logits.shape[-1] not in vocab:
        return None
    for t in example.tensors():
        if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool \
                and tuple(t.shape) == tuple(logits.shape[:-1]):
            return t
    return None


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The language-model loss torchtitan and Hugging Face take: cross-entropy over the
    logits upcast to float32, summed and divided by the token count."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(),
                                             reduction="sum") / labels.numel()


def vocab_sizes(model: nn.Module) -> set[int]:
    return {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}


def default_loss(model: nn.Module, tp: int = 1) -> LossFn:
    """The loss of one training step as every planc measurement takes it by default: `lm_loss`
    when the output is logits over an embedding's vocabulary and an integer input has their
    shape (token ids as labels; only shapes matter), else the first float output's sum. With
    `tp` > 1, logits over one tensor rank's share of the vocabulary count too (loss parallel)."""
    vocab = vocab_sizes(model)
    vocab |= {-(-v // tp) for v in vocab}

    def loss(output: Any, example: Example) -> torch.Tensor:
        out = _output_tensor(output)
        labels = _labels(out, example, vocab)
        return out.sum() if labels is None else lm_loss(out, labels)
    return loss


def loss_name(model: nn.Module, example: Example | None, loss: LossFn | None) -> str:
    """How the traced step's loss is taken, in words (for `Trace.source`)."""
    if loss is not None:
        return f"loss {getattr(loss, '__qualname__', 'given')}"
    return "loss: cross-entropy over fp32 logits" if example is not None and any(
        not t.is_floating_point() for t in example.tensors()) and vocab_sizes(model) else "loss: output.sum()"


def loss_of(output: Any) -> torch.Tensor:
    """The first floating-point output's sum (the loss of steps with no labels)."""
    return _output_tensor(output).sum()


def fake_model(compiled, fake_mode, tp: int = 1) -> nn.Module:
    """A copy of the plan's model whose tensors are fake CPU tensors (shapes only, no memory),
    each unit's parameters in its param_dtype; with `tp` > 1, the parameters tensor
    parallelism splits in their local shape on one of `tp` tensor ranks.

    Fake CPU rather than meta: operators then pick the kernels a real device would (a meta
    `scaled_dot_product_attention` falls back to the math path and materialises the
    attention matrix, which fused kernels never do).
    """
    graph = compiled.graph
    if graph.model is None:
        raise ValueError("the compiled plan has no model to run")
    memo = {}
    for t in list(graph.model.parameters()) + list(graph.model.buffers()):
        memo[id(t)] = torch.empty_like(t, device="meta")  # deepcopy without copying storage
    model = copy.deepcopy(graph.model, memo)
    dtype_of = {}
    for op in compiled.program.units:
        for name in op.params:  # the parameters FSDP2 casts (ignored ones keep their dtype)
            dtype_of[name] = op.policy.precision.compute_dtype(graph.params[name].dtype)
    new: dict[str, nn.Parameter] = {}
    local = {}
    if tp > 1:
        from planc.estimate.tensor_local import local_shapes
        local = local_shapes(compiled.program, graph, tp)
    with fake_mode:
        for name, info in graph.params.items():
            t = torch.empty(local.get(name, info.shape), dtype=dtype_of.get(name, info.dtype), device="cpu")
            new[name] = nn.Parameter(t, requires_grad=info.requires_grad)
        for mod in model.modules():
            for local, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[local] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
    for alias, canon in graph.aliases.items():
        owner, _, local = alias.rpartition(".")
        model.get_submodule(owner)._parameters[local] = new[canon]
    return model


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def fake_trace(compiled, inputs: "tuple | dict | Example", loss: LossFn | None = None, tp: int = 1,
               repeat: bool = False, cp: int = 1, ep: int = 1) -> Trace:
    """Run one forward and backward on fake CPU tensors and record the events of the step.

    The step is a training step: `loss(output, example)` (default `default_loss`: the LM
    loss over fp32 logits for language models) and its backward, so the loss head's
    temporaries (the fp32 logits, log-softmax and their gradients) are counted.

    Args:
        compiled: the compiled plan (its graph must hold the model).
        inputs: inputs of the model (any device; only shapes and dtypes are used).
        loss: the step's loss; default `default_loss(model)`.
        tp: tensor-parallel degree: with `parallel` statements and tp > 1, the step of one
            tensor rank (local parameter shapes, each style's gathers and scatters:
            `planc/estimate/tensor_local.py`).
        repeat: trace runs of identical blocks as four blocks and write the others out
            (`planc/estimate/repeat.py`: the same events, checked on the trace; in full when
            the check or the short step fails).
        cp: context-parallel degree: with `AttendOverContext` ops and cp > 1, the step of one
            context rank (`inputs` already its sequence shard with `positions=`; each styled
            attention gathers K/V over cp ranks: `planc/estimate/context_local.py`).
        ep: expert-parallel degree: with `DispatchExperts` ops and ep > 1, the step of one expert
            rank (its local experts, the dispatch's allocations, balanced routing or the compiled
            plan's `routing` histogram: `planc/estimate/expert_local.py`).

    Returns:
        The trace: unit hooks and live non-parameter bytes after every op.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._composable.checkpoint_activation import checkpoint as checkpoint_module

    from planc.lower.checkpointing import context_fn

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    program = READER.compiled(compiled).program
    tp = tp if any(True for _ in program.of_type(Parallelize)) else 1
    model = fake_model(compiled, fake_mode, tp)
    layout_handles = []
    if tp > 1:
        from planc.estimate.tensor_local import emulate_layouts
        layout_handles = emulate_layouts(model, program, compiled.graph, tp)
    cp = cp if any(True for _ in program.of_type(AttendOverContext)) else 1
    if cp > 1:
        from planc.estimate.context_local import emulate_context
        layout_handles += emulate_context(model, program, cp)
    ep = ep if any(True for _ in program.of_type(DispatchExperts)) else 1
    if ep > 1:
        from planc.estimate.expert_local import emulate_experts
        layout_handles += emulate_experts(model, program, ep, tp, getattr(compiled, "routing", None))
    for op in program.of_type(Checkpoint):
        checkpoint_module(model.get_submodule(op.module), context_fn=context_fn(op.mode))
    rec = _Recorder(model, program.units)
    handles = rec.install()
    runs = []
    if repeat:
        from planc.estimate import repeat as repeated
        runs = repeated.find_runs(compiled)
        repeated.shorten(model, runs)
        rec.post_done.update(repeated.elided_units(runs))  # they never run: no end-of-backward reduce

    example = Example.of(inputs)
    with fake_mode:
        example = example.map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
    input_bytes = sum(t.nbytes for t in example.tensors())
    rec.mode.ignore([*model.parameters(), *model.buffers(), *example.tensors()])
    step_loss = loss or default_loss(model, tp)
    try:
        events = _run_step(rec, model, example, step_loss, fake_mode)
    except Exception:
        if not runs:
            raise
        events = None  # the model's forward does not take the short container: in full
    finally:
        for h in handles + layout_handles:
            h.remove()
    if runs:
        events = repeated.restore(events, runs, program.units) if events is not None else None
        if events is None:
            return fake_trace(compiled, inputs, loss, tp, cp=cp, ep=ep)
    on = f" (one of {tp} tensor-parallel ranks, its local shapes)" if tp > 1 else ""
    on += f" (one of {cp} context ranks: its sequence shard, K/V gathered)" if cp > 1 else ""
    if ep > 1:
        from planc.estimate.expert_local import routing_assumed
        on += f" (one of {ep} expert ranks: its experts, {routing_assumed(compiled, ep)})"
    return Trace(events, input_bytes, f"live tensors of one forward and backward{on} on fake CPU tensors, each "
                 f"unit's precision and checkpointing applied; {loss_name(model, example, loss)}")


class _Recorder:
    """The events of one step as FSDP2's hooks would see them, recorded by module and gradient hooks."""

    def __init__(self, model: nn.Module, units) -> None:
        self.model, self.units = model, units
        self.events: list[Event] = []
        self.where: list[str] = [""]
        self.mode = _LiveBytes(lambda func: self.events.append(
            Event("op", live=self.mode.live, grads=self.mode.grads, where=self.where[-1])))
        self.root = root_index(units)
        self.post_done: set[int] = set()   # units whose every module finished backward
        self.names_of = {i: list(u.params) for i, u in enumerate(units)}
        self.params_of = {i: [model.get_parameter(p) for p in names] for i, names in self.names_of.items()}
        self.fwd_pending: dict[int, int] = {}
        self.first_in: dict[int, nn.Module] = {}   # the member of each unit that ran forward first
        self.bwd_started: set[int] = set()

    def event(self, kind: str, unit: int = -1, **fields) -> None:
        self.events.append(Event(kind, unit, live=self.mode.live, **fields))

    def post_backward(self, i: int, final: bool) -> None:
        """FSDP2's post-backward: reduce-scatter the gradients there are, then reshard.

        A group unit (`fully_shard([a, b])`) runs it once: torch 2.13 registers its
        post-backward on the inputs of the member that runs forward first, and its
        pre-backward on the output of the member that completes the group, so the group is
        gathered once in backward and reduce-scatters all its gradients together.
        """
        if i in self.post_done:
            return
        if final:
            self.post_done.add(i)
        ready = tuple(n for n, p in zip(self.names_of[i], self.params_of[i]) if p.grad is not None)
        self.event("bwd_post", i, grads=self.mode.grads, params=ready)
        for p in self.params_of[i]:
            p.grad = None  # FSDP2 frees unsharded gradients once they are reduce-scattered

    def install(self) -> list:
        """Every unit's forward and backward hooks, and each parameter's gradient hook; the handles."""
        handles = []
        for i, u in enumerate(self.units):
            if not u.is_root:
                handles += self._unit_hooks(i, u)
        owner = {id(p): i for i, ps in self.params_of.items() for p in ps}

        def grad_done(p: torch.Tensor) -> None:
            if p.grad is not None:
                self.mode.mark_grad(p.grad)
                if owner.get(id(p)) in self.post_done:  # its unit already reduce-scattered
                    p.grad = None

        for p in self.model.parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(grad_done))
        return handles

    def _unit_hooks(self, i: int, u) -> list:
        def pre(mod, args):
            if self.fwd_pending.get(i, 0) == 0:
                self.event("fwd_pre", i)
                self.first_in[i] = mod  # its inputs carry the group's post-backward hook
            self.fwd_pending[i] = self.fwd_pending.get(i, 0) + 1
            self.where.append(u.name)
            if u.policy.precision.casts_inputs:
                return _cast(args, u.policy.precision.param_dtype)
            return None

        def post(mod, args, out):
            self.where.pop()
            if self.fwd_pending[i] == len(u.modules):
                self.fwd_pending[i] = 0
                self.event("fwd_post", i)
            if u.policy.precision.output_dtype is not None:
                return _cast(out, u.policy.precision.output_dtype)
            return None

        def bw_pre(mod, grad_out):
            if i not in self.bwd_started:  # a group's pre-backward runs once, at its first member
                self.bwd_started.add(i)
                self.event("bwd_pre", i)
            self.where.append(u.name)

        def bw_post(mod, grad_in, grad_out):
            self.where.pop() if len(self.where) > 1 else None
            if all(g is None for g in grad_in):
                # no input needs a gradient (token ids): torch fires this hook before the
                # module's backward; FSDP2 reduces such units in its end-of-backward callback
                return
            if self.first_in.get(i) is mod:
                self.post_backward(i, final=True)

        handles = []
        for m in (self.model.get_submodule(path) for path in u.modules):
            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post),
                        m.register_full_backward_pre_hook(bw_pre), m.register_full_backward_hook(bw_post)]
        return handles


def _run_step(rec: _Recorder, model: nn.Module, example: Example, step_loss: LossFn, fake_mode) -> list[Event]:
    """One forward, loss and backward on fake tensors, with the root's and end-of-backward events."""
    units, root, mode = rec.units, rec.root, rec.mode
    labels = example
    root_precision = units[root].policy.precision if root is not None else None
    if root_precision is not None and root_precision.casts_inputs:
        example = Example(*_cast((example.args, example.kwargs), root_precision.param_dtype))
    with fake_mode, mode:
        if root is not None:
            rec.events.append(Event("fwd_pre", root))
        # NOTE: as in a training loop (torchtitan: `pred = model(x); loss = loss_fn(pred, y);
        # del pred`): the output lives while the loss is taken, not during backward
        out = model(*example.args, **example.kwargs)
        if root_precision is not None and root_precision.output_dtype is not None:
            out = _cast(out, root_precision.output_dtype)
        if root is not None:  # the root's post-forward runs as the model returns, before the loss
            rec.event("fwd_post", root)
        # FSDP2 runs the root's pre-backward when its outputs' gradient arrives, after the loss's own
        # backward (the fp32 logits' gradient): a pre-hook on the node that made each output
        nodes = {id(t.grad_fn): t.grad_fn for t in tree_flatten(out)[0]
                 if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        fired: list[bool] = []

        def root_pre_backward(grad_outputs):
            if not fired:
                fired.append(True)
                rec.event("bwd_pre", root)
        if root is not None:
            for node in nodes.values():
                node.register_prehook(root_pre_backward)
        value = step_loss(out, labels)
        del out, nodes
        rec.event("bwd_start")
        with warnings.catch_warnings():  # full backward hooks warn on int inputs; harmless here
            warnings.simplefilter("ignore")
            value.backward()
        del value
        for i in range(len(units)):  # FSDP2's end-of-backward callback
            if i != root:
                rec.post_backward(i, final=True)
        if root is not None:
            rec.post_backward(root, final=True)
        rec.event("end_backward", grads=mode.grads)
    return rec.events


def default_input(model: nn.Module, input_shape: tuple[int, ...] | None) -> tuple | None:
    """Token ids of `input_shape` (batch, seq) for a language model; None without a shape."""
    if input_shape is None:
        return None
    return (torch.zeros(tuple(input_shape), dtype=torch.long, device="meta"),)


# model graph -> {(step key, input key): Trace}. Keyed by the graph, not the compiled plan:
# `planc check --world-size 8 64` compiles once per world size against one graph, and the
# traced step does not depend on the world size.
_TRACES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _step_key(compiled) -> tuple:
    """What of a compiled plan one traced step depends on: the units (their modules,
    parameters and precision), the checkpointed modules, the ignored parameters and the
    tensor-parallel styles."""
    program = compiled.program
    units = tuple((u.modules, u.params, u.is_root, u.policy.precision) for u in program.units)
    checkpointed = tuple(sorted((op.module, op.mode) for op in program.of_type(Checkpoint)))
    styles = tuple((op.module, op.style) for op in program.of_type(Parallelize))
    styles += tuple((op.module, "context") for op in program.of_type(AttendOverContext))
    styles += tuple((op.module, "expert") for op in program.of_type(DispatchExperts))
    return units, checkpointed, frozenset(compiled.resolution.ignored), styles


# torch logs (at ERROR, with a full traceback) every op that fails under FakeTensorMode before
# re-raising it; the error reaches the user once, as P504's one line, so mute that log
_FAKE_TENSOR_LOGGERS = ("torch._subclasses.fake_tensor",)


@contextlib.contextmanager
def _quiet_fake_tensor_logs():
    loggers = [logging.getLogger(name) for name in _FAKE_TENSOR_LOGGERS]
    saved = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, was in zip(loggers, saved):
            lg.disabled = was


def trace_for(compiled, inputs: "tuple | dict | Example | None", loss: LossFn | None = None, tp: int = 1,
              repeat: bool = False, cp: int = 1, ep: int = 1) -> Trace:
    """The (cached) trace of one step of `compiled` with `inputs` and `loss`, on one of `tp` tensor
    ranks and one of `cp` context ranks (`inputs` its shard); `repeat`: see `fake_trace` (the same
    events, so one cache entry serves both)."""
    READER.compiled(compiled)  # before the cache: a job it cannot record is refused every time
    cache = _TRACES.setdefault(compiled.graph, {})
    example = None if inputs is None else Example.of(inputs)
    key = (_step_key(compiled), None if example is None else example.key(), loss, tp, cp, ep,
           getattr(compiled, "routing", None) if ep > 1 else None)
    if key not in cache:
        if example is None:
            cache[key] = synthetic_trace(compiled)
        else:
            try:
                with _quiet_fake_tensor_logs():
                    cache[key] = fake_trace(compiled, example, loss, tp, repeat, cp, ep)
            except Exception as err:  # any model code can fail on unexpected inputs
                shapes = " and ".join("x".join(map(str, t.shape)) for t in example.tensors())
                rank = f" as one of {tp} tensor-parallel ranks (local shapes)" if tp > 1 and key[0][3] else ""
                rank += f" as one of {cp} context ranks (its sequence shard)" if cp > 1 else ""
                raise TraceError(f"the model did not run on inputs of shape {shapes}{rank}: "
                                 f"{type(err).__name__}: {err}") from err
    return cache[key]


