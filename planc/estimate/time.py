"""Step-time model: communication bytes, FLOPs and the FSDP2 overlap schedule of one training step.

Everything here is an **estimate**, computed without torch.distributed and without a GPU,
from the lowered program (`planc/lower/program.py`), the model graph, one traced step of the
model (`StepProfile`) and a hardware profile (`planc/estimate/hardware.py`).

API (what `planc explain` and `planc suggest` call)::

    profile = step_profile(graph, input_shape=(8, 4096))        # once per model + input
    st = estimate_step_time(compiled, world=64, hardware="h100", profile=profile)
    st.total_s, st.exposed_comm_s, st.tokens_per_s, st.mfu, st.per_unit[i].comm ...

`step_profile(graph, inputs=None, *, input_shape=None, loss=None) -> StepProfile`
    Runs one forward and backward of the plain model on fake CPU tensors (no memory) under
    torch's `FlopCounterMode`, and records per module (by path): forward FLOPs, the forward
    FLOPs of the ops selective checkpointing recomputes, backward FLOPs, the order modules
    first run, and the shapes of each module's first floating-point input and output (for
    tensor-parallel collectives). It does not depend on the plan: cached per (graph, input,
    loss), so a search over units, reshard, precision, offload, checkpointing, prefetch and
    mesh sizes traces the model once.

`estimate_step_time(plan, *, world, hardware="h100", profile=None, graph=None, input_shape=None,
inputs=None, loss=None, optimizer="adamw", efficiency=None) -> StepTime`
    `plan` is a `CompiledPlan` or a lowered `Program` (then `graph` is required). `hardware`
    is a profile name, a TOML/JSON path or a `Hardware`; `efficiency` overrides the profile's
    achievable fraction of peak FLOP/s. Without a profile (and no input), FLOPs are 0 and only
    communication is timed. Pure arithmetic over the program and profile: no tracing, no
    torch ops; milliseconds for a 126-block model.

`StepTime` holds `per_unit` (a `UnitTime` per `fully_shard` call, in program order: its
collectives as `Collective(kind, axis, ranks, bytes, phase)`, forward/backward/recompute
FLOPs, compute seconds), `totals` of bytes per (kind, axis), `compute_s`, `comm_s` (all
collectives' busy time), `exposed_comm_s` (collective time the compute stream waits for),
`optimizer_s`, `total_s`, `tokens_per_s`, `mfu`, the `hardware` and the `assumptions` (the
list of sentences every output prints).

What is modelled (torch 2.13 FSDP2; docs/time-model.md says it at length):

* bytes, exact: a unit all-gathers once per unshard all its parameters' shards, dim 0
  padded to a multiple of the shard size (`FSDPParam` chunks and pads), in `param_dtype`
  (nccl-tests size = the gathered output); a unit resharded after forward (`true`) gathers
  again in backward on the shard axis; `reshard after_forward = N` gathers in backward within
  groups of N ranks; `false` does not gather again; one reduce-scatter per unit in backward of
  the gradients (padded, `reduce_dtype`; size = the input); with HSDP one all-reduce of the
  reduce-scatter output across the replicate axis; offload copies the sharded parameters
  host->device at each all-gather and the sharded gradients device->host; tensor-parallel
  styles move activations (see `_tp_collectives`).
* FLOPs: `FlopCounterMode` counts per module; a unit's are those of its modules' subtrees
  minus nested units'; `full` checkpointing adds the module's forward again in backward;
  `selective` adds the forward FLOPs of the ops it does not save (everything but matmuls and
  attention: by FlopCounterMode's count, usually 0).
* time: compute = FLOPs / (peak for the unit's compute dtype x efficiency); collectives in
  alpha-beta form on the link their group spans; the schedule FSDP2 runs: forward all-gathers
  issued at each unit's pre-forward (implicitly one unit ahead, since the CPU runs ahead,
  at most two all-gathers in flight) or by explicit prefetch lists; backward all-gathers at
  pre-backward with the default prefetch of the next unit in reverse post-forward order (or the
  explicit lists); reduce-scatters after each unit's backward compute, overlapping the next
  unit's; collectives share one network queue in issue order; TP collectives block compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from planc.estimate.hardware import Hardware
from planc.estimate.hardware import hardware as hardware_of
from planc.lower.lowering import tensor_dims
from planc.lower.program import FullyShard, Program

PHASES = ("forward", "backward", "optimizer")
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "host_to_device", "device_to_host")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _padded(shape: tuple[int, ...], shard: int, dim: int = 0) -> int:
    """Elements per rank of one parameter: `dim` padded to a multiple of `shard` (FSDP2's chunking)."""
    if not shape:
        return 1
    rest = math.prod(shape) // shape[dim] if shape[dim] else 0
    return -(-shape[dim] // shard) * rest


@dataclass(frozen=True)
class Collective:
    """One collective (or host copy) of one unit: `bytes` in nccl-tests' size convention.

    all_gather: the gathered output; reduce_scatter: the input; all_reduce: the buffer;
    host_to_device / device_to_host: the bytes copied. `ranks` is the group size, `axis` the
    mesh axis (`shard`, `replicate`, `tensor`, `host`), `phase` forward or backward.
    """

    kind: str
    axis: str
    ranks: int
    bytes: int
    phase: str
    what: str = ""          # "params", "grads", or the module a TP collective belongs to
    stride: int = 1         # distance between consecutive ranks of the group (link class)


@dataclass
class UnitTime:
    """One unit's share of the step."""

    name: str
    index: int
    collectives: list[Collective] = field(default_factory=list)
    forward_flops: int = 0
    backward_flops: int = 0
    recompute_flops: int = 0
    compute_dtype: str = "float32"
    forward_s: float = 0.0
    backward_s: float = 0.0    # including recompute
    comm_s: float = 0.0        # busy time of this unit's collectives

    def bytes(self, kind: str | None = None, axis: str | None = None, phase: str | None = None) -> int:
        return sum(c.bytes for c in self.collectives if (kind is None or c.kind == kind)
                   and (axis is None or c.axis == axis) and (phase is None or c.phase == phase))

    @property
    def flops(self) -> int:
        return self.forward_flops + self.backward_flops + self.recompute_flops


# ===================================================================== communication, exact


def _group_dtype(op: FullyShard, graph) -> torch.dtype:
    infos = [graph.params[p] for p in op.params]
    return infos[0].dtype if infos else torch.float32


def unit_collectives(program: Program, graph, world: int) -> list[list[Collective]]:
    """Every `fully_shard` unit's collectives for one step at `world` ranks (FSDP part only).

    Bytes are exact for torch 2.13's FSDP2: per parameter `ceil(dim / shard) * rest` elements
    per rank (`Shard(d)` placements pad dim d instead), the tensor-parallel local shape when
    the parameter is TP-sharded; the all-gather packs all of a unit's parameters into one
    collective (`foreach_all_gather`), the reduce-scatter all its gradients.
    """
    sizes = program.mesh.sizes(world) or {"shard": world}
    replicate, shard, tp = sizes.get("replicate", 1), sizes.get("shard", 1), sizes.get("tensor", 1)
    tp_dims = tensor_dims(program, graph) if tp > 1 else {}
    out: list[list[Collective]] = []
    for op in program.units:
        placed = dict(op.placements)
        precision = op.policy.precision
        ag = rs = sharded = sharded_grad = 0
        for name in op.params:
            info = graph.params[name]
            shape = tuple(info.shape)
            if name in tp_dims:  # FSDP shards the tensor-parallel local shard
                shape = tuple(-(-n // tp) if d == tp_dims[name] else n for d, n in enumerate(shape))
            per_rank = _padded(shape, shard, placed.get(name, 0))
            ag += per_rank * shard * _itemsize(precision.compute_dtype(info.dtype))
            sharded += per_rank * _itemsize(info.dtype)
            if info.requires_grad:
                rs += per_rank * shard * _itemsize(precision.reduce(info.dtype))
                sharded_grad += per_rank * _itemsize(info.dtype)
        cs: list[Collective] = []
        stride = tp  # the shard axis sits outside the tensor axis
        reshard = op.policy.reshard_after_forward
        offload = op.policy.offload.enabled
        if shard > 1 and ag:
            cs.append(Collective("all_gather", "shard", shard, ag, "forward", "params", stride))
            if offload:
                cs.append(Collective("host_to_device", "host", 1, sharded, "forward", "params"))
            if reshard is True or (not isinstance(reshard, bool) and reshard >= shard):
                cs.append(Collective("all_gather", "shard", shard, ag, "backward", "params", stride))
                if offload:
                    cs.append(Collective("host_to_device", "host", 1, sharded, "backward", "params"))
            elif not isinstance(reshard, bool) and reshard > 1:
                # hpZ: the backward all-gather runs within groups of N ranks of the shard axis
                cs.append(Collective("all_gather", "shard", int(reshard), ag, "backward", "params", stride))
        if rs and shard > 1:
            cs.append(Collective("reduce_scatter", "shard", shard, rs, "backward", "grads", stride))
        if rs and replicate > 1:
            cs.append(Collective("all_reduce", "replicate", replicate, rs // shard, "backward", "grads",
                                 stride * shard))
        if offload and rs:
            cs.append(Collective("device_to_host", "host", 1, sharded_grad, "backward", "grads"))
        out.append(cs)
    return out


def _tp_collectives(*args: Any, **kwargs: Any) -> list[Collective]:  # filled in below
    return []


def totals(units: Iterable[UnitTime]) -> dict[str, dict[str, int]]:
    """Bytes per collective kind per mesh axis, over the step."""
    out: dict[str, dict[str, int]] = {}
    for u in units:
        for c in u.collectives:
            out.setdefault(c.kind, {}).setdefault(c.axis, 0)
            out[c.kind][c.axis] += c.bytes
    return out


@dataclass
class StepTime:
    """The estimated time of one training step on one rank (see the module docstring)."""

    world: int
    hardware: Hardware
    per_unit: list[UnitTime]
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    optimizer_s: float
    total_s: float
    tokens: int | None
    model_flops: int
    assumptions: list[str]

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second per rank (None without an input)."""
        return self.tokens / self.total_s if self.tokens and self.total_s else None

    @property
    def mfu(self) -> float | None:
        """Model FLOPs (forward + backward, no recompute) / (step time x peak bf16 FLOP/s)."""
        if not self.model_flops or not self.total_s:
            return None
        return self.model_flops / (self.total_s * self.hardware.bf16_flops)

    def totals(self) -> dict[str, dict[str, int]]:
        return totals(self.per_unit)


def estimate_step_time(plan, *, world: int, hardware: "str | Hardware" = "h100", profile=None, graph=None,
                       input_shape: tuple[int, ...] | None = None, inputs=None, loss=None,
                       optimizer: str = "adamw", efficiency: float | None = None) -> StepTime:
    """The estimated step time of `plan` at `world` ranks (see the module docstring)."""
    raise NotImplementedError  # pragma: no cover (filled in next)


__all__ = ["Collective", "UnitTime", "StepTime", "estimate_step_time", "unit_collectives", "hardware_of", "KINDS"]
