"""Memory per role of a pipeline job: each pipeline rank's stages, its microbatches in flight, replayed per action.

`estimate_pipeline_memory` gives one `Estimate` (`planc/estimate/memory.py`) per pipeline rank:

* **state**: the parameters, gradients and optimizer state of the rank's stage only
  (`memory.unit_memory` of the stage's program on the stage's data-parallel ranks), the
  parameters of the stage no unit manages, the stage's buffers; the step's batch on the first
  rank (the inputs) and on the last (the labels the loss takes).
* **the stage's step**: one trace of one microbatch of the whole model on fake tensors (each
  unit's precision and checkpointing applied, `trace.trace_for`), cut at the stages'
  boundaries: a stage's forward is the run of events of its units (the loss with the last
  stage), its backward likewise; the live bytes of the earlier stages' saved activations are
  taken off (they stay constant while a later stage runs), the boundary activation received
  from the previous stage is kept (the stage saves it for its backward).
* **the replay, per action of the rank's list**: FSDP2's state machine of `memory._Replay`,
  as torch's `PipelineStage` drives it: gradients kept unreduced and parameters kept gathered
  after every backward but the last microbatch's (`set_requires_gradient_sync(False)`,
  `set_reshard_after_backward(False)`, pipelining/stage.py), then reduced; each microbatch's
  forward leaves what the stage keeps for its backward (its saved activations and, on the last
  stage, the output and loss the schedule holds) alive until that backward, so a rank holds
  every microbatch in flight at that moment of its list (1F1B at most pp - rank, GPipe all).

What the schedule keeps to the step's end: the last stage's outputs (returned merged), and
after each backward the gradient of the output received from the next rank and the gradient
of the input (accumulated on its receive buffer, cleared at the next step: `PipelineStage.
clear_runtime_states`); torch's multi-stage runtime also keeps every output it sent (its
sends are waited at the step's end).

A rank holding several stages (interleaved and V schedules) replays each stage's actions on
that stage, every moment counting its other stages as they rest (their state, their
microbatches in flight). A split backward (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)
plays the stage's backward at its input half (`I`); from then until its weight half (`W`) the
microbatch keeps what torch's `stage_backward_input` leaves for `stage_backward_weight` (the
retained graph below the weight-gradient intermediates with its saved tensors, the
intermediates' gradients), measured per stage by running torch's halves on fake tensors
(`planc/estimate/split_backward.py`). On the first stage `I` does nothing (its input needs
no gradient): the microbatch stays in flight and `W` plays the whole backward. The trace's
backward is not what torch's split actions hold at their peaks, so each gets its own moment,
torch's action measured on fake tensors put on top of the largest moment of the backward's first
run of ops (where the real action starts, measured; a `W` past the first stage: on what the rank
holds with the microbatch's kept bytes): `I` frees no
saved tensor while it makes the activations' gradients (`autograd.grad(retain_graph=True)`:
the head stage of llama_tiny 65,540 B above its start where the trace's backward shows 8,320, a
block 114,688 B), `W` and a full backward allocate each weight's gradient before adding it to
the kept one (the head's full backward 40,960 B where the trace shows 8,320: `_grads_now` has
autograd add in place). An `I` makes no weight gradient: until the stage's first `W` or full
backward its unsharded gradients are not counted (InterleavedZeroBubble runs several `I`s
before the first `W`: they were counted one block's gradients early, +7.3% on its rank 1).

Checked against FSDPMemTracker on each rank of real gloo runs (GPipe, 1F1B, Interleaved1F1B,
LoopedBFS; 2 ranks, and 2 x 2 with FSDP): one stage per rank +0.01% (136 bytes), two stages
per rank within 3%; the split-backward schedules, which FSDPMemTracker cannot run (its module
hooks fail on `autograd.grad` of the stage inputs), against a hook-free live-bytes counter
(tests/pp_memory_workers.py `LiveBytes`, itself up to 3.4% over FSDPMemTracker where both run:
torch's receive buffers, one per microbatch and boundary, made at the first step and alive
across steps): within 1.4% on every rank (InterleavedZeroBubble +1.11% / -0.40%, ZBVZeroBubble
-1.33% / -0.66%, DualPipeV -1.39% / +0.64%; was -5.0% / +3.0%, -9.3% / -4.8%, -5.5% / -1.4%;
benchmarks/RESULTS.md, tests/test_roles_memory_dist.py). Not modelled: the last microbatch's
gradient reduction happens at its `W` in torch, at its `I` here (its bytes move by the
reduction's output between the two).
A stage with no unit of its own is refused (`RoleError`):
the trace names each op's innermost unit, so its ops could not be told from the root's.
"""

