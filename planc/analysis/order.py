"""Record the order of one real training step's FSDP2 collectives and unit compute starts.

The oracle of the step-time model's schedule (`planc/estimate/time.py`, `StepTime.order`):
on a model that `planc.apply` sharded on a live process group (e.g. 2 gloo ranks), one
training step (per microbatch: forward, loss, backward, gradient sync as the plan says) runs
under `planc.analysis.comms`' dispatch-mode recorder, and the step's events come back in the
order they happened, as `(kind, unit, phase)` triples, the simulator's vocabulary:

* `("all_gather", unit, phase)`: a c10d all-gather issued inside the unit's `unshard`
  (its own pre-forward / pre-backward, or a prefetch by another unit);
* `("compute", unit, "forward")`: the first forward pre-hook of any of the unit's modules,
  registered after FSDP2's own, so it fires once FSDP2's pre-forward (all-gather, wait,
  forward prefetch) has returned: the moment the unit's forward compute may start;
* `("compute", unit, "backward")`: the return of FSDP2's pre-backward hook for the unit (its
  unshard, wait and backward prefetch), the moment its gradient computation may start. A
  module's full-backward pre-hook cannot stand in: it fires on the grad of the module's
  wrapped output, before FSDP2's hook on the inner tensor, i.e. before the unit's all-gather;
* `("reduce_scatter", unit, "backward")`, `("all_reduce", unit, "backward")`: c10d
  collectives issued inside the unit's `post_backward`.

Each unit's compute is recorded once per phase per microbatch. A collective issued outside
every unit's `unshard`/`post_backward` is recorded with unit `tensor` or `other`, so that a
collective nobody expects shows up in a comparison instead of vanishing.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from planc.analysis.comms import Recorded, _attributed, _Recorder
from planc.estimate.trace import Example, LossFn, default_loss

Event = tuple[str, str, str]  # (kind, unit, phase), as `StepTime.order`


class _OrderRecorder(_Recorder):
    """comms' collective recorder plus the units' compute starts, in one list."""

    def __init__(self) -> None:
        super().__init__()
        self.started: set[str] = set()

    def start(self, unit: str) -> None:
        if unit not in self.started:
            self.started.add(unit)
            self.found.append(Recorded("compute", unit, 0, 0, self.phase))

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.started = set()


@contextlib.contextmanager
def _compute_starts(recorder: _OrderRecorder, model: nn.Module, units: dict[str, tuple[str, ...]],
                    groups: dict[tuple[int, ...], str]):
    """Forward pre-hooks on every unit module and a wrapper of FSDP2's pre-backward hook."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    handles = []
    for name, paths in units.items():
        for path in paths:
            module = model.get_submodule(path) if path else model
            handles.append(module.register_forward_pre_hook(lambda *_, n=name: recorder.start(n)))
    saved = FSDPState._pre_backward

    def pre_backward(self, grad):  # FSDP2 registers the bound method during forward: patched in time
        out = saved(self, grad)
        for group in self._fsdp_param_groups:
            recorder.start(groups.get(tuple(id(m) for m in group.modules), "?"))
        return out

    FSDPState._pre_backward = pre_backward
    try:
        yield
    finally:
        FSDPState._pre_backward = saved
        for h in handles:
            h.remove()


def record_order(applied, inputs: Any, loss: LossFn | None = None) -> list[Event]:
    """The events of one training step of a model sharded by `planc.apply`, in the order they ran.

    Args:
        applied: the `AppliedPlan` `planc.apply` returned (its model is the one trained).
        inputs: the step's inputs (a tensor, tuple, dict or `Example`), split into the plan's
            microbatches as `AppliedPlan.accumulate` splits them.
        loss: the step's loss (default `default_loss`).

    Runs under the caller's process group; every rank must call it (the collectives are real).
    """
    model, compiled = applied.model, applied.compiled
    units = {op.name: tuple(op.modules) for op in compiled.program.units}
    groups = {tuple(id(model.get_submodule(p)) if p else id(model) for p in paths): name
              for name, paths in units.items()}
    example = Example.of(inputs)
    step_loss = loss or default_loss(model)
    recorder = _OrderRecorder()
    with _compute_starts(recorder, model, units, groups), _attributed(recorder, groups), recorder:
        k = applied.microbatches
        for mb in range(k):
            applied.gradient_sync(mb)
            part = example.microbatch(k, mb)
            recorder.enter("forward")
            pred = model(*part.args, **part.kwargs)
            with applied.loss_parallel():
                value = step_loss(pred, part)
                del pred
                recorder.enter("backward")
                value.backward()
    return [(r.kind, r.unit, r.phase) for r in recorder.found]
