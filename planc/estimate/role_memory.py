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

Multi-stage ranks (interleaved and V schedules) are not estimated yet (`NotImplementedError`).
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
from planc.estimate.roles import READER, stage_world
from planc.estimate.trace import Event, Example, Trace, default_input, trace_for
from planc.lower.fsdp import has_moments
from planc.lower.job import FORWARD, FULL_BACKWARD, Job, Part, Schedule, step_schedule
from planc.lower.pipeline import inside
from planc.lower.program import FullyShard, Program


def whole_program(job: Job) -> Program:
    """The program of the whole model a pipeline job was cut from: every stage's ops, one root
    unit over every stage root's parameters (what the one-part trace of the model runs)."""
    ops, root = [], None
    for part in job.parts:
        for op in part.program.ops:
            if isinstance(op, FullyShard) and op.is_root:
                root = op if root is None else dataclasses.replace(root, params=root.params + op.params)
            else:
                ops.append(op)
    return Program(job.parts[0].program.mesh, tuple(ops) + ((root,) if root is not None else ()))


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
    split = next(k for k, ev in enumerate(events) if ev.kind == "bwd_start")
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


class _StageReplay(_Replay):
    """`memory._Replay` as torch's `PipelineStage` drives FSDP2, with microbatches in flight."""

    def __init__(self, *args, held: int = 0, output: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.held, self.output, self.others = held, output, 0
        self.in_flight: set[int] = set()   # microbatches whose forward ran and backward has not
        self.outputs = 0                    # last stage: microbatches whose output the schedule keeps
        self.most_in_flight = 0

    def _others(self) -> int:
        """What the other microbatches keep: those in flight their saved activations, and on the
        last stage each microbatch's output the schedule keeps for the step's return value."""
        return self.held * len(self.in_flight) + self.output * (self.outputs - len(self.in_flight))

    def snapshot(self, label: str) -> None:
        self.live += self.others
        super().snapshot(label)
        self.live -= self.others

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

    def run(self) -> list[Moment]:
        events = self.trace.events
        split = next(k for k, ev in enumerate(events) if ev.kind == "bwd_start")
        forward, backward = events[:split], events[split:]
        (actions,) = self.schedule.actions
        for action in actions:
            self.prefix = f"microbatch {action.microbatch}: "
            if action.kind == FORWARD:
                self.others = self._others()
                self.post_forward_order = []
                self.phase = "forward"
                self._play(forward)
                self.in_flight.add(action.microbatch)
                self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
                self.outputs += 1 if self.output else 0
            else:
                self.in_flight.discard(action.microbatch)
                self.others = self._others()
                self.reduces = self.schedule.reduces(action)
                self.reduced_now = {i: set() for i in range(len(self.mem))}
                self._play(backward)
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
        return self.timeline


def estimate_pipeline_memory(plan, world: int, *, graph=None, optimizer: str = "adamw", inputs=None,
                             input_shape: tuple[int, ...] | None = None, loss=None) -> list[Estimate]:
    """One `Estimate` per pipeline rank of a pipeline job at `world` ranks (module docstring).

    `plan` is a `CompiledPlan` or a `Job` (then `graph` is required)."""
    job: Job = READER.job(plan) if isinstance(plan, Job) else READER.compiled(plan)
    graph = graph or getattr(plan, "graph", None)
    if graph is None:
        raise ValueError("a memory estimate needs the model")
    sched, pp = job.schedule, len(job.schedule.stages)
    if any(len(held) != 1 for held in sched.stages):
        raise NotImplementedError(f"memory per role of {sched.name}: ranks holding several stages are not "
                                  "estimated yet")
    if inputs is None and input_shape is not None and graph.model is not None:
        inputs = default_input(graph.model, input_shape)
    step = None if inputs is None else Example.of(inputs)
    example = None if step is None else step.microbatch(sched.microbatches)
    whole = whole_program(job)
    n = stage_world(job.parts[0].program, world, pp)
    tp = (whole.mesh.sizes(n) or {}).get("tensor", 1)
    shim = types.SimpleNamespace(graph=graph, program=whole, job=dataclasses.replace(
        job, parts=(Part(0, ("",), whole),), schedule=step_schedule()),
        resolution=getattr(plan, "resolution", types.SimpleNamespace(ignored=frozenset())))
    trace = trace_for(shim, example, loss, tp)
    if not any(ev.kind == "bwd_start" for ev in trace.events):
        raise NotImplementedError("memory per role needs an input to trace (give an input shape)")
    boundary = _boundaries(job, graph, example, trace)
    input_bytes = 0 if step is None else sum(t.nbytes for t in step.tensors())
    out = []
    for (stage_trace, held), part in zip(stage_traces(trace, whole, job, boundary), job.parts):
        rank = next(r for r, h in enumerate(sched.stages) if part.stage in h)
        last = part.stage == len(job.parts) - 1
        output = boundary[-1] if last else 0
        est = _estimate(part, graph, n, optimizer, stage_trace, (held, output), sched, rank,
                        input_bytes if part.stage == 0 or last else 0, step)
        out.append((rank, dataclasses.replace(est, world=world)))
    return [e for _, e in sorted(out, key=lambda x: x[0])]


def estimate_roles(compiled, world: int, **kwargs) -> Estimate:
    """The binding pipeline rank's estimate (the largest peak), every rank's in its `roles`: what
    `memory.estimate` returns for a pipeline job, so an `expect memory.peak` bound holds for every rank."""
    ests = estimate_pipeline_memory(compiled, world, **kwargs)
    binding = max(ests, key=lambda e: e.peak.total)
    return dataclasses.replace(binding, roles=ests, notes=binding.notes + [
        f"the binding rank of {len(ests)} pipeline ranks (the largest peak)"])


def _boundaries(job: Job, graph, example, trace) -> list[int]:
    """Bytes of the activation each stage receives (the output of the previous stage's last module),
    and last, of the model's output (what the last stage's schedule keeps per microbatch)."""
    from planc.estimate.flops import step_profile
    profile = step_profile(graph, example)
    order = {p: k for k, p in enumerate(profile.order)}
    out = [0]
    for part in job.parts[:-1]:
        tail = max((m for m in part.modules if m in order), key=order.get, default=None)
        act = profile.outputs.get(tail) if tail is not None else None
        out.append(act.numel * act.dtype.itemsize if act is not None else 0)
    act = profile.outputs.get("")
    return out + [act.numel * act.dtype.itemsize if act is not None else 0]


def _estimate(part: Part, graph, world: int, optimizer: str, trace: Trace, kept: tuple[int, int], sched: Schedule,
              rank: int, input_bytes: int, step) -> Estimate:
    program = part.program
    replicate, shard = mesh_sizes(program, world)
    mem = unit_memory(program, graph, world, optimizer)
    owned = set().union(*(u.params for u in program.units)) if program.units else set()
    mine = [n for n in graph.params if inside(n.rpartition(".")[0], part.modules)]
    replicated = sum(graph.params[n].nbytes for n in mine if n not in owned)
    buffers = _buffers(graph, part.modules)
    actions = tuple(a for a in sched.actions[rank] if a.kind in (FORWARD, FULL_BACKWARD))
    role = Schedule(sched.name, sched.microbatches, ((part.stage,),), (actions,), "last", sched.origin)
    held, output = kept
    replay = _StageReplay(program, mem, optimizer, replicated, trace, shard, buffers, role, input_bytes, held=held,
                          output=output)
    timeline = replay.run()
    peak = max(timeline, key=lambda m: m.total)
    activations = max((e.live - e.grads for e in trace.events), default=0)
    shape = tuple(step.tensors()[0].shape) if step is not None and step.tensors() else None
    state = sum(m.sharded + m.grads + m.optimizer for m in mem if not m.offload) + replicated * (
        2 + (2 if has_moments(optimizer) else 0))
    est = Estimate(world, replicate, shard, optimizer, mem, replicated,
                   sum(m.sharded + m.grads + m.optimizer for m in mem if m.offload), peak, timeline,
                   state + buffers, state + buffers + held * sched.microbatches, activations,
                   trace.source, shape)
    est.notes.append(f"pipeline rank {rank} (stage {part.stage}: {', '.join(part.modules)}), {sched.name}, "
                     f"{sched.microbatches} microbatches: at most {replay.most_in_flight} in flight, "
                     f"{held} bytes kept by each until its backward")
    return est


def _buffers(graph, modules) -> int:
    model = getattr(graph, "model", None)
    if model is None:
        return 0
    return sum(b.numel() * b.element_size() for name, b in model.named_buffers()
               if inside(name.rpartition(".")[0], modules))


__all__ = ["estimate_pipeline_memory", "whole_program", "stage_traces", "CATEGORIES"]
