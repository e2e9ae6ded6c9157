"""The step time `planc suggest` minimises: planc's step-time model, behind one narrow call.

    cost(program, context) -> seconds

is `planc.estimate.time.estimate_step_time(program, ...).total_s`: FSDP2's collectives per
unit (exact bytes), tensor-parallel collectives, the FLOPs of one traced step plus what
checkpointing recomputes, on a hardware profile, with the overlap schedule FSDP2 runs
(docs/time-model.md). The search calls nothing else, so every figure a suggested plan's
header prints is that model's estimate. The step's compute profile (`StepProfile`) is
traced once per model and input (`context.profile`), so a call is arithmetic over the
program: milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.estimate.hardware import Hardware
from planc.lower.program import Program


@dataclass
class CostContext:
    """What the cost needs besides the program: the model graph, ranks, tokens, hardware, profile."""

    graph: object
    world: int
    tokens: int                # tokens per rank per step (batch x sequence)
    hardware: Hardware
    profile: object = None     # planc.estimate.flops.StepProfile of the model and input (None: communication only)
    optimizer: str = "adamw"


def context(graph, world: int, shape: tuple[int, ...] | None, hardware: Hardware, optimizer: str = "adamw",
            inputs=None) -> CostContext:
    """The context for `graph` at `world` ranks and a (batch, seq) `shape` of token ids, or the
    model's `inputs` (a tuple, dict or `Example`, as `planc explain --inputs` takes them): the
    step profiled once, in bf16 (the precision the suggested plans compute in)."""
    import torch

    from planc.estimate.flops import step_profile
    if inputs is not None:
        profile = step_profile(graph, inputs, dtype=torch.bfloat16, repeat=True)
        tokens = (profile.tokens or 0) if profile is not None else 0
    else:
        profile = step_profile(graph, input_shape=tuple(shape), dtype=torch.bfloat16, repeat=True)
        tokens = shape[0] * shape[1]
    return CostContext(graph, world, tokens, hardware, profile, optimizer)


def estimate(program: Program, context: CostContext):
    """The full `StepTime` of `program` (planc/estimate/time.py)."""
    from planc.estimate.time import estimate_step_time
    return estimate_step_time(program, world=context.world, hardware=context.hardware, profile=context.profile,
                              graph=context.graph, optimizer=context.optimizer)


def cost(program: Program, context: CostContext) -> float:
    """Estimated seconds of one training step of `program` (planc's step-time model)."""
    return estimate(program, context).total_s
