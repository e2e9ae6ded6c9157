"""A split backward per pipeline stage, with torch's own code as the oracle: what a microbatch keeps
between its input backward (`I`) and its weight backward (`W`), and the FLOPs of each half.

The split-backward schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) run a stage's
backward in two actions (`pipelining/stage.py`): `I` is `_backward.stage_backward_input`,
`autograd.grad` of the stage's inputs with `retain_graph=True`, which also stores the gradients
flowing into the weight-gradient intermediates (the autograd nodes where a weight joins the
activations' path) in `param_groups`; `W` is `stage_backward_weight`, `autograd.grad` of the
weights from those intermediates and their stored gradients. Between the two the stage keeps
(`PipelineStage.backward_state`) the retained graph below the intermediates with every tensor it
saved, and the intermediates' gradients. On the first stage (its input, token ids, needs no
gradient) `I` does nothing and `W` is the whole backward.

`split_costs` runs each stage as the runtime runs it (`planc.model.split.split`, the stages
chained: each stage's input the previous one's output, detached, requiring a gradient), on
fake CPU tensors (`trace.fake_model`: each unit's parameters in its param_dtype; the unit's
checkpointing applied), through torch's `stage_backward_input` and `stage_backward_weight`
themselves, counting:

* `kept`: the live bytes after `I` that the microbatch holds until its `W` (the dispatch-mode
  live-bytes counter of the trace, `trace._LiveBytes`), less the stage's output and the input's
  gradient (`role_memory` counts those as the schedule holds them);
* `input_flops` / `weight_flops`: `FlopCounterMode` around each half;
* `input_peak`, `weight_peak`, `full_peak`: the most live bytes during `I`, during `W`, and
  during a full backward (`stage_backward`, run on a second forward once `W` has left the
  weights' gradients: the microbatches after the first accumulate into them), each above the
  live bytes it starts with. The replay's backward (the model's trace) cannot show them:
  `I` runs `autograd.grad(..., retain_graph=True)`, which frees no saved tensor while it
  makes every activation gradient, and a gradient accumulated into an existing one is
  allocated before it is added (`role_memory` puts each peak on top of the action's start).

  Measured (benchmarks/RESULTS.md, llama_tiny, microbatch 2 x 16): the head stage's `I` holds
  65,540 B above its start where the trace's full backward shows 8,320 (ZBVZeroBubble's rank 0
  was 9.3% low for it); a block's `I` 114,688 B.

Not modelled: tensor, context and expert parallelism's local shapes (the stages run whole: the
bytes and FLOPs of one rank are taken as the whole stage's / tensor degree by the callers' FLOPs;
`kept` is the whole stage's), a `dw_builder` (planc never gives one).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SplitCost:
    """One stage's split backward, one microbatch (see the module docstring)."""

    stage: int
    kept: int | None       # bytes kept from `I` to `W`; None: `I` does nothing (the first stage)
    input_flops: int
    weight_flops: int
    # the most each torch action holds above the live bytes it starts with (the module docstring):
    input_peak: int = 0    # `I` (`stage_backward_input`, the graph retained: no saved tensor freed)
    weight_peak: int = 0   # `W` (`stage_backward_weight`; the first stage: its whole backward)
    full_peak: int = 0     # a full backward `B` (`stage_backward`) whose weights' gradients exist (0: the schedule has none)

    @property
    def input_share(self) -> float:
        """The input half's share of the backward's FLOPs (0 on the first stage: its input half
        does nothing, its weight half is the whole backward)."""
        total = self.input_flops + self.weight_flops
        return 0.0 if self.kept is None else self.input_flops / total if total else 0.5


def has_split_backward(schedule) -> bool:
    """Whether a schedule's actions split a backward into input and weight halves."""
    from planc.lower.job import BACKWARD_INPUT

    return _has(schedule, BACKWARD_INPUT)


def _has(schedule, kind: str) -> bool:
    return any(a.kind == kind for actions in schedule.actions for action in actions for a in (action.sub or (action,)))


def split_costs(shim, job, example, loss=None) -> list[SplitCost]:
    """Each stage's `SplitCost` for one microbatch `example` of the model `shim.graph.model` under
    the whole program `shim.program` (its units' precision), cut as `job.parts` (cached per model:
    the memory and the time estimates of one plan share it).

    Raises:
        TraceError: a stage did not run on fake tensors (the memory estimate reports it as it
            reports the trace's; the step time keeps the halves at half each)."""
    cache = _COSTS.setdefault(shim.graph, {})
    from planc.lower.job import FULL_BACKWARD
    from planc.lower.program import Checkpoint

    program = shim.program  # what the stages' runs depend on: units' precision, checkpointing
    full = _has(job.schedule, FULL_BACKWARD)  # a full backward's peak asked for (DualPipeV's `B`s)
    key = (tuple(part.modules for part in job.parts), tuple((u.modules, u.policy.precision) for u in program.units),
           tuple(sorted((op.module, op.mode) for op in program.of_type(Checkpoint))), example.key(), loss, full)
    if key not in cache:
        cache[key] = _split_costs(shim, job, example, loss, full)
    return cache[key]