from __future__ import annotations

import dataclasses
import types

from planc.estimate.memory import (
    CATEGORIES,
    Estimate,
    Moment,
    _Replay,
    foreach_temp,
    mesh_sizes,
    unit_memory,
)
from planc.estimate.roles import READER, boundaries, stage_world, whole_program
from planc.estimate.trace import Event, Example, Trace, TraceError, compress, default_input, trace_for
from planc.lower.fsdp import has_moments
from planc.lower.job import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, Job, Part, Schedule, step_schedule
from planc.lower.pipeline import inside
from planc.lower.program import Program
from planc.lower.schedules import SINGLE_STAGE


class RoleError(TraceError):
    """A pipeline job whose memory per role cannot be estimated (a `TraceError`: `expect` lines report
    it located as P504, `explain` in words)."""


def _stage_of_events(events: list[Event], units, parts: tuple[Part, ...]) -> list[int]:
    """Each event's stage: its unit's (an op's innermost unit's, `where`); root-level events take
    the stage running around them (the first before any unit, the last after)."""
    by_name = {}
    for part in parts:
        for u in part.program.units:
            if not u.is_root:
                by_name[u.name] = part.stage
    out, current = [], 0
    for ev in events:
        name = units[ev.unit].name if ev.unit >= 0 else ev.where
        stage = None if ev.unit >= 0 and units[ev.unit].is_root else by_name.get(name)
        if ev.kind == "bwd_start":
            stage = len(parts) - 1
        current = current if stage is None else stage
        out.append(current)
    return out


def stage_traces(trace: Trace, whole: Program, job: Job, boundary: list[int]) -> list[tuple[Trace, int]]:
    """Each stage's trace (its units' indices in its own program, its root's hooks around it) and
    the bytes it holds per microbatch in flight (its live bytes at the end of its forward).

    `boundary[s]`: the bytes of the activation stage s receives (0 for the first stage)."""
    events = trace.events
    # the loss's backward starts it (a traced step); the root's pre-backward (in module order, no input)
    split = next(k for k, ev in enumerate(events) if ev.kind in ("bwd_start", "bwd_pre"))
    units = whole.units
    keep = [(k, ev) for k, ev in enumerate(events)
            if ev.kind != "end_backward" and not (ev.unit >= 0 and units[ev.unit].is_root)]
    stages = _stage_of_events([ev for _, ev in keep], units, job.parts)
    fwd_keep = [(ev, s) for (k, ev), s in zip(keep, stages) if k < split]
    bwd_keep = [(ev, s) for (k, ev), s in zip(keep, stages) if k > split]
    out = []
    for part in job.parts:
        s = part.stage
        program = part.program
        index = {u.name: i for i, u in enumerate(program.units)}
        root = next((i for i, u in enumerate(program.units) if u.is_root), None)
        fwd = [ev for ev, t in fwd_keep if t == s]
        bwd = [ev for ev, t in bwd_keep if t == s]
        first = next((k for k, (ev, t) in enumerate(fwd_keep) if t == s), 0)
        before = fwd_keep[first - 1][0].live if first > 0 and s > 0 else 0
        base = before - boundary[s]

        def moved(ev: Event, index=index, base=base) -> Event:
            unit = index[units[ev.unit].name] if ev.unit >= 0 else -1
            return dataclasses.replace(ev, unit=unit, live=max(ev.live - base, 0))
        held = moved(fwd[-1]).live if fwd else 0
        head = [Event("fwd_pre", root)] if root is not None else []
        tail = [Event("fwd_post", root, live=held)] if root is not None else []
        back = [Event("bwd_start"), *([Event("bwd_pre", root)] if root is not None else [])]
        evs = head + [moved(e) for e in fwd] + tail + back + [moved(e) for e in bwd] + [Event("end_backward")]
        out.append((Trace(evs, trace.input_bytes, trace.source), held))
    return out


