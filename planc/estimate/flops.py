"""The compute profile of one training step: FLOPs per module, their order, activation shapes.

`step_profile(graph, input_shape=...)` runs one forward, loss and backward of the plain
(unsharded, un-checkpointed) model on fake CPU tensors under torch's `FlopCounterMode` and
records, per module path, the FLOPs of the ops run while that module was the innermost one
running (forward; of those, the ones `selective` checkpointing recomputes; backward), the
sequence of (module, FLOPs) segments in execution order for the overlap schedule, and the
shape and dtype of each module's first floating-point input and output (for tensor-parallel
collectives). It does not depend on the plan, so one profile serves every policy a search
tries (`planc.estimate.time.estimate_step_time`).

FlopCounterMode counts matrix multiplies, convolutions and attention (2 FLOPs per
multiply-add; attention without the causal discount, as torch counts it); elementwise ops,
norms and softmax count 0. It has no formula for the CPU attention kernel the fake trace
runs, so torch's own SDPA formulas are registered for it (what a GPU's flash kernel counts).
"""

from __future__ import annotations

import sys
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from planc.estimate.trace import Example, LossFn, TraceError, default_input, default_loss, fake_model
from planc.lower.checkpointing import SAVED_OPS
from planc.model.context_attention import RecordKV


def flop_mapping() -> dict:
    """FlopCounterMode's extra formulas: the CPU attention kernels, counted as the GPU ones are, and
    planc's grouped matmul of routed experts (`planc/zoo/grouped.py`)."""
    from torch.utils.flop_counter import flop_registry
    aten = torch.ops.aten
    out = {}
    for cpu, gpu in (("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention"),
                     ("_scaled_dot_product_flash_attention_for_cpu_backward",
                      "_scaled_dot_product_flash_attention_backward")):
        op, ref = getattr(aten, cpu, None), getattr(aten, gpu, None)
        if op is not None and ref is not None and ref in flop_registry:
            out[op] = _raw(flop_registry[ref])
    grouped = sys.modules.get("planc.zoo.grouped")  # the routed experts' matmul, once a model uses it
    if grouped is not None:
        out.update(grouped.flop_formulas())
    return out


def _raw(counted):
    """A registered formula (already taking tensors) marked so FlopCounterMode does not wrap it again."""
    def formula(*args, **kwargs):
        return counted(*args, **kwargs)
    formula._get_raw = True  # type: ignore[attr-defined]
    return formula


@dataclass(frozen=True)
class Activation:
    """Shape and dtype of a module's first floating-point input or output."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = True

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class StepProfile:
    """FLOPs and activations of one training step of the plain model (see the module docstring).

    Module paths are the model's (`""` is the model itself: ops outside every submodule,
    such as the loss).
    """

    forward: dict[str, int] = field(default_factory=dict)        # path -> forward FLOPs
    recomputed: dict[str, int] = field(default_factory=dict)     # path -> forward FLOPs of unsaved ops
    recompute_full: dict[str, int] = field(default_factory=dict)  # path -> FLOPs `full` checkpointing reruns
    recompute_selective: dict[str, int] = field(default_factory=dict)  # ... `selective` reruns
    backward: dict[str, int] = field(default_factory=dict)       # path -> backward FLOPs
    forward_segments: list[tuple[str, int]] = field(default_factory=list)   # (path, FLOPs) in order
    backward_segments: list[tuple[str, int]] = field(default_factory=list)
    order: list[str] = field(default_factory=list)               # paths in first-forward order
    inputs: dict[str, Activation] = field(default_factory=dict)
    outputs: dict[str, Activation] = field(default_factory=dict)
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> its first forward's op range
    stops: dict[str, int] = field(default_factory=dict)          # path -> where checkpoint's recompute stops
    attention: dict[str, list] = field(default_factory=dict)     # path -> (key, value) `Activation`s of each
    #                 SDPA it calls in forward, before a grouped-query repeat (what context parallelism gathers)
    tokens: int | None = None                                     # batch x sequence of token-id inputs
    source: str = ""

    @property
    def total(self) -> int:
        return sum(self.forward.values()) + sum(self.backward.values())

    def subtree(self, table: dict[str, int], path: str) -> int:
        """Sum of `table` over `path` and its descendants."""
        if path == "":
            return sum(table.values())
        prefix = path + "."
        return sum(v for k, v in table.items() if k == path or k.startswith(prefix))


def _counter_class():
    from torch.utils.flop_counter import FlopCounterMode

    class PerModule(FlopCounterMode):
        """FlopCounterMode that also gives each op's FLOPs to the innermost module running it."""

        def __init__(self, on_flops):
            super().__init__(display=False, custom_mapping=flop_mapping())
            self._on_flops = on_flops

        def _count_flops(self, func_packet, out, args, kwargs):
            if func_packet in self.flop_registry:
                n = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
                self._on_flops(func_packet, n, self.mod_tracker.parents)
            return super()._count_flops(func_packet, out, args, kwargs)

    return PerModule


