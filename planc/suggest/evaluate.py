"""Evaluating candidates of `planc suggest` against ONE traced step of the model.

Tracing a step on fake tensors is the slow part of the memory model (seconds for a
405B-shaped model); replaying FSDP2's schedule over the trace is cheap once the trace is
short. So the search traces the model once, with one unit per block and no checkpointing,
and derives everything else from that trace:

* **other unit granularities** by renaming the trace's unit events (`remap`): a unit of two
  blocks starts at the first block's pre-forward, ends at the second's post-forward, and
  is gathered once in backward and reduced once, when the first block finishes backward, as
  torch 2.13 runs a group unit (the other blocks' unsharded gradients, freed per block in the
  traced step, are carried until then);
* **a shorter trace with the same peak** (`planc.estimate.trace.compress`): between two unit
  events only the live bytes change, so each run of op events is replaced by its largest and its last op;
  the replay's peak is unchanged (tests/test_suggest.py checks it against
  `planc.estimate.memory.estimate`);
* **activation checkpointing** from a profile of one block of each shape (`profile_blocks`):
  the block is run alone on the input it received in the traced step (captured by a
  forward pre-hook during that same trace), with no checkpointing, selective and full,
  counting live bytes as the trace does: what the block keeps after forward, its forward
  peak and its backward peak (with recomputation).

The reshard, offload and HSDP choices change no traced bytes: the replay accounts for them.
The winner is always re-estimated with the real memory model (its own trace, checkpointing
applied) before it is written (`Evaluator.exact`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten

import planc
from planc.compiler import CompiledPlan
from planc.estimate import memory as mem_model
from planc.estimate.trace import (
    Event,
    Example,
    Trace,
    _LiveBytes,
    _quiet_fake_tensor_logs,
    compress,
    default_input,
    fake_trace,
    trace_for,
)
from planc.lower.checkpointing import context_fn
from planc.model.graph import ModelGraph
from planc.suggest.space import CHECKPOINT_MODES, Candidate, Chain, find_chain, plan_text, unit_blocks


class RulesRejected(ValueError):
    """The `parallel` rules fail planc's static checks at this tensor-parallel degree."""

    def __init__(self, errors):
        self.errors = errors
        super().__init__("; ".join(f"{d.code}: {d.message}" for d in errors))


@dataclass(frozen=True)
class BlockProfile:
    """Live bytes of one block run alone, per checkpoint mode (see the module docstring)."""

    kept: dict            # mode -> bytes alive after forward (saved for backward + the output)
    forward_peak: dict    # mode -> most bytes alive during forward
    backward_peak: dict   # mode -> most bytes alive during backward (recomputation included)


def remap(trace: Trace, atom_units, units) -> Trace:
    """The trace of `atom_units` (one unit per block) as `units` (blocks merged) would record it."""
    index_of = {m: i for i, u in enumerate(units) for m in u.modules}
    to_new = {}
    for i, u in enumerate(atom_units):
        to_new[i] = len(units) - 1 if u.is_root else index_of[u.modules[0]]
    name_of = {u.name: units[to_new[i]].name for i, u in enumerate(atom_units)}
    first = {}
    last = {}
    for i in range(len(atom_units)):
        j = to_new[i]
        first.setdefault(j, i)
        last[j] = i
    out = []
    events = trace.events
    started: set[int] = set()
    carry: dict[int, int] = {}  # merged unit -> unsharded grads a member freed in the atom trace, still alive
    for k, ev in enumerate(events):
        extra = sum(carry.values())
        if ev.kind == "op":
            out.append(Event("op", live=ev.live + extra, grads=ev.grads + extra, where=name_of.get(ev.where, ev.where)))
            continue
        if ev.unit < 0:
            out.append(Event(ev.kind, ev.unit, live=ev.live + extra, grads=ev.grads + extra, where=ev.where,
                             params=ev.params) if extra else ev)
            continue
        j = to_new[ev.unit]
        if ev.kind == "fwd_pre" and first[j] != ev.unit:
            continue
        if ev.kind == "fwd_post" and last[j] != ev.unit:
            continue
        # torch 2.13 runs a group unit's pre-backward once and its post-backward once, when the
        # member that ran forward first finishes backward: the other members' gradients stay
        if ev.kind == "bwd_pre":
            if j in started:
                continue
            started.add(j)
        if ev.kind == "bwd_post" and first[j] != ev.unit:
            nxt = next((e for e in events[k + 1:] if e.kind == "op"), None)
            carry[j] = carry.get(j, 0) + max(0, ev.grads - (nxt.grads if nxt is not None else 0))
            continue
        if ev.kind == "bwd_post":
            carry.pop(j, None)
            out.append(Event(ev.kind, j, live=ev.live + extra, grads=ev.grads + extra, where=ev.where, params=None))
            continue
        out.append(Event(ev.kind, j, live=ev.live + extra, grads=ev.grads + extra, where=ev.where, params=ev.params))
    return Trace(out, trace.input_bytes, trace.source)


