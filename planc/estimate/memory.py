"""Per-rank memory model: what a plan costs on each rank, before anything runs.

Two parts, both without torch.distributed and without a GPU:

* **State bytes, exact.** For each unit, the bytes FSDP2 allocates per rank: sharded
  parameters (dim 0 padded to a multiple of the shard size, `torch.chunk` semantics, in the
  parameter's storage dtype), sharded gradients (same), optimizer state (AdamW: two states
  the size of the sharded parameters plus one 4-byte step counter per parameter; SGD without
  momentum: none), the all-gather output (padded, in `param_dtype`) and the reduce-scatter
  input (padded, in `reduce_dtype`). Offloaded units keep their state on the host.
* **A replay of one training step.** FSDP2's schedule is replayed unit by unit: all-gather
  at pre-forward (and at pre-backward when resharded), the explicit or default backward
  prefetch (the next unit in reverse post-forward order), reshard after forward (`true`
  frees, `false` keeps, `N` keeps a 1/N slice), reshard then reduce-scatter at post-backward
  (a group unit `[a, b]` is one FSDP parameter group, as in torch 2.13: gathered once in
  forward and once in backward, one reduce-scatter of all its gradients, after the member that
  ran forward first finishes backward; under expert parallelism a unit is two groups, dense and
  expert, each gathered into its own buffer and copied out in turn: `Gather`), the all-gather output
  alive during each copy-out and kept until the next copy-out in forward (one for all groups),
  one reduce-scatter input kept alive until the next one (torch 2.13's default
  `reduce_scatter_max_input_buffers = 1`; planc sets no other), extra
  copies for `Shard(d != 0)` parameters, then the optimizer step (foreach AdamW needs one
  temporary the size of the sharded parameters). When an input is given, the replay is driven by a
  forward and backward of the model on **fake CPU tensors** (shapes only, no memory): a
  dispatch mode records the live bytes of every tensor that is not a parameter
  (activations, temporaries, unsharded gradients until their unit's reduce-scatter), with
  each unit's precision and checkpointing applied; FSDP2's buffers are added around it.
  Without an input, activations are left out and the replay walks the units in module order.
  On a 2-D plan the traced step is one tensor rank's (planc/estimate/tensor_local.py): the
  split parameters in their local shapes, each style's gathers and scatters on plain tensors.

The traced step is a training step: the model's forward on the given inputs, the loss
(by default, for a language model, cross-entropy over the logits upcast to fp32, as
torchtitan and Hugging Face take it: the fp32 logits, log-softmax and their gradients are
counted; otherwise the output's sum; or the loss the caller gives), its backward, and the
optimizer step (foreach or fused AdamW/Adam, SGD). Buffers (RoPE caches, position ids) are
counted whole on every rank. `clip_grad_norm_` costs one scalar per gradient and is not
modelled (the simulation runs it).

Counted: tensor bytes only (no CUDA context, NCCL or allocator workspaces, fragmentation).
Checked against `planc.analysis.simulate` (FSDPMemTracker in a fake process group) and against real
2-rank gloo runs: tests/test_memory.py, tests/test_memory_dist.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from planc.estimate.context_local import context_degree, shard_example
from planc.estimate.expert_local import expert_degree, expert_fsdp_degree, local_expert_shape
from planc.estimate.trace import Example, Trace, TraceError, default_input, trace_for
from planc.limits import rank_count
from planc.lower.fsdp import (
    STEP_COUNTER_BYTES,
    compute_dtypes,
    default_backward_prefetch,
    fsdp_shape,
    has_moments,
    optimizer_state_bytes,
    reshard_group,
    root_index,
    shard_numel,
)
from planc.lower.job import FORWARD, FULL_BACKWARD, LossParallel, Reader, Schedule, ShardBatch, step_schedule
from planc.lower.lowering import tensor_dims
from planc.lower.program import (
    AttendOverContext,
    Checkpoint,
    Compile,
    DispatchExperts,
    FullyShard,
    Parallelize,
    Program,
    SetPrefetch,
    UnitMethod,
)

# "adamw"/"adam": torch's foreach implementation (the default); "*_fused": fused=True.
OPTIMIZERS = ("adamw", "adamw_fused", "adam", "adam_fused", "sgd", "none")
CATEGORIES = ("sharded_params", "sharded_grads", "optimizer_state", "unsharded_params", "all_gather",
              "reduce_scatter", "unsharded_grads", "activations", "optimizer_temp", "inputs", "buffers")


def foreach_temp(optimizer: str) -> bool:
    """foreach Adam(W) materialises sqrt(exp_avg_sq) for all parameters at once; fused does not."""
    return optimizer in ("adamw", "adam")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


# ===================================================================== per-unit bytes


@dataclass(frozen=True)
class Gather:
    """One FSDP parameter group of a unit, as FSDP2 all-gathers it. A unit is one group, or two
    with expert parallelism (per-parameter meshes: dense and expert, in the order their first
    parameters come): each has its own all-gather output, issued, copied out and freed on its own."""

    unsharded: int              # its all-gathered parameters in param_dtype, padded
    gathered: int               # its all-gather output (0: experts on a 1-rank efsdp mesh gather nothing)
    copy_in: int                # this rank's shard copied into the output (param_dtype)
    dim_copy: int = 0           # Shard(d != 0) parameters: the chunk + cat temporary
    ranks: int = 1              # its mesh's size (FSDP2 keeps a forward all-gather result only over > 1 rank)


@dataclass(frozen=True)
class UnitMemory:
    """Bytes one unit costs on one rank (state on the device unless `offload`)."""

    name: str
    index: int
    params: int                 # parameter count (elements, unsharded)
    sharded: int                # sharded parameters, storage dtype, padded
    unsharded: int              # all-gathered parameters in param_dtype, padded
    grad_unsharded: int         # gradients before reduce-scatter, in param_dtype, unpadded
    reduce_scatter: int         # reduce-scatter input in reduce_dtype, padded
    grads: int                  # sharded gradients (storage dtype)
    optimizer: int              # optimizer state
    post_forward: int           # kept after forward: unsharded (false), a 1/N slice (int N), 0 (true)
    offload: bool
    reshard: bool | int
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    param_names: tuple[str, ...] = ()
    shard_dim_copy: int = 0     # Shard(d != 0) parameters: gathered/reduced via an extra copy (param_dtype)
    reduce_of: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # param -> (reduce-scatter, grad)
    groups: tuple[Gather, ...] = ()  # its FSDP parameter groups (`Gather`), in torch's order

    @property
    def all_gather(self) -> int:
        return sum(g.gathered for g in self.groups)

    def reduce_bytes(self, names: Iterable[str]) -> tuple[int, int]:
        """Reduce-scatter input and sharded-gradient bytes of some of the unit's parameters."""
        pairs = [self.reduce_of[n] for n in names if n in self.reduce_of]
        return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