def _first_float(tree) -> torch.Tensor | None:
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t
    return None


def count_step(model: torch.nn.Module, example: Example, loss: LossFn | None = None) -> StepProfile:
    """Profile one forward + loss + backward of `model` on `example` (real or fake tensors)."""
    names = {}
    root_name = type(model).__name__
    prof = StepProfile()
    phase = ["forward"]

    def path_of(parents) -> str:
        inner = max((p for p in parents if p != "Global"), key=lambda p: (p.count("."), p), default=root_name)
        return inner.split(".", 1)[1] if "." in inner else ""

    events: list[tuple[int, bool]] = []   # forward: (FLOPs, op kept by selective) per op; (-1, _) per saved tensor
    spans: dict[str, list[int]] = {}

    def pack(t):
        if phase[0] == "forward":
            events.append((-1, False))
        return t

    def on_attention(key, value, parents):
        if phase[0] == "forward":
            prof.attention.setdefault(path_of(parents), []).append(
                tuple(Activation(tuple(t.shape), t.dtype, t.requires_grad) for t in (key, value)))

    def on_flops(func, n, parents):
        path = path_of(parents)
        if phase[0] == "forward":
            events.append((n, func in SAVED_OPS))
        table = getattr(prof, phase[0])
        table[path] = table.get(path, 0) + n
        if phase[0] == "forward" and func not in SAVED_OPS:
            prof.recomputed[path] = prof.recomputed.get(path, 0) + n
        segs = prof.forward_segments if phase[0] == "forward" else prof.backward_segments
        if segs and segs[-1][0] == path:
            segs[-1] = (path, segs[-1][1] + n)
        else:
            segs.append((path, n))

    handles = []
    for path, mod in model.named_modules():
        names[id(mod)] = path

        def pre(mod, args, path=path):
            if path not in spans and phase[0] == "forward":
                spans[path] = [len(events), -1]
            if path not in prof.inputs:
                prof.order.append(path)
                t = _first_float(args)
                if t is not None:
                    prof.inputs[path] = Activation(tuple(t.shape), t.dtype, t.requires_grad)

        def post(mod, args, out, path=path):
            if path in spans and spans[path][1] < 0:
                spans[path][1] = len(events)
            if path not in prof.outputs:
                t = _first_float(out)
                if t is not None:
                    prof.outputs[path] = Activation(tuple(t.shape), t.dtype, t.requires_grad)

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    step_loss = loss or default_loss(model)
    counter = _counter_class()(on_flops)
    try:
        with counter, RecordKV(lambda key, value: on_attention(key, value, counter.mod_tracker.parents)), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = model(*example.args, **example.kwargs)
                value = step_loss(out, example)
            del out
            phase[0] = "backward"
            value.backward()
    finally:
        for h in handles:
            h.remove()
    _recompute(prof, events, spans)
    ids = [t for t in example.tensors() if not t.is_floating_point() and t.dim() == 2]
    prof.tokens = int(ids[0].numel()) if ids else None
    return prof


def _recompute(prof: StepProfile, events: list[tuple[int, bool]], spans: dict[str, list[int]]) -> None:
    """FLOPs a checkpointed module reruns in backward, for each module.

    torch's non-reentrant checkpoint stops recomputing as soon as every tensor the module's
    forward saved for backward is saved again (early stop, on by default): the ops after the
    last saved tensor never rerun. Autograd saves an op's inputs before its kernel runs and its
    outputs after, so a final matmul whose output nobody saves (the block's last projection,
    feeding a residual add) is not recomputed. `selective` reruns only the ops it does not keep.
    """
    for path, (start, end) in spans.items():
        if end < 0:
            continue
        last = max((k for k in range(start, end) if events[k][0] < 0), default=start)
        prof.spans[path] = (start, end)
        prof.stops[path] = last
        ops = [events[k] for k in range(start, last) if events[k][0] >= 0]
        prof.recompute_full[path] = sum(n for n, _ in ops)
        prof.recompute_selective[path] = sum(n for n, kept in ops if not kept)


# graph -> {(input key, loss): StepProfile}
_PROFILES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _example(graph, inputs, input_shape: tuple[int, ...] | None) -> Example | None:
    """The step's inputs: `inputs`, else token ids of `input_shape`; None without a model or an input."""
    if graph.model is None:
        return None
    if inputs is None and input_shape is not None:
        inputs = default_input(graph.model, input_shape)
    return None if inputs is None else Example.of(inputs)