class _Recorder(mem_model._Replay):
    """The replay, recording for each moment which block units hold state kept from forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bwd_started: set[int] = set()
        self.rows: list[tuple[str, int, tuple[int, ...], int, tuple[int, ...]]] = []  # (phase, unit, kept, total, reduced)
        self._index = {u.name: i for i, u in enumerate(self.units)}

    def unshard(self, i, label):
        if self.phase == "backward":
            self.bwd_started.add(i)
        super().unshard(i, label)

    def snapshot(self, label):
        super().snapshot(label)
        m = self.timeline[-1]
        kept = tuple(sorted(set(self.post_forward_order) - self.bwd_started))
        reduced = tuple(i for i, names in self.reduced.items() if names)
        self.rows.append((m.phase, self._index.get(self.where, -1), kept, m.total, reduced))


@dataclass
class Windows:
    """The base replay of one (merge, prefetch) -- one replica, nothing offloaded, reshard true,
    nothing checkpointed -- cut into windows: the moments of each (phase, unit being run,
    units holding forward state), with each moment's bytes and the units whose gradients are
    reduce-scattered by then (HSDP and offload change their sharded gradients' bytes)."""

    groups: dict[tuple[str, int, tuple[int, ...]], "object"]  # key -> moment indices (numpy)
    totals: "object"                      # [moments] bytes
    reduced: "object"                     # [moments, units] 0/1
    block_unit_index: list[int]           # program unit index of each block unit
    program: object                       # the base program


@dataclass
class Evaluator:
    """One model, world, input and optimizer: the trace, the profiles, and candidate evaluation."""

    graph: ModelGraph
    model_ref: str | None
    world: int
    shape: tuple[int, ...]
    optimizer: str = "adamw"
    tensor: int = 1                    # tensor-parallel degree (1: 1-D plans)
    parallel: tuple[str, ...] = ()     # the `parallel` statements of the axes > 1 (plan text)
    inputs: object = None              # the step's inputs (tuple, dict or Example); None: token ids of `shape`
    context: int = 1                   # context-parallel degree: `shape` is a context group's (one rank traces 1 / context)
    expert: int = 1                    # expert-parallel degree (it borrows shard x context x tensor ranks)
    chain: Chain = field(init=False)
    _compiled: dict = field(default_factory=dict, init=False)
    _windows: dict = field(default_factory=dict, init=False)
    notes: list = field(default_factory=list, init=False)  # for the plan's header

    def __post_init__(self):
        self.chain = find_chain(self.graph)
        if self.inputs is None:
            self.inputs = default_input(self.graph.model, self.shape)
        base = self.compiled(Candidate(checkpoint=("none",) * self.chain.n, reshard=(True,) * self.chain.n))
        errors = [d for d in base.diagnostics if d.severity == "error"]
        if not errors and self.context > 1 and self.shape is not None:  # what an `expect ... input =` line checks
            from planc.checks.context_parallel import sequence_problem
            errors = [d for d in [sequence_problem(base.mesh, self.world, self.shape, None)] if d is not None]
        if errors:  # the `parallel` rules do not hold at these degrees (heads not divisible, ...)
            raise RulesRejected(errors)
        self.atom_program = base.program
        # one rank's step, as the memory model traces it (a context rank's sequence shard, ...)
        self.local_inputs, self.rank_degrees = mem_model.rank_step(base, self.world, Example.of(self.inputs))
        captured: dict = {}
        handles = []
        signatures: dict[str, tuple] = {}
        for path in self.chain.blocks:
            mod = self.graph.model.get_submodule(path)
            sig = (type(mod).__qualname__, tuple((n, tuple(p.shape)) for n, p in mod.named_parameters()))
            signatures[path] = sig

            def hook(module, args, kwargs, sig=sig, path=path):
                if sig not in captured:  # shapes only: holding the tensors would change the trace
                    captured[sig] = (module, *_specs((args, kwargs)), path)
            handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
        try:
            with _quiet_fake_tensor_logs(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trace = fake_trace(base, self.local_inputs, tp=self.rank_degrees[0], repeat=True, cp=self.rank_degrees[1],
                                   ep=self.rank_degrees[2])
        finally:
            for h in handles:
                h.remove()
        self.atom_trace = compress(trace)
        self.profiles = {sig: self._block_profile(*captured[sig]) for sig in captured}
        self.block_profile = [self.profiles[signatures[p]] for p in self.chain.blocks]

    def _block_profile(self, module, spec, fake_mode, path: str) -> BlockProfile:
        """One block's profile, run alone with the layout changes its `parallel` rules make.

        NOTE: a gather/split form (`colwise { output replicate }` then `rowwise { input
        replicate }`) hands the rowwise layer a full-width input that only the emulated scatter
        cuts to its local in-features; without the hooks the block fails (`[64, 64] X [32, 64]`).
        """
        handles = []
        if self.tensor > 1:
            from planc.estimate.tensor_local import emulate_layouts
            handles = emulate_layouts(module, self.atom_program, self.graph, self.tensor, prefix=path)
        if self.context > 1:  # the experts need nothing here: `emulate_experts` changed the trace's copy for good
            from planc.estimate.context_local import emulate_context
            handles += emulate_context(module, self.atom_program, self.context, prefix=path)
        try:
            with _quiet_fake_tensor_logs():  # a failing op's fake-tensor traceback is not for the user
                return _profile(module, spec, fake_mode)
        finally:
            for h in handles:
                h.remove()

    # ----------------------------------------------------------------- candidates
    @property
    def dp_world(self) -> int:
        """FSDP's ranks: the world over the tensor-parallel degree (replicate x shard x context)."""
        return self.world // self.tensor

    def shard_group_ok(self, group: int) -> bool:
        """Whether a shard group of `group` ranks (FSDP's: shard x context, per replicate rank) holds
        the context axis and lends the expert axis its ranks (it borrows shard x context x tensor)."""
        return group % self.context == 0 and group * self.tensor % self.expert == 0

    def text(self, c: Candidate, header=(), expects=()) -> str:
        return plan_text(self.chain, self.model_ref, c, list(header), list(expects), self.tensor, self.parallel,
                         self.context, self.expert)

    def compiled(self, c: Candidate) -> CompiledPlan:
        key = (c.merge, c.replicate, c.prefetch, c.offload, c.checkpoint, c.reshard)
        if key not in self._compiled:
            self._compiled[key] = CompiledPlan(planc.loads(self.text(c)), self.graph, self.world, check_memory=False)
        return self._compiled[key]

    def fast_peak(self, c: Candidate) -> int:
        """The replay's peak of `c` over the one trace (exact when `c` checkpoints nothing)."""
        compiled = self.compiled(c)
        program = compiled.program
        trace = remap(self.atom_trace, self.atom_program.units, program.units) if c.merge != 1 else self.atom_trace
        return self._replay(program, trace, _Replay=mem_model._Replay).timeline_peak

    def _replay(self, program, trace, _Replay=None):
        cls = _Replay or _Recorder
        replicate, shard = mem_model.mesh_sizes(program, self.world)
        units = mem_model.unit_memory(program, self.graph, self.world, self.optimizer)
        replicated = sum(self.graph.params[n].nbytes for n in mem_model._replicated_params(program, self.graph))
        r = cls(program, units, self.optimizer, replicated, trace, shard, mem_model.buffer_bytes(self.graph))
        r.run()
        r.timeline_peak = max(m.total for m in r.timeline)
        r.unit_mem = units
        return r

    def windows(self, merge: int, prefetch: int) -> Windows:
        """The base replay of (merge, prefetch) (see `Windows`)."""
        import numpy as np
        key = (merge, prefetch)
        if key not in self._windows:
            nu = len(unit_blocks(self.chain, merge))
            c = Candidate(merge=merge, prefetch=prefetch, checkpoint=("none",) * nu, reshard=(True,) * nu)
            program = self.compiled(c).program
            trace = remap(self.atom_trace, self.atom_program.units, program.units) if merge != 1 else self.atom_trace
            r = self._replay(program, trace)
            groups: dict = {}
            reduced = np.zeros((len(r.rows), len(program.units)))
            totals = np.zeros(len(r.rows))
            for t, (phase, unit, kept, total, red) in enumerate(r.rows):
                groups.setdefault((phase, unit, kept), []).append(t)
                totals[t] = total
                reduced[t, list(red)] = 1
            groups = {k: np.array(v) for k, v in groups.items()}
            start = len(self.chain.pre)
            self._windows[key] = Windows(groups, totals, reduced, list(range(start, start + nu)), program)
        return self._windows[key]

    def unit_memory(self, program, merge: int, prefetch: int, world: int):
        """`planc.estimate.memory.unit_memory` of a base program, cached per (merge, prefetch, ranks)."""
        key = ("units", merge, prefetch, world)
        if key not in self._windows:
            self._windows[key] = mem_model.unit_memory(program, self.graph, world, self.optimizer)
        return self._windows[key]

    def state_bytes(self, c: Candidate) -> tuple[int, int]:
        """(sharded params + optimizer state, sharded grads) on the device for `c`'s units."""
        program = self.compiled(c).program
        units = mem_model.unit_memory(program, self.graph, self.world, self.optimizer)
        return (sum(m.sharded + m.optimizer for m in units if not m.offload), sum(m.grads for m in units if not m.offload))

    def exact(self, c: Candidate):
        """The memory model's estimate of `c` (its own trace, checkpointing applied)."""
        compiled = self.compiled(c)
        return mem_model.estimate(compiled, self.world, optimizer=self.optimizer, inputs=self.inputs)


@dataclass(frozen=True)
class _Spec:
    shape: tuple
    dtype: torch.dtype
    requires_grad: bool


def _specs(tree):
    """The tree with each tensor replaced by its shape, dtype and requires_grad; and the fake mode."""
    from torch.utils._pytree import tree_map
    modes = [t.fake_mode for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and hasattr(t, "fake_mode")]
    def leaf(t):
        if isinstance(t, torch.Tensor):
            return _Spec(tuple(t.shape), t.dtype, t.requires_grad)
        # other objects (a Hugging Face key/value cache) hold the traced step's tensors: the
        # block runs alone without them (training steps pass no cache to fill)
        return t if t is None or isinstance(t, (bool, int, float, str)) else None
    spec = tree_map(leaf, tree)
    return spec, modes[0] if modes else None


def _profile(module, spec, fake_mode) -> BlockProfile:
    """Run one (fake) block alone per checkpoint mode; see `BlockProfile`."""
    from torch.utils._pytree import tree_map
    from torch.utils.checkpoint import checkpoint
    if fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        args, kwargs = tree_map(lambda s: torch.empty(s.shape, dtype=s.dtype, device="cpu") if isinstance(s, _Spec) else s,
                                spec, is_leaf=lambda x: isinstance(x, _Spec))
    kept, fpeak, bpeak = {}, {}, {}
    with fake_mode, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in CHECKPOINT_MODES:
            mod = module  # torch.utils.checkpoint wraps the call: the module itself is not changed
            a, kw = _detach(args), _detach(kwargs)
            peak = [0]
            counter = _LiveBytes(lambda func, peak=peak: None)
            counter._on_op = lambda func, peak=peak, counter=counter: peak.__setitem__(0, max(peak[0], counter.live))
            counter.ignore([*mod.parameters(), *mod.buffers(),
                            *[t for t in tree_flatten((a, kw))[0] if isinstance(t, torch.Tensor)]])
            with counter:
                if mode == "none":
                    out = mod(*a, **kw)
                else:
                    out = checkpoint(mod, *a, use_reentrant=False, context_fn=context_fn(mode) or _noop_context, **kw)
                outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                kept[mode] = counter.live
                fpeak[mode] = peak[0]
                peak[0] = counter.live
                grads = [torch.empty_like(t) for t in outs]
                del out
                torch.autograd.backward(outs, grads)
                bpeak[mode] = peak[0]
                del outs, grads
    return BlockProfile(kept, fpeak, bpeak)


def _noop_context():
    from torch.utils.checkpoint import noop_context_fn
    return noop_context_fn()


def _detach(tree):
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: t.detach().requires_grad_(t.requires_grad or t.is_floating_point())
                    if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


_ = trace_for  # the memory model's cached trace is used by `Evaluator.exact` through `estimate`