def unit_memory(program: Program, graph, world: int, optimizer: str = "adamw") -> list[UnitMemory]:
    """Per-rank bytes of every `fully_shard` call of `program` at `world` ranks."""
    replicate, shard = mesh_sizes(program, world)
    sizes = program.mesh.sizes(world) or {}
    tp, tp_dims = sizes.get("tensor", 1), tensor_dims(program, graph)
    ep, efsdp = expert_degree(program, world), expert_fsdp_degree(program, world)
    out = []
    for i, op in enumerate(program.units):
        names = list(op.params)
        infos = [graph.params[p] for p in names]
        placed = dict(op.placements)
        experts = dict(op.experts)  # on the expert view: [experts / ep, ...] over efsdp ranks
        orig = infos[0].dtype if infos else torch.float32
        precision = op.policy.precision
        pdt, rdt = precision.compute_dtype(orig), precision.reduce(orig)
        sharded = unsharded = grad_unsharded = rs = grads = opt = count = dim_copy = 0
        reduce_of = {}
        parts: dict[bool, list[int]] = {}  # expert? -> [unsharded, dim copy, ranks]: its parameter group
        for name, info in zip(names, infos):
            dim = experts.get(name, placed.get(name, 0))
            shape = fsdp_shape(info.shape, tp_dims.get(name), tp)
            over = shard
            if name in experts:
                shape, over = local_expert_shape(info.shape, ep), efsdp
            numel = math.prod(shape)
            per_rank = shard_numel(shape, over, dim)
            part = parts.setdefault(name in experts, [0, 0, over])
            sharded += per_rank * _itemsize(info.dtype)
            unsharded += per_rank * over * _itemsize(pdt)
            part[0] += per_rank * over * _itemsize(pdt)
            if dim and over > 1:  # chunk + cat through a temporary of the full size
                dim_copy += per_rank * over * _itemsize(pdt)
                part[1] += per_rank * over * _itemsize(pdt)
            count += info.numel
            if info.requires_grad:
                reduce_of[name] = (per_rank * over * _itemsize(rdt), per_rank * _itemsize(info.dtype))
                grad_unsharded += numel * _itemsize(pdt)
                rs += per_rank * over * _itemsize(rdt)
                grads += per_rank * _itemsize(info.dtype)
                opt += optimizer_state_bytes(per_rank, info.dtype, optimizer)
        reshard = op.policy.reshard_after_forward
        group = reshard_group(reshard, shard)
        post = unsharded if group is None else 0 if group == shard else unsharded // group
        out.append(UnitMemory(op.name, i, count, sharded, unsharded, grad_unsharded, rs, grads, opt, post,
                              op.policy.offload.enabled, reshard, pdt, rdt, tuple(names), dim_copy, reduce_of,
                              tuple(_gather(size, copy, ranks, expert) for expert, (size, copy, ranks) in parts.items())
                              or (Gather(0, 0, 0),)))
    return out


