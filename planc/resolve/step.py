"""The `step` statement: what one optimizer step runs, resolved from the plan.

    step { accumulate 4, sync = last }

`accumulate N` splits each rank's batch of one optimizer step into N microbatches, each run
forward and backward before the one optimizer step (gradient accumulation). `sync` says when
the data-parallel gradients are reduced: `every` microbatch (FSDP2's default: each backward
reduce-scatters and the sharded gradients accumulate), or only on the `last` (FSDP2's
`set_requires_gradient_sync(False)` before the others: the unsharded gradients accumulate on
every rank, one reduce-scatter per step). The lowering turns it into the job's schedule
(`planc/lower/job.py::step_schedule`); without a `step` line a step is one microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.diagnostics import Diagnostic
from planc.lang import syntax as st
from planc.resolve.ir import Setting
from planc.resolve.options import OptionSpec, Param, bind_block, enum, positive_int, replaced

# When the gradients are reduced over the data-parallel axes (see the module docstring).
GRADIENT_SYNC = ("every", "last")


class MicrobatchError(ValueError):
    """A step's batch does not divide into the plan's microbatches (`step { accumulate N }`)."""


def check_splits(shape: tuple[int, ...], microbatches: int) -> None:
    """The one rule for splitting a batch tensor into microbatches: its first dimension (the batch)
    into `microbatches` equal parts (what the runtime, the trace and the step time all do).

    Raises:
        MicrobatchError: `shape` is a scalar's or its batch does not divide.
    """
    if microbatches == 1:
        return
    if not shape or shape[0] % microbatches:
        size = "a scalar" if not shape else f"a batch of {shape[0]}"
        raise MicrobatchError(f"an input of shape {tuple(shape)} has {size}, which does not divide into {microbatches} "
                              f"microbatches (`step {{ accumulate {microbatches} }}`): give a batch that is a multiple "
                              f"of {microbatches}")


@dataclass(frozen=True)
class Accumulation:
    """Microbatches per optimizer step and when their gradients are reduced (`GRADIENT_SYNC`)."""

    microbatches: int = 1
    sync: str = "every"

    def show(self) -> str:
        if self.microbatches == 1:
            return "one microbatch per step"
        when = "after every microbatch" if self.sync == "every" else "once, after the last microbatch"
        return f"{self.microbatches} microbatches per step, gradients reduced {when}"


STEP_OPTIONS: dict[str, OptionSpec] = {
    "accumulate": OptionSpec(
        params=(Param("microbatches", positive_int, None), Param("sync", enum(*GRADIENT_SYNC), None)),
        positional=("microbatches",),
        summary="gradient accumulation: run N microbatches forward and backward per optimizer step; "
                "`sync = every` reduces gradients after each (the default), `sync = last` only after the last"),
}


def resolve_step(stmts: tuple, file: str, diags: list[Diagnostic]) -> Setting | None:
    """The `Accumulation` of the plan's last `step` line as a `Setting` (None without one).

    Diagnoses unknown options (P101), bad arguments (P103) and an option given twice (P207);
    an earlier `step` line of the plan itself is replaced by the last (P207).
    """
    steps = [(i, s) for i, s in enumerate(stmts) if isinstance(s, st.StepStmt)]
    if not steps:
        return None
    for _, stale in steps[:-1]:
        diags += replaced(stale, steps[-1][1], "step", file)
    setting = None
    for order, stmt in steps:  # a replaced line's mistakes are still mistakes
        setting = _resolve_block(order, stmt, diags)
    return setting


def _resolve_block(order: int, stmt: st.StepStmt, diags: list[Diagnostic]) -> Setting:
    assigned = bind_block(stmt.block, STEP_OPTIONS, "step", "step { accumulate 4, sync = last }", diags)
    values = {a.key: a.value for a in assigned}
    span = assigned[-1].span if assigned else stmt.span
    return Setting(Accumulation(values.get("microbatches", 1), values.get("sync", "every")), span, "step", order)
