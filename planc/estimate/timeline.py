"""A discrete-event timeline of one pipeline step: each rank runs its actions in order, waiting for its peers.

`simulate(schedule, costs)` plays a `Schedule` (`planc/lower/job.py`, torch's actions per
pipeline rank) against the seconds each action costs (`Costs`). Every rank has a compute
stream and a network queue of its own; an action starts when the rank's previous action is
done and when what it needs from other ranks has arrived:

* `F` of stage s, microbatch m: the forward of stage s-1 for m, plus the point-to-point
  transfer of the boundary activation (`Costs.p2p_s`; 0 when both stages are on one rank,
  as the turn of a V placement);
* `B` or `I` (the input half of a split backward) of stage s: the `B` or `I` of stage s+1
  for m plus the transfer of the activation's gradient; on the last stage, its own `F`;
* `W` (the weight half): the `I` of the same stage and microbatch;
* `OVERLAP_F_B` (DualPipeV): its forward and backward, each with their needs, run back to
  back on the compute stream (the overlap hides their communication, not their compute);
* `UNSHARD`, `RESHARD`, `SEND_*`, `RECV_*`: no compute (transfers are the needs above);
  `REDUCE_GRAD`: the stage's gradient reductions, issued on the network queue.

FSDP's collectives of a stage (`Costs.gathers`, `Costs.reductions`) run on the rank's
network queue: the forward gathers before the stage's first forward (every forward when
the stage's units reshard after forward; then also before every backward), the reductions
after the stage's last backward (or at its `REDUCE_GRAD`). A compute action that needs
gathered parameters cannot end before they are: the gathers overlap its compute, as FSDP2's
prefetch overlaps one unit's gather with the previous unit's compute.

A rank whose next action needs something no rank will ever produce blocks; when every rank
is blocked before the end, the schedule deadlocks (`Deadlock`, naming each rank's action).

The step ends when the slowest rank is done (compute, network and its optimizer step). Each
rank's *bubble* is the part of the step its compute stream is idle; the pipeline's bubble is
the mean over ranks. On uniform stages without communication this gives the closed forms
(p-1)/(m+p-1) for GPipe and 1F1B and (p-1)/(v m+p-1) for interleaved schedules
(tests/test_timeline.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from planc.lower.job import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    RESHARD,
    SEND_B,
    SEND_F,
    UNSHARD,
    Action,
    Reader,
    Schedule,
)

# Every action kind of torch's vocabulary has a rule here (the module docstring says which).
ACTIONS = (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, OVERLAP_F_B, UNSHARD, RESHARD, REDUCE_GRAD,
           SEND_F, RECV_F, SEND_B, RECV_B)
READER = Reader("the pipeline timeline", (), ACTIONS)


class Costs(Protocol):
    """Seconds each part of a pipeline step costs (`planc/estimate/roles.py` builds them from a job)."""

    def compute_s(self, stage: int, kind: str) -> float:
        """One microbatch's `F`, `B`, `I` or `W` of `stage` on the compute stream."""

    def p2p_s(self, src: int, dst: int) -> float:
        """The transfer of one microbatch's boundary tensor from stage `src` to stage `dst` (0 on one rank)."""

    def gathers(self, stage: int, phase: str, first: bool) -> list[float]:
        """FSDP all-gathers the stage issues before a `forward`/`backward` (`first`: its first forward)."""

    def reductions(self, stage: int) -> list[float]:
        """FSDP gradient reductions of the stage, issued once its last backward is done."""

    def optimizer_s(self, stages: tuple[int, ...]) -> float:
        """The optimizer step of a rank holding `stages`."""


@dataclass(frozen=True)
class Uniform:
    """Equal stages and no communication: the textbook pipeline (`f`, `b` per stage and microbatch;
    a split backward is half input, half weight)."""

    f: float = 1.0
    b: float = 2.0

    def compute_s(self, stage: int, kind: str) -> float:
        return {FORWARD: self.f, FULL_BACKWARD: self.b}.get(kind, self.b / 2)

    def p2p_s(self, src: int, dst: int) -> float:
        return 0.0

    def gathers(self, stage: int, phase: str, first: bool) -> list[float]:
        return []

    def reductions(self, stage: int) -> list[float]:
        return []

    def optimizer_s(self, stages: tuple[int, ...]) -> float:
        return 0.0


class Deadlock(RuntimeError):
    """Every rank waits for something no rank will produce."""


@dataclass
class Span:
    """One action as the timeline ran it."""

    action: str
    start: float
    end: float


@dataclass
class RankTime:
    """One pipeline rank's step: its actions' spans, compute busy time, end."""

    rank: int
    stages: tuple[int, ...]
    spans: list[Span] = field(default_factory=list)
    busy_s: float = 0.0         # compute stream busy
    comm_s: float = 0.0         # network queue busy (FSDP collectives)
    optimizer_s: float = 0.0
    end_s: float = 0.0          # compute, network and optimizer step done


@dataclass
class Timeline:
    """The simulated step: per rank busy/idle, the step time (the slowest rank), the bubble."""

    schedule: str
    microbatches: int
    ranks: list[RankTime]

    @property
    def step_s(self) -> float:
        return max(r.end_s for r in self.ranks)

    def idle_s(self, rank: int) -> float:
        """Seconds rank `rank`'s compute stream waits in the step (bubble, exposed communication, optimizer)."""
        return self.step_s - self.ranks[rank].busy_s

    def bubble(self, rank: int | None = None) -> float:
        """The idle fraction of the step on `rank`'s compute stream (all ranks' mean by default)."""
        if not self.step_s:
            return 0.0
        if rank is not None:
            return self.idle_s(rank) / self.step_s
        return sum(self.idle_s(r.rank) for r in self.ranks) / (len(self.ranks) * self.step_s)

    @property
    def binding_rank(self) -> int:
        """The rank that ends last (the step time is its)."""
        return max(self.ranks, key=lambda r: r.end_s).rank