def _gather(unsharded: int, dim_copy: int, ranks: int, expert: bool) -> Gather:
    """A parameter group's all-gather: the experts' on a 1-rank efsdp mesh gathers nothing (FSDP2
    initialises the unsharded parameters from the local shard)."""
    gathered = 0 if expert and ranks == 1 else unsharded
    return Gather(unsharded, gathered, gathered // ranks, dim_copy, ranks)


def mesh_sizes(program: Program, world: int) -> tuple[int, int]:
    """(replicate, shard) for `world` ranks; a mesh that cannot fill it shards over everything."""
    return program.mesh.dp_sizes(world) or (1, world)


def _replicated_params(program: Program, graph) -> list[str]:
    """Parameters FSDP does not shard: ignored ones and, with `root none`, those of no unit."""
    owned = set().union(*(op.params for op in program.units))
    return [n for n in graph.params if n not in owned]


# ===================================================================== the replay


@dataclass
class Moment:
    """The memory at one point of the step, by category."""

    label: str
    phase: str                  # forward, backward, optimizer
    unit: str
    bytes: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @property
    def gathered(self) -> str | None:
        """The unit being all-gathered at this moment, if any."""
        if self.label.startswith("all-gather "):
            return self.label[len("all-gather "):self.label.rindex(" (")]
        return None


@dataclass
class Estimate:
    """The per-rank memory of one plan at one world size (see `estimate`)."""

    world: int
    replicate: int
    shard: int
    optimizer: str
    units: list[UnitMemory]
    replicated: int                       # bytes of parameters FSDP does not shard (per rank)
    host: int                             # offloaded state, on the host
    peak: Moment
    timeline: list[Moment]
    lower_bound: int
    unsharded_peak_baseline: int          # the same model unsharded (DDP-like)
    activations: int | None               # peak live activation/temporary bytes, if traced
    source: str
    input_shape: tuple[int, ...] | None = None
    notes: list[str] = field(default_factory=list)
    # a pipeline job: every pipeline rank's estimate (this one is the binding rank's, the largest
    # peak, so a bound on it holds for every rank); empty without a pipeline
    roles: list["Estimate"] = field(default_factory=list)
    stages: tuple[int, ...] = ()          # one pipeline rank's estimate: the stages it holds

    @property
    def sharded_state(self) -> int:
        """Parameters + gradients + optimizer state on the device, per rank."""
        return (sum(u.sharded + u.grads + u.optimizer for u in self.units if not u.offload)
                + self.replicated)

    @property
    def ratio_to_lower_bound(self) -> float:
        return self.peak.total / self.lower_bound if self.lower_bound else float("inf")

    def metric(self, name: str) -> float | None:
        """The value of a memory metric (`planc.checks.validate.METRICS`) in bytes; of a pipeline
        job, the largest of its ranks' (`binding`), so a bound on it holds for every rank."""
        if self.roles:
            return self.roles[self.binding(name)].metric(name)
        if name == "memory.peak":
            return float(self.peak.total)
        if name == "memory.sharded":
            return float(self.sharded_state)
        if name == "memory.unsharded_peak":  # the most parameter bytes gathered at once
            return float(max(m.bytes["unsharded_params"] + m.bytes["all_gather"] for m in self.timeline))
        if name == "memory.activations":
            return None if self.activations is None else float(self.activations)
        raise KeyError(name)

    def binding(self, name: str = "memory.peak") -> int:
        """Of a pipeline job, the pipeline rank with the largest `name` (the first of equals)."""
        return max(range(len(self.roles)), key=lambda r: self.roles[r].metric(name) or 0)


class _Replay:
    """FSDP2's per-unit memory state machine, driven by a trace's events through the schedule.

    The trace holds one microbatch's forward (up to the root's pre-backward: the loss is in
    it) and backward; each action of the role replays one of them, the backward reducing its
    gradients or, when the schedule does not reduce on that microbatch (`step { accumulate N,
    sync = last }`), keeping the unsharded gradients for the next one as FSDP2 does under
    `set_requires_gradient_sync(False)`.
    """

    def __init__(self, program: Program, mem: list[UnitMemory], optimizer: str, replicated: int, trace: Trace,
                 shard: int, buffers: int = 0, schedule: Schedule | None = None, input_bytes: int | None = None):
        self.program, self.mem, self.optimizer, self.trace, self.shard = program, mem, optimizer, trace, shard
        self.schedule = schedule or step_schedule()
        self.units = program.units
        self.state = ["sharded"] * len(mem)     # sharded | unsharded | post_forward | prefetched
        self.gathering: dict[int, tuple[set[int], set[int]]] = {}  # prefetched unit -> groups (issued, copied out)
        self.slices: set[int] = set()           # post-forward slices still alive while re-gathered
        self.reduced: dict[int, set[str]] = {i: set() for i in range(len(mem))}  # params with sharded grads
        self.grads_held = 0                     # their sharded gradients' bytes on the device (`reduced`'s)
        self._state_bytes: tuple[int, int] | None = None  # sharded parameters, optimizer state (`snapshot`)
        self.reduced_now: dict[int, set[str]] = {i: set() for i in range(len(mem))}  # ... in this backward
        self.kept: dict[int, int] = {}          # unit -> unsharded gradient bytes kept for the next microbatch
        self.reduces = True                     # this backward reduce-scatters (else keeps, see `kept`)
        self.ag_kept = 0                        # forward: previous all-gather result, freed at next copy-out
        self.rs_kept = 0                        # last reduce-scatter input, freed at next reduce-scatter
        self.post_forward_order: list[int] = []
        self.replicated = replicated
        self.buffers = buffers
        self.input_bytes = trace.input_bytes if input_bytes is None else input_bytes  # the step's whole batch
        self.timeline: list[Moment] = []
        self.live = self.live_grads = 0
        self.phase = "forward"
        self.where = ""
        self.prefix = ""                        # `microbatch 2: ` when the step has several
        self.transient: dict[str, int] = {}

    # --------------------------------------------------------------- accounting
    def snapshot(self, label: str) -> None:
        b = dict.fromkeys(CATEGORIES, 0)
        if self._state_bytes is None:  # the state on the device does not change during the step
            dev = [m for m in self.mem if not m.offload]
            self._state_bytes = (sum(m.sharded for m in dev) + self.replicated, sum(m.optimizer for m in dev) + (
                2 * self.replicated if has_moments(self.optimizer) else 0))
        b["sharded_params"], b["optimizer_state"] = self._state_bytes
        b["sharded_grads"] = self.grads_held
        if self.phase == "optimizer":  # (in backward, unsharded parameters' gradients are in the trace)
            b["sharded_grads"] += self.replicated
        for i, s in enumerate(self.state):
            if s == "unsharded":
                b["unsharded_params"] += self.mem[i].unsharded
            elif s == "post_forward":
                b["unsharded_params"] += self.mem[i].post_forward
            elif s == "prefetched":  # some groups issued (their outputs alive), some copied out already
                issued, copied = self.gathering[i]
                groups = self.mem[i].groups
                b["all_gather"] += sum(groups[g].gathered for g in issued)
                b["unsharded_params"] += sum(groups[g].unsharded for g in copied)
        for i in self.slices:
            b["unsharded_params"] += self.mem[i].post_forward
        b["all_gather"] += self.ag_kept
        b["reduce_scatter"] = self.rs_kept
        b["unsharded_grads"] = self.live_grads + sum(self.kept.values())
        b["activations"] = self.live - self.live_grads
        b["inputs"] = self.input_bytes
        b["buffers"] = self.buffers
        for k, v in self.transient.items():
            b[k] += v
        self.timeline.append(Moment(self.prefix + label, self.phase, self.where, b))

    def _grads_now(self, grads: int) -> int:
        """The trace's live unsharded gradients as they are in this backward: with gradients kept
        from an earlier microbatch in the parameter's own dtype, autograd adds each new one into
        them in place (the trace's copy is not alive); kept in another dtype (`reduce` dtype
        differs), the new ones live beside them until the unit's post-backward adds them in."""
        if self.kept and all(self.mem[i].reduce_dtype == self.mem[i].param_dtype for i in self.kept):
            return 0
        return grads

    # --------------------------------------------------------------- FSDP2 actions
    def issue(self, i: int, label: str, groups: Iterable[int] | None = None) -> None:
        """Start the all-gather of unit `i`'s parameter groups `groups` (default all: a prefetch, in
        forward order, in backward highest first as torch 2.13 prefetches): each one's output
        buffer, and the input copied into it.

        The input is the local shard in param_dtype, or, after `reshard after_forward = N`,
        the kept 1/N slice, which stays alive until the copy-out.
        """
        m = self.mem[i]
        if self.phase == "backward":
            self.ag_kept = 0  # measured: backward's first all-gather releases forward's last one
        if self.state[i] == "post_forward":
            self.slices.add(i)
        if self.state[i] != "prefetched":
            self.state[i] = "prefetched"
            self.gathering[i] = (set(), set())
        if groups is None:
            groups = range(len(m.groups)) if self.phase == "forward" else reversed(range(len(m.groups)))
        for g in groups:
            group = m.groups[g]
            self.gathering[i][0].add(g)
            copy_in = m.post_forward * group.unsharded // max(m.unsharded, 1) if i in self.slices else group.copy_in
            self.transient = {"all_gather": copy_in}
            self.snapshot(label)
            self.transient = {}

    def unshard(self, i: int, label: str) -> None:
        """All-gather unit `i`'s parameter groups (unless prefetched) and copy them out, one group
        after the other (FSDP2's pre-forward and pre-backward: each group's unshard, then its wait)."""
        s = self.state[i]
        if s == "unsharded":
            return
        m = self.mem[i]
        for g, group in enumerate(m.groups):
            if s != "prefetched":
                self.issue(i, label, (g,))
            issued, copied = self.gathering[i]
            issued.discard(g)
            copied.add(g)
            # the group's all-gather output (issued now or by a prefetch) lives until its copy-out is done
            self.transient = {"all_gather": group.gathered + group.dim_copy}
            self.snapshot(label)  # copy-out: all-gather output and unsharded parameters both alive
            self.transient = {}
            # NOTE: FSDP2 drops the previous all-gather result in this wait, but a local
            # still holds it until the copy-out returns; in forward this one is kept until the
            # next group's (one slot for all groups: a unit's dense group's is dropped at its
            # expert group's copy-out, and one that gathered nothing keeps none), the last one until
            # the root's post-forward (without a root unit, until the first all-gather of backward)
            self.ag_kept = group.gathered if group.ranks > 1 and self.phase == "forward" else 0
        self.state[i] = "unsharded"
        self.gathering.pop(i, None)
        self.slices.discard(i)

    def prefetch(self, i: int) -> None:
        if self.state[i] in ("sharded", "post_forward"):
            self.issue(i, f"all-gather {self.mem[i].name} (prefetch)")

    def reshard(self, i: int) -> None:
        self.state[i] = "sharded"

    def post_backward(self, i: int, grads_before: int, names: Iterable[str] | None = None) -> None:
        """Reduce-scatter the gradients of `names` (default: all not yet reduced), reshard; in a
        backward that does not reduce, reshard and keep the unit's unsharded gradients."""
        m = self.mem[i]
        names = set(m.reduce_of if names is None else names) - self.reduced_now[i]
        self.reduced_now[i] |= names
        if not self.reduces:
            self.reshard(i)
            if names:  # kept in the reduce dtype (FSDP2's `unsharded_accumulated_grad`)
                self.kept[i] = m.grad_unsharded * _itemsize(m.reduce_dtype) // _itemsize(m.param_dtype)
            return
        rs, new = m.reduce_bytes(names)
        kept = self.kept.pop(i, 0)
        self.rs_kept = 0  # the oldest reduce-scatter input is released first
        self.reshard(i)   # NOTE: FSDP2 frees the unsharded parameters before reducing gradients
        if rs:
            # copy-in: the unsharded gradients and the reduce-scatter input both alive
            self.transient = {"reduce_scatter": rs, "unsharded_grads": m.shard_dim_copy + kept}
            self.live_grads = max(grads_before, self.live_grads)
            self.snapshot(f"reduce-scatter {m.name}")
            # the collective itself: unsharded gradients freed; on a later microbatch its output
            # is added into the sharded gradients already there. (Stock gloo also clones its
            # input, freed whenever its work object dies; NCCL does not: not modelled.)
            accumulated = new if names & self.reduced[i] else 0
            self.transient = {"reduce_scatter": rs, "sharded_grads": accumulated}
            live, grads = self.live, self.live_grads
            self.live, self.live_grads = live - grads, 0
            self.snapshot(f"reduce-scatter {m.name}")
            self.live, self.live_grads = live, grads
            self.transient = {}
            self.rs_kept = rs
        if not m.offload:
            self.grads_held += m.reduce_bytes(names - self.reduced[i])[1]
        self.reduced[i] |= names

    # --------------------------------------------------------------- driver
    def run(self) -> list[Moment]:
        """Replay each action of the (one) role, then the optimizer step."""
        events = self.trace.events
        split = next((k for k, ev in enumerate(events) if ev.kind in ("bwd_start", "bwd_pre")), len(events))
        forward, backward = events[:split], events[split:]
        (actions,) = self.schedule.actions
        for action in actions:
            if self.schedule.microbatches > 1:
                self.prefix = f"microbatch {action.microbatch}: "
            if action.kind == FORWARD:
                self.post_forward_order = []
                self.phase = "forward"
                self._play(forward)
            else:
                self.reduces = self.schedule.reduces(action)
                self.reduced_now = {i: set() for i in range(len(self.mem))}
                self._play(backward)
        self.prefix = ""
        self.phase, self.where = "optimizer", "optimizer step"
        self.live = self.live_grads = 0
        temp = 0
        if foreach_temp(self.optimizer):  # foreach AdamW: sqrt(exp_avg_sq) as one temporary
            temp = sum(m.sharded for m in self.mem if not m.offload and m.grads) + self.replicated
        self.transient = {"optimizer_temp": temp}
        self.snapshot("optimizer step")
        self.transient = {}
        return self.timeline

    def _op(self, ev) -> None:
        self.live, self.live_grads = ev.live, self._grads_now(ev.grads)
        if ev.where:
            self.where = ev.where
        self.snapshot(f"{self.phase} of {self.where or '<root>'}")

    def _play(self, events) -> None:
        """Replay a forward or a backward segment (a backward may run forward hooks again:
        checkpointed modules recompute)."""
        units, names = self.units, [u.name for u in self.units]
        prefetch_forward, prefetch_backward = self.program.prefetch("forward"), self.program.prefetch("backward")
        last_bwd_pre = {ev.unit: k for k, ev in enumerate(events) if ev.kind == "bwd_pre"}
        for k, ev in enumerate(events):
            if ev.kind == "op":
                self.live, self.live_grads = ev.live, self._grads_now(ev.grads)
                if ev.where:
                    self.where = ev.where
                self.snapshot(f"{self.phase} of {self.where or '<root>'}")
                continue
            if ev.kind == "end_backward":
                self._end_backward()
                continue
            if ev.kind == "bwd_start":  # the loss's backward begins, before the root's pre-backward
                self.phase, self.where = "backward", ""
                continue
            i, name = ev.unit, names[ev.unit]
            if ev.kind in ("fwd_pre", "bwd_pre"):
                self.where = name
            if ev.kind == "fwd_pre":
                self.phase = "forward"
                self.unshard(i, f"all-gather {name} (forward)")
                for j in prefetch_forward.get(name, ()):
                    if j in names:
                        self.prefetch(names.index(j))
            elif ev.kind == "fwd_post":
                self._post_forward(i)
            elif ev.kind == "bwd_pre":
                self.phase = "backward"
                self.unshard(i, f"all-gather {name} (backward)")
                if k != last_bwd_pre[i]:  # a unit gathered again (checkpoint recompute): prefetched already
                    continue
                targets = prefetch_backward.get(name)
                if targets is None:
                    nxt = default_backward_prefetch(self.post_forward_order, i, root_index(units))
                    targets = tuple(names[j] for j in nxt)
                for t in targets:
                    if t in names:
                        self.prefetch(names.index(t))
            elif ev.kind == "bwd_post":
                self.live, self.live_grads = ev.live, self._grads_now(ev.grads)
                self.post_backward(i, self.live_grads, ev.params)
                self.live_grads = 0

    def _post_forward(self, i: int) -> None:
        self.post_forward_order.append(i)
        if self.units[i].is_root:
            # torch 2.13: the root's post-forward frees the last forward all-gather result
            # (without a root unit it lives until the first all-gather of backward)
            self.ag_kept = 0
        elif self.mem[i].post_forward == 0:
            self.reshard(i)
        elif self.mem[i].post_forward < self.mem[i].unsharded:
            self.state[i] = "post_forward"

    def _end_backward(self) -> None:
        """FSDP2's end-of-backward callback: units not yet reduced (or kept) are, all resharded."""
        self.live, self.live_grads = 0, 0
        for i in range(len(self.units)):
            if self.reduced_now[i] != set(self.mem[i].reduce_of):
                self.post_backward(i, 0)
            self.reshard(i)
        self.rs_kept = 0
        self.snapshot("end of backward")


# What the memory model plays: the units' FSDP state (`FullyShard`, their prefetch lists), the
# tensor split of parameters (`Parallelize`), checkpointing and the loss through the trace, the
# sequence cut (`ShardBatch`: one context rank's shard is traced) and the K/V gathers
# (`AttendOverContext`, in the trace); `compile` and unit methods (gradient divide factor, sum
# reduction) change no byte of it. Expert parallelism (`DispatchExperts`): an expert rank's
# `experts / expert` experts, FSDP-sharded over efsdp ranks (`FullyShard.experts`), its dispatch
# in the trace (`expert_local.py`).
READER = Reader("the memory estimate",
                (FullyShard, Parallelize, AttendOverContext, DispatchExperts, Checkpoint, Compile, SetPrefetch, UnitMethod),
                (FORWARD, FULL_BACKWARD), (LossParallel, ShardBatch))


def estimate(compiled, world: int | None = None, *, optimizer: str = "adamw",
             inputs=None, input_shape: tuple[int, ...] | None = None, loss=None) -> Estimate:
    """The per-rank memory of one training step of `compiled` at `world` ranks.

    Args:
        compiled: a `CompiledPlan` with a model graph.
        world: number of ranks (default: the plan's world size).
        optimizer: one of `OPTIMIZERS`: "adamw"/"adam" (foreach), "adamw_fused"/"adam_fused",
            "sgd" (no momentum) or "none".
        inputs: model inputs for the activation trace: a tuple (positional), a dict
            (keywords) or a `planc.estimate.trace.Example` (any device; only shapes are used).
        input_shape: (batch, seq) token ids for language models, if `inputs` is not given.
        loss: the step's loss, `(output, example) -> tensor`; default the LM loss over fp32
            logits for language models (`planc.estimate.trace.default_loss`).

    Returns:
        The `Estimate`: per-unit bytes, the peak with its breakdown and moment, the timeline,
        the lower bound and the unsharded baseline.
    """
    if compiled.graph is None:
        raise ValueError("a memory estimate needs the model")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}")
    if world is not None:
        rank_count(world, "world")
    world = world or compiled.world_size or 1
    if len(compiled.job.parts) > 1:  # a pipeline: one estimate per pipeline rank (planc/estimate/role_memory.py)
        from planc.estimate.role_memory import estimate_roles
        return estimate_roles(compiled, world, optimizer=optimizer, inputs=inputs, input_shape=input_shape, loss=loss)
    job = READER.compiled(compiled)
    program = job.program
    replicate, shard = mesh_sizes(program, world)
    graph = compiled.graph
    if inputs is None and input_shape is not None and graph.model is not None:
        inputs = default_input(graph.model, input_shape)
    step = None if inputs is None else Example.of(inputs)
    example = None if step is None else step.microbatch(job.schedule.microbatches)
    step, (tp, cp, ep) = rank_step(compiled, world, step)
    example, _ = rank_step(compiled, world, example)
    trace = trace_for(compiled, example, loss, tp, cp=cp, ep=ep)
    mem = unit_memory(program, graph, world, optimizer)
    replicated = sum(graph.params[n].nbytes for n in _replicated_params(program, graph))
    buffers = buffer_bytes(graph)
    host = sum(m.sharded + m.grads + m.optimizer for m in mem if m.offload)
    input_bytes = trace.input_bytes if step is None else sum(t.nbytes for t in step.tensors())
    timeline = _Replay(program, mem, optimizer, replicated, trace, shard, buffers, job.schedule, input_bytes).run()
    peak = max(timeline, key=lambda m: m.total)
    activations = None if example is None else max((e.live - e.grads for e in trace.events), default=0)
    lower = lower_bound(program, graph, mem, replicated, optimizer, activations or 0, input_bytes)
    full = sum(p.nbytes for p in graph.params.values())
    n_params = len(graph.params)
    opt_full = (2 * full + STEP_COUNTER_BYTES * n_params) if has_moments(optimizer) else 0
    temp_full = full if foreach_temp(optimizer) else 0
    baseline = 2 * full + opt_full + max(activations or 0, temp_full) + input_bytes + buffers
    shape = tuple(step.tensors()[0].shape) if step is not None and step.tensors() else None
    est = Estimate(world, replicate, shard, optimizer, mem, replicated, host, peak, timeline, lower, baseline,
                   activations, trace.source, shape)
    if example is None:
        est.notes.append("activations not counted: give an input shape (--input-shape BxS)")
    if job.schedule.microbatches > 1:
        est.notes.append(f"{job.schedule.origin.value.show()}: activations are one microbatch's, "
                         f"the input is the step's batch")
    return est


