"""The lowered program: what will be done to one part of the model, as a typed, ordered list of operations.

Each part of the job (`planc/lower/job.py`: a pipeline stage, or the whole model) has one;
with the job's views, schedule and step ops it is the only contract between the compiler and
its backends. `planc/lower/lowering.py`
makes it from a resolved plan; `planc.backends.runtime` executes it, `planc.backends.emit`
prints it, and the trace and memory models replay it. Operations name modules and
parameters by their paths in the model, so a program can be printed, compared and replayed
without the live model; only the runtime turns paths into objects.

    Checkpoint   activation checkpointing of one module (before sharding)
    Compile      `module.compile(...)` of one module (before sharding)
    Parallelize  one tensor-parallel style on one module, on the tensor axis (first of all)
    AttendOverContext  one attention module's causal SDPA gathers K/V over the context axis
    DispatchExperts  one experts container keeps its rank's experts; tokens reach them by all-to-all
    FullyShard   one `fully_shard` call: a unit, bottom-up, the root last
    SetPrefetch  an explicit forward/backward prefetch list of one unit
    UnitMethod   an `FSDPModule` method called on one unit after sharding
                 (`set_gradient_divide_factor(1.0)` and the like)

A new kind of operation is a new op type here, lowered in `lowering.py`; a backend that
meets an op it does not know refuses it (never skips it silently).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Union

import torch

from planc.resolve.ir import Setting
from planc.resolve.mesh import Mesh
from planc.resolve.tensor import REPLICATE, STYLE_KINDS, Layout, TensorStyle  # noqa: F401 (part of the program's contract)

# FSDP2's own defaults for the arguments planc sets (torch 2.13; tests/test_lower.py checks
# them against the installed torch's signatures). A backend that prints code leaves out an
# argument equal to its default, as a person would.
MP_DEFAULTS: Mapping[str, Any] = {"param_dtype": None, "reduce_dtype": None, "output_dtype": None,
                                  "cast_forward_inputs": True}
FULLY_SHARD_DEFAULTS: Mapping[str, Any] = {"reshard_after_forward": None, "shard_placement_fn": None,
                                           "ignored_params": None}
CPU_OFFLOAD_DEFAULTS: Mapping[str, Any] = {"pin_memory": True}


@dataclass(frozen=True, slots=True)
class Precision:
    """`MixedPrecisionPolicy` arguments, as the plan set them (None: FSDP2's default)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def compute_dtype(self, stored: torch.dtype) -> torch.dtype:
        """The dtype a parameter stored in `stored` is all-gathered and computed in."""
        return self.param_dtype or stored

    def reduce(self, stored: torch.dtype) -> torch.dtype:
        """The dtype its gradient is reduced in: `reduce_dtype`, else the compute dtype."""
        return self.reduce_dtype or self.compute_dtype(stored)

    @property
    def casts_inputs(self) -> bool:
        """True when FSDP2 casts the unit's floating-point inputs to `param_dtype`."""
        return self.cast_forward_inputs and self.param_dtype is not None

    def changed(self) -> dict[str, Any]:
        """The arguments that differ from `MixedPrecisionPolicy()`'s defaults, in order."""
        return {k: getattr(self, k) for k in MP_DEFAULTS if getattr(self, k) != MP_DEFAULTS[k]}


@dataclass(frozen=True, slots=True)
class Offload:
    """`CPUOffloadPolicy(pin_memory=...)` when `enabled`, else `OffloadPolicy()` (none).

    Pinning needs an accelerator: on a CPU mesh the data is on the CPU already, so the
    backends pin only when the mesh's device is not the CPU.
    """

    enabled: bool = False
    pin_memory: bool = True


@dataclass(frozen=True)
class Policy:
    """A unit's effective FSDP2 policy: every default resolved, each value's origin kept.

    `reshard_after_forward` is what FSDP2 will do (True/False/N); `reshard_argument` is
    what is passed (None leaves FSDP2's own default: True for inner units, False for the
    root). `origins` maps each plan setting to the `Setting` (value, line, rule) it came from.
    """

    reshard_after_forward: bool | int
    reshard_argument: bool | int | None
    precision: Precision
    offload: Offload
    origins: Mapping[str, Setting] = field(default_factory=dict)


@dataclass(frozen=True)
class Parallelize:
    """`parallelize_module(module, mesh[axis], style)`: one style on one module, before any FSDP.

    `axis` is the `DeviceMesh` axis name the style runs on (the tensor axis).
    """

    module: str
    style: TensorStyle
    axis: str
    origin: Setting
    span: Any = None


@dataclass(frozen=True, slots=True)
class AttendOverContext:
    """`planc.backends.context.attend_over_context(module, mesh[axis].get_group())`: the module's
    causal SDPA attends over every context rank's keys and values (before any FSDP)."""

    module: str
    axis: str
    origin: Setting


@dataclass(frozen=True, slots=True)
class DispatchExperts:
    """`planc.backends.experts.dispatch_experts(module, expert mesh, axis)`: the experts container
    keeps the `experts / expert` experts of its expert rank, and the rows routed to an expert move
    to its rank and back by all-to-all with uneven splits (before any FSDP).

    `axis` is the expert axis's name on the expert view (`planc/lower/job.py::EXPERT`);
    `experts` the container's expert count (dim 0 of its 3-D weights); `params` its parameters.
    `averaged`: FSDP averages the gradients of the unit that holds them (no `reduction
    divide_factor`), so the dispatch scales the experts' gradients by `tensor / expert`; with a divide
    factor FSDP divides dense and expert sums by the same number and the dispatch scales nothing.
    With a tensor axis, `tensor` names it on the dense view and `layer` is the MoE layer (the
    container's parent) whose tokens the tensor group's ranks split (`split_over_tensor`).
    """

    module: str
    axis: str
    experts: int
    params: tuple[str, ...]
    origin: Setting
    averaged: bool = True
    tensor: str | None = None
    layer: str | None = None


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Activation checkpointing of `module` (torch's composable `checkpoint`: paths unchanged)."""

    module: str
    mode: str
    origin: Setting


@dataclass(frozen=True, slots=True)
class Compile:
    """`module.compile(**options)`, in place (module paths and state-dict keys unchanged)."""

    module: str
    options: tuple[tuple[str, Any], ...]
    origin: Setting


@dataclass(frozen=True)
class FullyShard:
    """One `fully_shard` call: `modules` as one unit (a list call for a group), on the submesh of `axes`.

    Attributes:
        name: the unit's name (`<root>`, `layers.0`, `[norm, output]`).
        modules: module paths (`("",)` for the root).
        is_root: the root unit (the whole model), sharded last.
        axes: the `DeviceMesh` axis names of the data-parallel submesh, outermost first.
        policy: the effective policy.
        params: canonical names of the parameters this call manages (claimed by no earlier
            call, not ignored), in registration order.
        placements: (parameter, dim) for parameters sharded on a dim other than 0.
        ignored: parameters in the unit's subtrees that FSDP leaves alone (`ignored_params`).
        experts: (parameter, dim) for expert-parallel experts' parameters: sharded on the expert
            view's FSDP axes `expert_axes` instead (`ShardPlacementResult`, a per-parameter mesh),
            on dim 0, or 1 when efsdp x expert > experts (torchtitan's rule).
        rule: the plan statement that made the unit, and `span` its location.
    """

    name: str
    modules: tuple[str, ...]
    is_root: bool
    axes: tuple[str, ...]
    policy: Policy
    params: tuple[str, ...]
    placements: tuple[tuple[str, int], ...] = ()
    ignored: tuple[str, ...] = ()
    rule: str = ""
    span: Any = None
    experts: tuple[tuple[str, int], ...] = ()
    expert_axes: tuple[str, ...] = ()
    placement_spans: Mapping[str, Any] = field(default_factory=dict)  # parameter -> `place` line
    ignored_spans: Mapping[str, Any] = field(default_factory=dict)    # parameter -> `ignore` line

    @property
    def is_group(self) -> bool:
        return len(self.modules) > 1


@dataclass(frozen=True, slots=True)
class SetPrefetch:
    """`unit.set_modules_to_{direction}_prefetch([targets...])`, after every unit is sharded."""

    unit: str
    direction: str  # "forward" | "backward"
    targets: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class UnitMethod:
    """`unit.<method>(*args)`: an `FSDPModule` method called after sharding (a runtime knob)."""

    unit: str
    method: str
    args: tuple[Any, ...]
    origin: Setting


Op = Union[Parallelize, AttendOverContext, DispatchExperts, Checkpoint, Compile, FullyShard, SetPrefetch, UnitMethod]


@dataclass(frozen=True)
class Program:
    """A lowered plan: the mesh and the operations, in the order they run."""

    mesh: Mesh
    ops: tuple[Op, ...]

    @property
    def units(self) -> tuple[FullyShard, ...]:
        """The `fully_shard` calls in order: bottom-up, the root last."""
        return tuple(op for op in self.ops if isinstance(op, FullyShard))

    def unit(self, name: str) -> FullyShard:
        for op in self.units:
            if op.name == name:
                return op
        raise KeyError(name)

    def of_type(self, kind: type) -> tuple:
        return tuple(op for op in self.ops if isinstance(op, kind))

    def prefetch(self, direction: str) -> dict[str, tuple[str, ...]]:
        """Unit name -> the units it prefetches explicitly in `direction`."""
        return {op.unit: op.targets for op in self.of_type(SetPrefetch) if op.direction == direction}