_TORCH_PEAK = {BACKWARD_INPUT: "input backward (torch retains the graph: no saved tensor freed)",
               BACKWARD_WEIGHT: "weight backward (torch's stage_backward_weight)",
               FULL_BACKWARD: "full backward (each weight's gradient allocated, then added to the kept one)"}


class _StageReplay(_Replay):
    """`memory._Replay` as torch's `PipelineStage` drives FSDP2, with microbatches in flight."""

    def __init__(self, *args, held: int = 0, output: int = 0, kept_after: int = 0, split=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.held, self.output, self.others = held, output, 0
        # a split backward (`split_backward.SplitCost`, None under other schedules): `deferred`, the bytes
        # each microbatch keeps from its input backward to its weight backward (None: its input backward
        # does nothing, the first stage); the peak of each torch action above its start
        self.split = split
        self.deferred, self.waiting = (0 if split is None else split.kept), set()
        self.weight_grads = split is None   # whether a `W` or a full backward made the weights' gradients yet
        self.kept_after, self.backwards = kept_after, 0  # bytes each backward leaves to the step's end; done
        self.in_flight: set[int] = set()   # microbatches whose forward ran and backward has not
        self.outputs = 0                    # last stage: microbatches whose output the schedule keeps
        self.most_in_flight = 0
        self.extra: dict[str, int] = {}    # the rank's other stages, at rest

    def _others(self) -> int:
        """What the other microbatches keep: those in flight their saved activations, and on the
        last stage each microbatch's output the schedule keeps for the step's return value."""
        return (self.held * len(self.in_flight) + self.output * (self.outputs - len(self.in_flight))
                + self.kept_after * self.backwards + (self.deferred or 0) * len(self.waiting))

    def post_backward(self, i: int, grads_before: int, names=None) -> None:
        state = self.state[i]
        super().post_backward(i, grads_before, names)
        if not self.reduces:  # PipelineStage: no reshard after a backward that does not reduce
            self.state[i] = state

    def _end_backward(self) -> None:
        states = list(self.state)
        super()._end_backward()
        if not self.reduces:
            self.state = states

    def play(self, action) -> None:
        """One action of the rank's list on this stage: a forward, or a backward (`_backward_now`)."""
        split = next(k for k, ev in enumerate(self.trace.events) if ev.kind == "bwd_start")
        self.prefix = f"microbatch {action.microbatch}: "
        if action.kind == FORWARD:
            self.others = self._others()
            self.post_forward_order = []
            self.phase = "forward"
            self._play(self.trace.events[:split])
            self.in_flight.add(action.microbatch)
            self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
            self.outputs += 1 if self.output else 0
        elif self._backward_now(action):
            self.in_flight.discard(action.microbatch)
            self.others = self._others()
            self.reduces = action.microbatch == self.schedule.microbatches - 1  # PipelineStage: the last only
            self.reduced_now = {i: set() for i in range(len(self.mem))}
            self.weight_grads |= action.kind == FULL_BACKWARD
            start = len(self.timeline)
            self._play(self.trace.events[split:])
            self._torch_peak(action, start)
            self.backwards += 1
            if action.kind == BACKWARD_INPUT:  # what it keeps for its weight backward, from now on
                self.waiting.add(action.microbatch)
                self.others = self._others()
                self.snapshot("input backward done: the graph and gradients its weight backward takes kept")

    def _backward_now(self, action) -> bool:
        """Whether this action plays the stage's backward: a full backward; a split one's input half
        (the trace's backward, the gradients included; the microbatch then keeps `deferred` bytes
        until its weight half, which frees them), or on the first stage, whose input half does
        nothing (its input needs no gradient), the weight half."""
        first = self.deferred is None
        if action.kind == BACKWARD_WEIGHT and not first:
            self._weight_peak(action.microbatch)
        if action.kind == BACKWARD_WEIGHT:
            self.waiting.discard(action.microbatch)
        return (action.kind == FULL_BACKWARD or (action.kind == BACKWARD_INPUT and not first)
                or (action.kind == BACKWARD_WEIGHT and first))

    def _torch_peak(self, action, start: int) -> None:
        """Under a split-backward schedule, the peak torch's backward action reaches above its start
        (`split_backward.SplitCost`): `I` retains the graph (frees no saved tensor), a full backward
        allocates each weight's gradient before adding it to the kept one, the first stage's `W` is its
        whole backward; the trace's backward shows neither. The start: the largest moment of the
        backward's first run of ops (the loss's backward on the last stage; kept by `trace.compress`),
        measured where torch's action starts on real runs (benchmarks/RESULTS.md)."""
        if self.split is None:
            return
        events = self.trace.events[next(k for k, ev in enumerate(self.trace.events) if ev.kind == "bwd_start"):]
        first = next((k for k, ev in enumerate(events) if ev.kind == "op"), len(events))
        run = next((k for k, ev in enumerate(events[first:]) if ev.kind != "op"), len(events) - first)
        ops = [m for m in self.timeline[start:] if m.label.startswith(f"{self.prefix}backward of ")][:run]
        if not ops:
            return
        base = max(ops, key=lambda m: m.total)
        peak = {BACKWARD_INPUT: self.split.input_peak, BACKWARD_WEIGHT: self.split.weight_peak,
                FULL_BACKWARD: self.split.full_peak}[action.kind]
        moment = Moment(f"microbatch {action.microbatch}: {_TORCH_PEAK[action.kind]}", "backward", base.unit,
                        dict(base.bytes))
        moment.bytes["activations"] += peak
        self.timeline.insert(start + 1, moment)

    def _weight_peak(self, microbatch: int) -> None:
        """A weight backward (`W`) of a stage past the first: what the microbatch kept from its `I`
        plus the most `stage_backward_weight` holds above it."""
        if self.split is None or not self.split.weight_peak:
            return
        live, grads = self.live, self.live_grads
        self.live = self.live_grads = 0
        self.others = self._others()  # its kept bytes among them (still waiting)
        self.prefix, self.phase = f"microbatch {microbatch}: ", "backward"
        self.transient = {"activations": self.split.weight_peak}
        self.snapshot(_TORCH_PEAK[BACKWARD_WEIGHT])
        self.transient = {}
        self.live, self.live_grads = live, grads
        self.weight_grads = True

    def snapshot(self, label: str) -> None:
        saved = self.live, self.live_grads, self.kept
        if self.deferred and not self.weight_grads:  # an `I` makes no weight gradient: torch makes them in `W`
            self.live, self.live_grads, self.kept = self.live - self.live_grads, 0, {}
        self.live += self.others
        super().snapshot(label)
        self.live, self.live_grads, self.kept = saved
        for k, v in self.extra.items():
            self.timeline[-1].bytes[k] += v

    def rest(self) -> dict[str, int]:
        """What this stage holds while the rank runs another of its stages."""
        live, grads, transient = self.live, self.live_grads, self.transient
        self.live = self.live_grads = 0
        self.transient, self.others, extra = {}, self._others(), self.extra
        self.extra = {}
        self.snapshot("rest")
        self.live, self.live_grads, self.transient, self.extra = live, grads, transient, extra
        return self.timeline.pop().bytes

    def finish(self) -> None:
        """The end of the step: the last stage's merged outputs, then the optimizer step."""
        self.prefix = ""
        self.live = self.live_grads = 0
        self.others = self._others()
        if self.output:  # the schedule returns the outputs merged: one more copy of them, at once
            self.transient = {"activations": self.output * self.outputs}
            self.snapshot("merge of the microbatches' outputs")
            self.transient = {}
        self.phase, self.where = "optimizer", "optimizer step"
        temp = 0
        if foreach_temp(self.optimizer):
            temp = sum(m.sharded for m in self.mem if not m.offload and m.grads) + self.replicated
        self.transient = {"optimizer_temp": temp}
        self.snapshot("optimizer step")
        self.transient = {}


def _replay_rank(replays: dict[int, _StageReplay], actions) -> list[Moment]:
    """Play a rank's actions on its stages' replays, each moment with the other stages at rest."""
    timeline: list[Moment] = []
    for rp in replays.values():
        rp.timeline = timeline
    for action in actions:
        for a in action.sub or (action,):
            if a.stage in replays and a.kind in (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
                _with_others(replays, a.stage, lambda rp, a=a: rp.play(a))
    rests = {stage: rp.rest() for stage, rp in replays.items()}
    optimizer = dict.fromkeys(CATEGORIES, 0)
    for stage, rp in replays.items():
        n = len(timeline)
        rp.finish()
        *merge, last = timeline[n:]
        del timeline[n + len(merge):]
        for moment in merge:  # the last stage's merged outputs, the other stages at rest
            for other, rest in rests.items():
                for k, v in rest.items():
                    moment.bytes[k] += v if other != stage else 0
        for k, v in last.bytes.items():  # the optimizer steps over every stage's parameters at once
            optimizer[k] += v
    timeline.append(Moment("optimizer step", "optimizer", "optimizer step", optimizer))
    return timeline


def _with_others(replays: dict[int, _StageReplay], stage: int, fn) -> None:
    rp = replays[stage]
    extra = dict.fromkeys(CATEGORIES, 0)
    for other, o in replays.items():
        if other != stage:
            for k, v in o.rest().items():
                extra[k] += v
    rp.extra = extra
    fn(rp)
    rp.extra = {}


def estimate_pipeline_memory(plan, world: int, *, graph=None, optimizer: str = "adamw", inputs=None,
                             input_shape: tuple[int, ...] | None = None, loss=None,
                             compressed: bool = True) -> list[Estimate]:
    """One `Estimate` per pipeline rank of a pipeline job at `world` ranks (module docstring).

    `plan` is a `CompiledPlan` or a `Job` (then `graph` is required). `compressed`: runs of identical
    blocks traced as four and written out (`planc/estimate/repeat.py`) and the runs of op events
    between unit events cut to their extremes (`trace.compress`); the same estimate (peak, its
    moment, in-flight counts) as False, which traces and replays every op of every block."""
    job: Job = READER.job(plan) if isinstance(plan, Job) else READER.compiled(plan)
    graph = graph or getattr(plan, "graph", None)
    if graph is None:
        raise ValueError("a memory estimate needs the model")
    sched, pp = job.schedule, len(job.schedule.stages)
    if inputs is None and input_shape is not None and graph.model is not None:
        inputs = default_input(graph.model, input_shape)
    step = None if inputs is None else Example.of(inputs)
    example = None if step is None else step.microbatch(sched.microbatches)
    for part in job.parts:  # the trace names the innermost unit of each op: a stage needs one of its own
        if not any(not u.is_root for u in part.program.units):
            raise RoleError(f"stage {part.stage} ({', '.join(part.modules)}) has no unit of its own, so the "
                            "memory per pipeline rank cannot tell its ops from the root's")
    whole = whole_program(job)
    n = stage_world(job.parts[0].program, world, pp)
    tp = (whole.mesh.sizes(n) or {}).get("tensor", 1)
    shim = types.SimpleNamespace(graph=graph, program=whole, job=dataclasses.replace(
        job, parts=(Part(0, ("",), whole),), schedule=step_schedule()),
        resolution=getattr(plan, "resolution", types.SimpleNamespace(ignored=frozenset())))
    trace = trace_for(shim, example, loss, tp, repeat=compressed)
    boundary = boundaries(job, graph, example, tp=tp, repeat=compressed)
    input_bytes = 0 if step is None else sum(t.nbytes for t in step.tensors())
    traces = stage_traces(compress(trace) if compressed else trace, whole, job, boundary)
    splits = _split(shim, job, example, loss)
    last = len(job.parts) - 1
    out = []
    for rank, held in enumerate(sched.stages):
        parts = [job.parts[s] for s in held]
        # the step's batch: the first stage's input, the last stage's labels (one tensor if both)
        given = next((s for s in held if s in (0, last)), None)
        replays = {s: _replay(job.parts[s], graph, n, optimizer, traces[s][0],
                              (traces[s][1], boundary[-1] if s == last else 0), sched,
                              input_bytes if s == given else 0, boundary, splits[s]) for s in held}
        out.append(_estimate(world, n, rank, parts, replays, sched, step))
    return out


def estimate_roles(compiled, world: int, **kwargs) -> Estimate:
    """The binding pipeline rank's estimate (the largest peak), every rank's in its `roles`: what
    `memory.estimate` returns for a pipeline job, so an `expect memory.peak` bound holds for every rank."""
    ests = estimate_pipeline_memory(compiled, world, **kwargs)
    binding = ests[dataclasses.replace(ests[0], roles=ests).binding()]
    return dataclasses.replace(binding, roles=ests, notes=binding.notes + [
        f"the binding rank of {len(ests)} pipeline ranks (the largest peak)"])


def _split(shim, job: Job, example, loss) -> list:
    """Per stage, its split backward under a split-backward schedule (`split_backward.split_costs`:
    torch's own halves on fake tensors: what a microbatch keeps from `I` to `W`, each action's
    peak); Nones under other schedules or without an input."""
    from planc.estimate.split_backward import has_split_backward, split_costs

    if example is None or not has_split_backward(job.schedule):
        return [None] * len(job.parts)
    return split_costs(shim, job, example, loss)


def _replay(part: Part, graph, world: int, optimizer: str, trace: Trace, kept: tuple[int, int], sched: Schedule,
            input_bytes: int, boundary: list[int], split=None) -> _StageReplay:
    """One stage's replay: its units' bytes on its data-parallel ranks, its parameters no unit manages.

    torch's multi-stage runtime waits for its sends only at the end of the step, and a send holds
    its tensor: each output sent to the next stage and each input gradient sent to the previous
    one (on another rank) stays alive until then, past its microbatch's backward."""
    program = part.program
    mem = unit_memory(program, graph, world, optimizer)
    owned = set().union(*(u.params for u in program.units)) if program.units else set()
    replicated = sum(info.nbytes for n, info in graph.params.items()
                     if inside(n.rpartition(".")[0], part.modules) and n not in owned)
    role = Schedule(sched.name, sched.microbatches, ((part.stage,),), ((),), "last", sched.origin)
    held, output = kept
    s, rank_of = part.stage, {st: r for r, h in enumerate(sched.stages) for st in h}
    last = len(boundary) - 2
    to_next = boundary[s + 1] if s < last and rank_of[s + 1] != rank_of[s] else 0
    from_prev = boundary[s] if s > 0 and rank_of[s - 1] != rank_of[s] else 0
    # kept after each backward until the step ends: the output's gradient received, the input's
    # gradient (on the receive buffer); with the multi-stage runtime also the output it sent
    kept_after = to_next + from_prev + (to_next if sched.name not in SINGLE_STAGE else 0)
    return _StageReplay(program, mem, optimizer, replicated, trace, mesh_sizes(program, world)[1],
                        _buffers(graph, part.modules), role, input_bytes, held=held, output=output,
                        kept_after=kept_after, split=split)


def _estimate(world: int, stage_world: int, rank: int, parts: list[Part], replays: dict[int, _StageReplay],
              sched: Schedule, step) -> Estimate:
    """One pipeline rank's estimate: its stages' replays played over its actions."""
    timeline = _replay_rank(replays, sched.actions[rank])
    peak = max(timeline, key=lambda m: m.total)
    rps = list(replays.values())
    mem = [m for rp in rps for m in rp.mem]
    optimizer = rps[0].optimizer
    replicated = sum(rp.replicated for rp in rps)
    buffers = sum(rp.buffers for rp in rps)
    activations = None if step is None else max(max((e.live - e.grads for e in rp.trace.events), default=0)
                                                for rp in rps)
    shape = tuple(step.tensors()[0].shape) if step is not None and step.tensors() else None
    state = sum(m.sharded + m.grads + m.optimizer for m in mem if not m.offload) + replicated * (
        2 + (2 if has_moments(optimizer) else 0))
    replicate, shard = mesh_sizes(parts[0].program, stage_world)
    held = sum(rp.held for rp in rps)
    est = Estimate(world, replicate, shard, optimizer, mem, replicated,
                   sum(m.sharded + m.grads + m.optimizer for m in mem if m.offload), peak, timeline,
                   state + buffers, state + buffers + held * sched.microbatches, activations, rps[0].trace.source,
                   shape, stages=tuple(part.stage for part in parts))
    if step is None:
        est.notes.append("activations not counted: give an input shape (--input-shape BxS)")
    for part, rp in zip(parts, rps):
        est.notes.append(f"pipeline rank {rank}, stage {part.stage} ({', '.join(part.modules)}), {sched.name}, "
                         f"{sched.microbatches} microbatches: at most {rp.most_in_flight} in flight, "
                         f"{rp.held} bytes kept by each until its backward")
    return est


def _buffers(graph, modules) -> int:
    model = getattr(graph, "model", None)
    if model is None:
        return 0
    return sum(b.numel() * b.element_size() for name, b in model.named_buffers()
               if inside(name.rpartition(".")[0], modules))


__all__ = ["RoleError", "estimate_pipeline_memory", "estimate_roles", "stage_traces", "whole_program"]