_COSTS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def _split_costs(shim, job, example, loss, full: bool) -> list[SplitCost]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._composable.checkpoint_activation import checkpoint as checkpoint_module

    from planc.estimate.trace import TraceError, _quiet_fake_tensor_logs, default_loss, fake_model
    from planc.lower.checkpointing import context_fn
    from planc.lower.program import Checkpoint
    from planc.model.split import split

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = fake_model(shim, fake_mode)
    for op in shim.program.of_type(Checkpoint):
        checkpoint_module(model.get_submodule(op.module), context_fn=context_fn(op.mode))
    step_loss = loss or default_loss(model)
    with fake_mode:
        example = example.map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
    out, costs = None, []
    last = len(job.parts) - 1
    with _quiet_fake_tensor_logs(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for part in job.parts:
            try:
                stage = split(model, part.modules)
                args = example.args if part.stage == 0 else (out.detach().requires_grad_(),)
                cost, out = _stage_cost(stage, part.stage, args, example, step_loss if part.stage == last else None,
                                        fake_mode, full)
            except Exception as err:  # any model code can fail run stage by stage
                raise TraceError(f"the split backward of stage {part.stage} ({', '.join(part.modules)}) did not run "
                                 f"on fake tensors: {type(err).__name__}: {err}") from err
            costs.append(cost)
    return costs


def _stage_cost(stage, index: int, args: tuple, example, loss, fake_mode, full: bool) -> tuple[SplitCost, torch.Tensor]:
    """One stage's forward, then torch's `I` and `W` on it (then, when `full`, a full backward on a second forward);
    its cost and its output (the next stage's input). FlopCounterMode sits below the live-bytes
    counter: it decomposes some backward ops (the CPU attention's), whose pieces would allocate what
    the runtime's kernels do not if the counter saw them (the block's `I` peak read 139,264 B so,
    114,688 B as the real run). `W` finds no weight gradient, as the first microbatch's does."""
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight
    from torch.utils.flop_counter import FlopCounterMode

    from planc.estimate.trace import _LiveBytes, _output_tensor

    peak = [0]
    mode = _LiveBytes(lambda func: peak.__setitem__(0, max(peak[0], mode.live)))

    def above(fn, *args):  # fn's result, its FLOPs, the most live bytes during it above its start
        mode.__exit__(None, None, None)  # the counter goes under it (and only around the half: its module
        try:                             # hooks would break `autograd.grad` of a forward run under it)
            with FlopCounterMode(display=False) as counter, mode:
                start = peak[0] = mode.live
                result = fn(*args)
        finally:
            mode.__enter__()
        return result, counter.get_total_flops(), max(peak[0] - start, 0)
    params = list(stage.parameters())
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    with fake_mode, mode:
        mode.ignore([*params, *stage.buffers(), *inputs])
        out = _output_tensor(stage(*args, **(example.kwargs if index == 0 else {})))
        value = loss(out, example) if loss is not None else None
        grad = None if value is not None else torch.empty_like(out)  # received from the next stage
        if grad is not None:
            mode.ignore([grad])
        roots = [value] if value is not None else [out]
        grads = None if grad is None else [grad]
        if not any(t.requires_grad for t in inputs):  # torch: `I` does nothing on a stage whose input needs no gradient
            _, weight_flops, weight_peak = above(stage_backward, roots, grads, list(args))
            return SplitCost(index, None, 0, weight_flops, 0, weight_peak, weight_peak), out.detach()
        (dinputs, groups), input_flops, input_peak = above(stage_backward_input, roots, grads, inputs, iter(params))
        del dinputs, value, roots, grads  # the loss, the gradient received: the schedule's
        for t in inputs:
            t.grad = None  # on the receive buffer: `role_memory` counts it
        kept = max(mode.live - _nbytes(out), 0)
        _, weight_flops, weight_peak = above(stage_backward_weight, iter(params), groups)
        del groups
        full_peak = _full_peak(stage, index, args, example, loss, grad, above) if full else 0
    return SplitCost(index, kept, input_flops, weight_flops, input_peak, weight_peak, full_peak), out.detach()


def _full_peak(stage, index: int, args: tuple, example, loss, grad, above) -> int:
    """A second forward of the stage, then torch's full `stage_backward`: its peak above its start
    (the weights' gradients exist: each new one is allocated, then added)."""
    from torch.distributed.pipelining._backward import stage_backward

    from planc.estimate.trace import _output_tensor

    inputs = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
    out = _output_tensor(stage(*inputs, **(example.kwargs if index == 0 else {})))
    value = loss(out, example) if loss is not None else None
    roots, grads = (value, None) if value is not None else ([out], [grad])  # torch passes the loss itself
    _, _, full_peak = above(stage_backward, roots, grads, [t for t in inputs if isinstance(t, torch.Tensor)])
    return full_peak


def _nbytes(t: torch.Tensor) -> int:
    with contextlib.suppress(Exception):
        return t.untyped_storage().nbytes()
    return t.nbytes


__all__ = ["SplitCost", "has_split_backward", "split_costs"]