def rank_step(compiled, world: int, example: Example | None) -> tuple[Example | None, tuple[int, int, int]]:
    """What one rank traces of a step of `compiled` at `world` ranks: `example` as one context rank's
    sequence shard with its positions under context parallelism (as `AppliedPlan.shard_batch` cuts
    it), and the (tensor, context, expert) degrees its trace emulates. `estimate` and `planc
    suggest` (planc/suggest/evaluate.py) trace one rank's step through it."""
    job = READER.compiled(compiled)
    program = job.program
    cp = context_degree(job, world)
    if example is not None and cp > 1:
        example = shard_example(example, job.step_op(ShardBatch)[0], cp)
    return example, ((program.mesh.sizes(world) or {}).get("tensor", 1), cp, expert_degree(program, world))


def buffer_bytes(graph) -> int:
    """Bytes of the model's buffers (RoPE caches, position ids): FSDP2 leaves them whole on
    every rank, in their own dtype (0 when the graph holds no model object)."""
    model = getattr(graph, "model", None)
    if model is None:
        return 0
    seen: set[int] = set()
    total = 0
    for b in model.buffers():
        if id(b) not in seen:
            seen.add(id(b))
            total += b.numel() * b.element_size()
    return total


def lower_bound(program: Program, graph, mem: list[UnitMemory], replicated: int, optimizer: str,
                activations: int, input_bytes: int) -> int:
    """What this plan's step cannot go below, whatever the units' schedule.

    The state it keeps on the device in every moment (sharded parameters and optimizer state
    of units not offloaded, replicated parameters with their state, buffers), plus the
    largest of three things that must each be alive at some moment: the largest single
    module's own parameters gathered (in its compute dtype: the finest unit possible), the
    traced activations with the inputs (at their peak no sharded gradient need exist yet),
    and the sharded gradients (at the optimizer step). Each term is part of one moment of the
    replay, so the bound never exceeds the peak.
    """
    dev = [m for m in mem if not m.offload]
    always = (sum(m.sharded + m.optimizer for m in dev) + replicated
              + (2 * replicated if has_moments(optimizer) else 0) + buffer_bytes(graph))
    grads = sum(m.grads for m in dev) + replicated
    outside = set(_replicated_params(program, graph))  # already in `always`
    compute = compute_dtypes(program, graph)
    leaf = max((sum(graph.params[c].numel * _itemsize(compute[c]) for _, c in graph.own_params(p) if c not in outside)
                for p in graph.modules), default=0)
    return always + max(leaf, activations + input_bytes, grads)


def metric(compiled, name: str, world: int | None, input_shape: tuple[int, ...] | None = None) -> float | None:
    """A memory metric for `expect` lines, in bytes (None when it cannot be known: no model,
    or no world size from `at world = N` or the command line).

    With `input_shape` (batch, seq: `at ..., input = 8x4096`), activations are traced for
    that input exactly as `planc explain --input-shape` traces them; `TraceError` when the
    model cannot run on it, or there is no model to run. Estimates are cached on the
    compiled plan per (world, input shape) (`CompiledPlan.memory_at`).
    """
    if compiled.graph is None or (world or compiled.world_size) is None:
        return None
    if input_shape is not None and compiled.graph.model is None:
        raise TraceError("the model graph holds no model to run, so no input can be built")
    return compiled.memory_at(world, input_shape).metric(name)