def step_profile(graph, inputs=None, *, input_shape: tuple[int, ...] | None = None,
                 loss: LossFn | None = None, dtype: torch.dtype | None = None,
                 repeat: bool = False) -> StepProfile | None:
    """The (cached) compute profile of one step of `graph`'s model; None without an input.

    Args:
        graph: the `ModelGraph` (it must hold the model).
        inputs: the model's inputs (a tuple, dict or `Example`; only shapes and dtypes matter).
        input_shape: (batch, seq) token ids for a language model, if `inputs` is not given.
        loss: the step's loss (default: `planc.estimate.trace.default_loss`).
        dtype: run the step with floating-point parameters in this dtype (some kernels, such as
            grouped matmuls of MoE experts, only take bf16); FLOPs and shapes do not depend on it.
        repeat: profile runs of identical blocks as four blocks and write the others out
            (`planc/estimate/repeat.py`: the same profile, checked on it; in full otherwise).

    Raises:
        TraceError: the model did not run on these inputs.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    example = _example(graph, inputs, input_shape)
    if example is None:
        return None
    cache = _PROFILES.setdefault(graph, {})
    key = (example.key(), loss, dtype)
    if key not in cache:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        from planc.lower.program import Precision
        cast = () if dtype is None else (types.SimpleNamespace(
            params=tuple(n for n, info in graph.params.items() if info.dtype.is_floating_point),
            policy=types.SimpleNamespace(precision=Precision(param_dtype=dtype))),)
        plain = types.SimpleNamespace(graph=graph, program=types.SimpleNamespace(units=cast))
        prof = None
        if repeat:  # runs of identical blocks traced as four (planc/estimate/repeat.py)
            from planc.estimate import repeat as repeated
            runs = repeated.module_runs(graph.model, graph.aliases)
            if runs:
                model = fake_model(plain, fake_mode)
                repeated.shorten(model, runs)
                with fake_mode:
                    fake = example.map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
                    try:
                        prof = repeated.restore_profile(count_step(model, fake, loss), runs)
                    except Exception:  # the forward does not take the short container: in full
                        prof = None
        if prof is None:
            model = fake_model(plain, fake_mode)
            with fake_mode:
                fake = example.map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
                try:
                    prof = count_step(model, fake, loss)
                except Exception as err:  # any model code can fail on unexpected inputs
                    shapes = " and ".join("x".join(map(str, t.shape)) for t in example.tensors())
                    raise TraceError(f"the model did not run on inputs of shape {shapes}: "
                                     f"{type(err).__name__}: {err}") from err
        prof.source = "FlopCounterMode over one forward, loss and backward on fake CPU tensors"
        cache[key] = prof
    return cache[key]


def tensor_rank_profile(graph, program, inputs=None, *, input_shape: tuple[int, ...] | None = None,
                        loss: LossFn | None = None, tp: int, repeat: bool = False) -> StepProfile | None:
    """The (cached) compute profile of one *tensor rank's* step under `program`'s `parallel` rules.

    The model runs as one tensor rank runs it: split parameters at their local shapes, each
    style's gathers and scatters emulated on plain tensors (`planc/estimate/tensor_local.py`,
    the same emulation the memory trace uses). A module a rule splits (colwise, rowwise, the
    attention between them, a sequence-parallel norm) counts its local share; one the plan
    leaves whole on every tensor rank (`replicate`, or a module no rule reaches) counts in
    full, as its rank really computes it. None without an input or without tensor parallelism.
    `repeat`: runs of identical blocks profiled as four, as `step_profile` does.

    Raises:
        TraceError: the step did not run as one tensor rank (a model that hard-codes global
            head counts, as under real tensor parallelism).
    """
    from planc.lower.program import Parallelize

    rules = tuple(program.of_type(Parallelize))
    example = _example(graph, inputs, input_shape)
    if example is None or tp <= 1 or not rules:
        return None
    cache = _PROFILES.setdefault(graph, {})
    key = ("tensor rank", example.key(), loss, tp, rules)
    if key not in cache:
        prof = None
        if repeat:  # runs of identical blocks traced as four (planc/estimate/repeat.py)
            from planc.estimate import repeat as repeated
            runs = repeated.module_runs(graph.model, graph.aliases)
            if runs:
                try:
                    prof = repeated.restore_profile(_tensor_rank_step(graph, program, example, loss, tp, runs), runs)
                except Exception:  # the forward does not take the short container: in full
                    prof = None
        if prof is None:
            try:
                prof = _tensor_rank_step(graph, program, example, loss, tp)
            except Exception as err:  # the model code runs on local shapes it may not expect
                raise TraceError(f"the step did not run as one tensor rank of {tp}: {type(err).__name__}: {err}") from err
        prof.source = f"FlopCounterMode over one tensor rank's step (of {tp}) on fake CPU tensors"
        cache[key] = prof
    return cache[key]


def _tensor_rank_step(graph, program, example, loss, tp: int, runs=()) -> StepProfile:
    """One tensor rank's step counted (`tensor_rank_profile`); with `runs`, those runs cut to four blocks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from planc.estimate.tensor_local import emulate_layouts

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = fake_model(types.SimpleNamespace(graph=graph, program=program), fake_mode, tp)
    emulate_layouts(model, program, graph, tp)
    if runs:
        from planc.estimate import repeat as repeated
        repeated.shorten(model, runs)
    with fake_mode:
        fake = example.map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
        return count_step(model, fake, loss or default_loss(model, tp))