class _Rank:
    """One rank's clocks while the timeline runs."""

    def __init__(self, rank: int, stages: tuple[int, ...], actions: tuple[Action, ...]):
        self.out = RankTime(rank, stages)
        self.actions, self.next = actions, 0
        self.t = self.net = 0.0
        self.forwards: set[int] = set()   # stages that ran a forward already
        self.backwards_left = {s: sum(1 for a in actions for x in (a.sub or (a,))
                                      if x.stage == s and x.kind in (FULL_BACKWARD, BACKWARD_WEIGHT)) for s in stages}
        self.reduce_at_end = {s: not any(a.kind == REDUCE_GRAD and a.stage == s for a in actions) for s in stages}

    def queue(self, seconds: list[float], ready: float) -> float:
        """Run collectives on the network queue from `ready`; when the last is done."""
        end = ready
        for s in seconds:
            start = max(self.net, ready)
            self.net = end = start + s
            self.out.comm_s += s
        return end


class _Sim:
    def __init__(self, schedule: Schedule, costs: Costs, owner: dict[int, int]):
        self.schedule, self.costs, self.owner = schedule, costs, owner
        self.last_stage = max(owner)
        self.done: dict[tuple[str, int, int], float] = {}  # (what, stage, microbatch) -> when it was done

    def needs(self, a: Action) -> list[tuple[tuple[str, int, int], float]]:
        """What `a` waits for: (event key, transfer seconds after it)."""
        s, m = a.stage, a.microbatch
        if a.kind == FORWARD:
            return [] if s == 0 else [(("F", s - 1, m), self.costs.p2p_s(s - 1, s))]
        if a.kind in (FULL_BACKWARD, BACKWARD_INPUT):
            if s == self.last_stage:
                return [(("F", s, m), 0.0)]
            return [(("F", s, m), 0.0), (("I", s + 1, m), self.costs.p2p_s(s + 1, s))]
        if a.kind == BACKWARD_WEIGHT:
            return [(("I", s, m), 0.0)]
        return []

    def ready(self, a: Action) -> float | None:
        """When `a`'s needs have arrived, or None if one is not yet produced."""
        t = 0.0
        for x in a.sub or (a,):
            for key, transfer in self.needs(x):
                if key not in self.done:
                    return None
                t = max(t, self.done[key] + transfer)
        return t

    def run(self, r: _Rank, a: Action, ready: float) -> None:
        start = max(r.t, ready)
        r.t = start
        for x in a.sub or (a,):
            self.compute(r, x)
        r.out.spans.append(Span(str(a), start, r.t))

    def compute(self, r: _Rank, a: Action) -> None:
        costs, s = self.costs, a.stage
        if a.kind == REDUCE_GRAD:
            r.queue(costs.reductions(s), r.t)
            return
        if a.kind not in (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
            return  # UNSHARD, RESHARD, SEND_*, RECV_*: transfers are the needs of the compute actions
        phase = "forward" if a.kind == FORWARD else "backward"
        gathered = r.t
        if a.kind != BACKWARD_WEIGHT:
            gathered = r.queue(costs.gathers(s, phase, s not in r.forwards), r.t)
        r.forwards.add(s) if a.kind == FORWARD else None
        seconds = costs.compute_s(s, a.kind)
        r.t = max(r.t + seconds, gathered)
        r.out.busy_s += seconds
        key = {FORWARD: "F", FULL_BACKWARD: "I", BACKWARD_INPUT: "I", BACKWARD_WEIGHT: "W"}[a.kind]
        self.done[(key, s, a.microbatch)] = r.t
        if a.kind in (FULL_BACKWARD, BACKWARD_WEIGHT):
            r.backwards_left[s] -= 1
            if r.backwards_left[s] == 0 and r.reduce_at_end[s]:
                r.queue(costs.reductions(s), r.t)


def simulate(schedule: Schedule, costs: Costs) -> Timeline:
    """Play `schedule` against `costs` (see the module docstring); `Deadlock` if it cannot finish."""
    owner = {s: rank for rank, held in enumerate(schedule.stages) for s in held}
    ranks = [_Rank(i, held, tuple(READER.action(a) for a in acts))
             for i, (held, acts) in enumerate(zip(schedule.stages, schedule.actions))]
    sim = _Sim(schedule, costs, owner)
    while any(r.next < len(r.actions) for r in ranks):
        progressed = False
        for r in ranks:
            while r.next < len(r.actions):
                a = r.actions[r.next]
                ready = sim.ready(a)
                if ready is None:
                    break
                sim.run(r, a, ready)
                r.next += 1
                progressed = True
        if not progressed:
            waiting = "; ".join(f"rank {r.out.rank} at {r.actions[r.next]}" for r in ranks if r.next < len(r.actions))
            raise Deadlock(f"the {schedule.name} schedule deadlocks: {waiting}")
    for r in ranks:
        r.out.optimizer_s = costs.optimizer_s(r.out.stages)
        r.out.end_s = max(r.t, r.net) + r.out.optimizer_s
    return Timeline(schedule.name, schedule.microbatches, [r.out for r in ranks])
