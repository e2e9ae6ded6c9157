"""`planc suggest --pipeline`: the pipeline degree, schedule, microbatches and stage split, searched.

The search decomposes in three levels (docs/suggest.md, "Pipelines"):

1. **Per tensor degree T, one profile** (`Profile`): the suggest `Evaluator` at one sequence
   (batch 1) on one tensor rank gives each block's bytes kept after forward and its backward
   peak per checkpoint mode; `flops.step_profile` at batch 1 gives each module's forward,
   backward and recompute FLOPs and its output's bytes; `memory.unit_memory` and
   `collectives.unit_collectives` of the one-unit-per-block program give each unit's state and
   FSDP collectives. Everything below is arithmetic over these (bytes and FLOPs scale with the
   microbatch's batch).
2. **An outer enumeration** of (pipeline degree P, schedule, stages per rank V, microbatches
   M, checkpoint mode): the stages are the automatic split (`planc/resolve/split.py`,
   torchtitan's weights) into P x V stages; each pipeline rank's peak is its stages' state on
   the data-parallel ranks, their gathered parameters and unreduced gradients (torch's stage
   keeps both to the last microbatch) and the activations of the microbatches in flight at
   each moment of its action list (`planc/lower/schedules.py`, torch's own orders: 1F1B keeps
   P - rank, GPipe all); the step time is the slowest rank's on the timeline
   (`planc/estimate/timeline.py`) with per-stage compute, point-to-point and FSDP costs.
   Choices are visited cheapest bound first and pruned: memory before time, and a time bound
   (the busiest rank's compute) against the best found.
3. **Verification**: the winner is written as a plan and re-estimated by the full role
   estimators (`role_memory.estimate_roles`, `roles.step_time_of_pipeline`, what `planc
   explain` and `planc check` run); if its peak is over the budget, the search's budget is
   lowered by the excess and the next fitting choice tried. The header's figures are those.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from functools import lru_cache

from planc.estimate.collectives import Collective, collective_s, unit_collectives
from planc.estimate.hardware import hardware as hardware_of
from planc.estimate.memory import unit_memory
from planc.estimate.time import OPTIMIZER_BYTES
from planc.estimate.timeline import simulate
from planc.lower.job import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD
from planc.lower.schedules import SCHEDULES, SINGLE_STAGE, V_SCHEDULES, schedule
from planc.quantities import show_bytes
from planc.resolve.pipeline import SPLIT_BACKWARD
from planc.resolve.split import SplitError, auto_split
from planc.suggest.space import CHECKPOINT_MODES

# the split-backward schedules (`SPLIT_BACKWARD`): FSDP may not reshard after forward under them (P465);
# the search never sets `reshard` (unset is false under a pipeline), so every schedule is safe
DEFAULT_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
MAX_STAGES_PER_RANK = 4   # looped schedules: 2 .. this many stages per rank


@dataclass(frozen=True)
class PipeChoice:
    """One point of the pipeline search."""

    tensor: int
    pp: int
    schedule: str
    stages_per_rank: int
    microbatches: int
    checkpoint: str
    local_batch: int          # sequences per data-parallel rank and step

    def describe(self) -> str:
        t = f"tensor {self.tensor}, " if self.tensor > 1 else ""
        return (f"{t}pipeline {self.pp}, {self.schedule} ({self.stages_per_rank} stage"
                f"{'s' * (self.stages_per_rank != 1)} per rank), {self.microbatches} microbatches of "
                f"{self.local_batch // self.microbatches}, checkpoint {self.checkpoint}")


@dataclass
class PipeOption:
    """A choice with its figures: the search's model (`exact` False) or the full estimators'."""

    choice: PipeChoice
    seconds: float
    peak: int
    exact: bool = False
    where: str = ""
    bubble: float = 0.0


@dataclass
class PipeSuggestion:
    best: PipeOption | None
    alternatives: list[PipeOption]
    smallest: PipeOption | None
    text: str | None
    budget: int
    searched: int = 0         # choices whose time was simulated
    pruned: int = 0           # choices ruled out by memory or a time bound
    stats: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


# ===================================================================== the profile of one tensor degree


@dataclass
class Profile:
    """What the search needs of the model at one tensor degree, per sequence (batch 1)."""

    tensor: int
    chain: object
    units: list                   # UnitMemory of the one-unit-per-block program at world / T data ranks
    collectives: list             # per unit: its FSDP Collectives (same program)
    unit_of: dict                 # module path (a unit's top module) -> unit index
    kept: dict                    # (block path, mode) -> bytes kept after forward, one sequence
    extra_bwd: dict               # (block path, mode) -> backward peak above what it keeps, one sequence
    flops: object                 # StepProfile at batch 1 (whole model, all tensor ranks)
    data_ranks: int               # the data-parallel ranks the units were costed on (world / T)


def profile(graph, model_ref, world: int, seq: int, optimizer: str, tensor: int, parallel: tuple[str, ...]) -> Profile:
    """The `Profile` at degree `tensor` (RulesRejected / TraceError as the Evaluator raises them)."""
    import torch

    from planc.estimate.flops import step_profile
    from planc.suggest.evaluate import Evaluator
    ev = Evaluator(graph, model_ref, world, (1, seq), optimizer, tensor, tuple(parallel) if tensor > 1 else ())
    program = ev.atom_program
    units = unit_memory(program, graph, world, optimizer)
    colls = unit_collectives(program, graph, world)
    unit_of = {}
    for i, u in enumerate(program.units):
        for m in u.modules:
            unit_of[m] = i
    kept, extra = {}, {}
    for path, bp in zip(ev.chain.blocks, ev.block_profile):
        for mode in CHECKPOINT_MODES:
            kept[(path, mode)] = bp.kept[mode]
            extra[(path, mode)] = max(0, bp.backward_peak[mode] - bp.kept[mode], bp.forward_peak[mode] - bp.kept[mode])
    flops = step_profile(graph, input_shape=(1, seq), dtype=torch.bfloat16, repeat=True)
    return Profile(tensor, ev.chain, units, colls, unit_of, kept, extra, flops, world // tensor)


# ===================================================================== stages and their costs


@dataclass
class Stage:
    """One stage's figures per sequence (activations, FLOPs) and per step (state, collectives)."""

    modules: tuple[str, ...]
    blocks: tuple[str, ...]
    units: tuple[int, ...]
    params: int
    fwd_flops: int
    bwd_flops: int
    recompute: dict               # mode -> FLOPs recomputed per sequence
    boundary: int                 # bytes sent to the next stage per sequence (the last: the logits)
    side_kept: int                # bytes the side modules keep per sequence (embedding output; head: the logits)


def _owner(path: str, stage_of: dict[str, int], last: int) -> int | None:
    """The stage whose module subtree holds `path` (`""`, the loss: the last stage)."""
    if path == "":
        return last
    while True:
        if path in stage_of:
            return stage_of[path]
        if "." not in path:
            return None
        path = path.rsplit(".", 1)[0]


_SPLITS: dict = {}


def split(graph, n: int) -> list[tuple[str, ...]]:
    """`auto_split(graph, n)` (`split = parameters`), cached per model graph."""
    key = (id(graph), n)
    if key not in _SPLITS:
        _SPLITS[key] = (graph, auto_split(graph, n))
    return _SPLITS[key][1]


def stages_of(prof: Profile, graph, n: int) -> list[Stage]:
    """The automatic split into `n` stages (`split = parameters`), each stage's figures."""
    f = prof.flops
    cut = split(graph, n)
    last = len(cut) - 1
    stage_of = {m: s for s, modules in enumerate(cut) for m in modules}
    sums = {key: [0] * len(cut) for key in ("forward", "backward")}
    for key in sums:
        for p, v in getattr(f, key).items():
            s = _owner(p, stage_of, last)
            if s is not None:
                sums[key][s] += v
    order = {p: k for k, p in enumerate(f.order)}
    out = []
    for s, modules in enumerate(cut):
        blocks = tuple(m for m in modules if m in prof.chain.blocks)
        units = tuple(sorted({prof.unit_of[m] for m in modules if m in prof.unit_of}))
        rec = {"none": 0, "selective": sum(f.recompute_selective.get(b, 0) for b in blocks),
               "full": sum(f.recompute_full.get(b, 0) for b in blocks)}
        tail = max((m for m in modules if m in order), key=order.get, default=None)
        act = f.outputs.get("" if s == last else tail)
        boundary = act.numel * act.dtype.itemsize if act is not None else 0
        side = [m for m in modules if m not in blocks]
        side_kept = sum(f.outputs[m].numel * f.outputs[m].dtype.itemsize for m in side if m in f.outputs)
        if s == last and "" in f.outputs:  # the loss keeps fp32 logits for its backward
            side_kept += f.outputs[""].numel * 4
        out.append(Stage(tuple(modules), blocks, units, sum(graph.subtree_numel.get(m, 0) for m in modules),
                         sums["forward"][s], sums["backward"][s], rec, boundary, side_kept))
    return out


@lru_cache(maxsize=512)
def _schedule(name: str, pp: int, m: int, v: int):
    """torch's schedule, or None where torch refuses to build it (P463's cases)."""
    try:
        return schedule(name, pp, m, v)
    except ValueError:
        return None


@lru_cache(maxsize=512)
def in_flight(name: str, pp: int, m: int, v: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per pipeline rank, the distinct maximal vectors of microbatches in flight per held stage over
    its action list (a forward adds one, a full or input backward takes it away)."""
    sched = _schedule(name, pp, m, v)
    out = []
    for held, actions in zip(sched.stages, sched.actions):
        idx = {s: k for k, s in enumerate(held)}
        now = [0] * len(held)
        seen: set[tuple[int, ...]] = set()
        for a in actions:
            for x in a.sub or (a,):
                if x.kind == FORWARD:
                    now[idx[x.stage]] += 1
                    seen.add(tuple(now))
                elif x.kind in (FULL_BACKWARD, BACKWARD_INPUT):
                    now[idx[x.stage]] -= 1
        out.append(tuple(v for v in seen if not any(w != v and all(a >= b for a, b in zip(w, v)) for w in seen)))
    return tuple(out)


class _Costs:
    """`timeline.Costs` from the stages' figures at one choice."""

    def __init__(self, stage_s: list[tuple[float, float]], p2p: list[float], gathers: list[list[float]],
                 reductions: list[list[float]], opt: list[float], owner: dict[int, int]):
        self.stage_s, self.p2p, self._g, self._r, self.opt, self.owner = stage_s, p2p, gathers, reductions, opt, owner

    def compute_s(self, stage: int, kind: str) -> float:
        f, b = self.stage_s[stage]
        return f if kind == FORWARD else (b / 2 if kind in (BACKWARD_INPUT, BACKWARD_WEIGHT) else b)

    def p2p_s(self, src: int, dst: int) -> float:
        return 0.0 if self.owner[src] == self.owner[dst] else self.p2p[min(src, dst)]

    def gathers(self, stage: int, phase: str, first: bool) -> list[float]:
        return self._g[stage] if phase == "forward" and first else []

    def reductions(self, stage: int) -> list[float]:
        return self._r[stage]

    def optimizer_s(self, stages) -> float:
        return sum(self.opt[s] for s in stages)


class Model:
    """The analytic model of one tensor degree at one world size, batch and hardware."""

    def __init__(self, prof: Profile, graph, world: int, hw, optimizer: str):
        self.prof, self.graph, self.world, self.hw, self.optimizer = prof, graph, world, hw, optimizer
        self._stages: dict[int, list[Stage]] = {}

    def stages(self, n: int) -> list[Stage]:
        if n not in self._stages:
            self._stages[n] = stages_of(self.prof, self.graph, n)
        return self._stages[n]

    def state(self, st: Stage, pp: int) -> tuple[int, int]:
        """(bytes kept all step: sharded state on the stage's data ranks, gathered params and unreduced
        grads; the optimizer's) of one stage at pipeline degree `pp` (its data ranks are 1/pp)."""
        us = [self.prof.units[i] for i in st.units]
        sharded = sum(u.sharded + u.grads for u in us) * pp
        opt = sum(u.optimizer for u in us) * pp
        return sharded + opt + sum(u.unsharded + u.grad_unsharded for u in us), opt

    def peak(self, c: PipeChoice) -> tuple[int, int]:
        """(the binding rank's estimated peak, that rank)."""
        stages = self.stages(c.pp * c.stages_per_rank)
        sched = _schedule(c.schedule, c.pp, c.microbatches, c.stages_per_rank)
        mb = c.local_batch // c.microbatches
        flights = in_flight(c.schedule, c.pp, c.microbatches, c.stages_per_rank)
        best = (-1, 0)
        for rank, (held, vecs) in enumerate(zip(sched.stages, flights)):
            state = sum(self.state(stages[s], c.pp)[0] for s in held)
            kept = [mb * (sum(self.prof.kept[(b, c.checkpoint)] for b in stages[s].blocks) + stages[s].side_kept)
                    for s in held]
            act = max((sum(k * n for k, n in zip(kept, v)) for v in vecs), default=0)
            extra = mb * max((self.prof.extra_bwd[(b, c.checkpoint)] for s in held for b in stages[s].blocks), default=0)
            total = state + act + extra + mb * max(stages[s].boundary for s in held)
            if total > best[0]:
                best = (total, rank)
        return best

    def lower_time(self, c: PipeChoice) -> float:
        """A bound from below: the busiest rank's compute (no bubble, no communication)."""
        stages = self.stages(c.pp * c.stages_per_rank)
        rate = self.hw.bf16_flops * self.hw.efficiency * self.prof.tensor
        sched = _schedule(c.schedule, c.pp, c.microbatches, c.stages_per_rank)
        return max(sum(stages[s].fwd_flops + stages[s].bwd_flops + stages[s].recompute[c.checkpoint] for s in held)
                   for held in sched.stages) * c.local_batch / rate

    def seconds(self, c: PipeChoice) -> tuple[float, float]:
        """(the step time on the timeline, its bubble)."""
        stages = self.stages(c.pp * c.stages_per_rank)
        sched = _schedule(c.schedule, c.pp, c.microbatches, c.stages_per_rank)
        mb = c.local_batch // c.microbatches
        rate = self.hw.bf16_flops * self.hw.efficiency * self.prof.tensor
        dp = self.world // (c.pp * self.prof.tensor)
        stride = self.world // c.pp
        link = self.hw.link(2 * stride)
        stage_s = [(mb * st.fwd_flops / rate, mb * (st.bwd_flops + st.recompute[c.checkpoint]) / rate) for st in stages]
        p2p = [link.alpha_s + mb * st.boundary / self.prof.tensor / link.busbw for st in stages]

        def on(cs: Collective) -> float:
            return collective_s(dataclasses.replace(cs, ranks=dp), self.hw) if dp > 1 else 0.0
        gathers = [[on(x) for i in st.units for x in self.prof.collectives[i] if x.kind == "all_gather"] for st in stages]
        reds = [[on(x) for i in st.units for x in self.prof.collectives[i] if x.kind in ("reduce_scatter", "all_reduce")]
                for st in stages]
        per_byte = OPTIMIZER_BYTES.get(self.optimizer, 7) / self.hw.hbm_bw
        opt = [sum(self.prof.units[i].sharded for i in st.units) * c.pp * per_byte for st in stages]
        owner = {s: r for r, held in enumerate(sched.stages) for s in held}
        tl = simulate(sched, _Costs(stage_s, p2p, gathers, reds, opt, owner))
        return tl.step_s, tl.bubble()


# ===================================================================== the enumeration


def choices(world: int, global_batch: int, tensor: int, pps, schedules, pieces: int):
    """Every (pipeline degree, schedule, stages per rank, microbatches, mode) at `tensor`; the
    microbatches divide the data-parallel rank's batch and are at least the stages (no P474); a
    split-backward schedule without checkpointing (P451)."""
    for pp in pps:
        if pp < 2 or world % (pp * tensor):
            continue
        dp = world // (pp * tensor)
        if global_batch % dp:
            continue
        local = global_batch // dp
        for name in schedules:
            vs = (1,) if name in SINGLE_STAGE else (2,) if name in V_SCHEDULES else range(2, MAX_STAGES_PER_RANK + 1)
            for v in vs:
                if pp * v > pieces:
                    continue
                for m in range(pp * v, local + 1):
                    if local % m or _schedule(name, pp, m, v) is None:
                        continue
                    # no checkpointing under a split backward: torch 2.13's composable checkpoint fails there (P451)
                    for mode in ("none",) if name in SPLIT_BACKWARD else CHECKPOINT_MODES:
                        yield PipeChoice(tensor, pp, name, v, m, mode, local)


def search(models: dict[int, Model], world: int, global_batch: int, budget: int, pps, schedules,
           exclude: set = frozenset()) -> tuple[list[PipeOption], PipeOption | None, int, int]:
    """(the fitting options by time, best first; the smallest peak seen; simulated; pruned)."""
    from planc.resolve.split import block_list, split_items
    fitting: list[PipeOption] = []
    smallest = None
    searched = pruned = 0
    for t, model in models.items():
        blocks = block_list(model.graph)
        before, items, after = split_items(model.graph, blocks)
        pieces = len(items) + bool(before) + bool(after)
        cands = []
        for c in choices(world, global_batch, t, pps, schedules, pieces):
            if c in exclude:
                continue
            peak, _ = model.peak(c)
            if smallest is None or peak < smallest.peak:
                smallest = PipeOption(c, float("inf"), peak)
            if peak > budget:
                pruned += 1
                continue
            cands.append((model.lower_time(c), peak, c))
        cands.sort(key=lambda x: x[0])
        for bound, peak, c in cands:
            if len(fitting) > 3 and bound >= fitting[3].seconds:
                pruned += 1
                continue
            searched += 1
            sec, bubble = model.seconds(c)
            fitting.append(PipeOption(c, sec, peak, bubble=bubble))
            fitting.sort(key=lambda o: o.seconds)
    return fitting, smallest, searched, pruned




__all__ = ["DEFAULT_SCHEDULES", "SCHEDULES", "SPLIT_BACKWARD", "Model", "PipeChoice", "PipeOption", "PipeSuggestion",
           "Profile", "SplitError", "choices", "in_flight", "profile", "search", "stages_of"]
_ = time


# ===================================================================== the plan, verified


def plan_text(chain, model_ref: str | None, c: PipeChoice, parallel: tuple[str, ...], header=(), expects=()) -> str:
    """The choice as a formatted plan: the pipeline, one unit per block (FSDP within each stage, no
    `reshard`: under a pipeline unset is false, torchtitan's default and P465-safe), checkpointing."""
    from planc.lang import printer
    from planc.lang import syntax as st
    from planc.lang.fmt import format_plan
    from planc.resolve.pipeline import default_stages_per_rank
    from planc.suggest.space import _NOWHERE, _slice, _target
    lines = [f"# {h}" if h else "#" for h in header]
    if model_ref:
        lines += [f"model {model_ref}", ""]
    axes = [f"pipeline = {c.pp}", "shard = *"] + ([f"tensor = {c.tensor}"] if c.tensor > 1 else [])
    lines += [f"mesh ({', '.join(axes)})", ""]
    opts = [f"microbatches {c.microbatches}"]
    if c.stages_per_rank != default_stages_per_rank(c.schedule):
        opts.append(f"stages_per_rank = {c.stages_per_rank}")
    lines += [f"pipeline {c.schedule} {{ {', '.join(opts)} }}", ""]
    lines += ["defaults {", "  precision param = bf16, reduce = fp32, cast_inputs = false", "}", ""]
    units = [st.UnitStmt(span=_NOWHERE, target=_target(g), block=None) for g in chain.pre]
    units.append(st.UnitStmt(span=_NOWHERE, target=_slice(chain.blocks_path, 0, chain.n, chain.n), block=None))
    if chain.post:
        units.append(st.UnitStmt(span=_NOWHERE, target=_target(chain.post), block=None))
    lines += [printer.statement(u) for u in units] + [""]
    if c.checkpoint != "none":
        lines += [printer.statement(st.CheckpointStmt(span=_NOWHERE, selector=_slice(chain.blocks_path, 0, chain.n, chain.n),
                                                      mode=st.Name(span=_NOWHERE, value=c.checkpoint))), ""]
    if c.tensor > 1 and parallel:
        lines += list(parallel) + [""]
    lines += list(expects)
    return format_plan("\n".join(lines) + "\n", "<suggest>")


def exact(graph, text: str, world: int, shape: tuple[int, int], hw, optimizer: str) -> tuple[int, str, float, float, object]:
    """The full role estimators on a written plan (what `planc explain` prints): (the binding rank's
    peak, its moment, the step time, the bubble, the compiled plan)."""
    import planc
    from planc.compiler import CompiledPlan
    from planc.estimate.role_memory import estimate_roles
    from planc.estimate.roles import step_time_of_pipeline
    compiled = CompiledPlan(planc.loads(text), graph, world, check_memory=False)
    errors = [d for d in compiled.diagnostics if d.severity == "error"]
    if errors:
        raise ValueError(f"the suggested plan fails planc's checks: {errors[0].code} {errors[0].message}")
    est = estimate_roles(compiled, world, optimizer=optimizer, input_shape=shape)
    st = step_time_of_pipeline(compiled, world=world, hardware=hw, input_shape=shape, optimizer=optimizer)
    return est.peak.total, est.peak.label, st.total_s, st.pipeline.bubble, compiled


def _header(model_ref, world: int, hw, budget_text: str, seq: int, gb: int, best: PipeOption, others, flat, notes,
            stats: dict) -> list[str]:
    c = best.choice
    dp = world // (c.pp * c.tensor)
    lines = [
        f"Suggested by `planc suggest --pipeline` for {model_ref or 'the model'} on {world} ranks ({hw.name}),",
        f"{gb} sequences of {seq} tokens a step ({c.local_batch} per data-parallel rank, {dp} data-parallel ranks),",
        f"per-rank budget {budget_text}. Estimates ("
        + ("planc's role estimators, as `planc explain` prints them):" if best.exact else
           "the search's analytic model, NOT verified by the role estimators: `planc explain` gives theirs):"),
        f"  peak {show_bytes(best.peak)} on the binding pipeline rank{f' at {best.where}' if best.where else ''}: "
        f"{show_bytes(_budget_of(budget_text) - best.peak)} under the budget",
        f"  step time {_secs(best.seconds)}, the slowest rank's, bubble {best.bubble:.1%} "
        f"(docs/time-model.md; {hw.name}, {hw.efficiency:.0%} of peak FLOP/s achieved)",
        f"  choice: {c.describe()}; FSDP within each stage, one unit per block, no resharding after forward",
        f"  searched: {stats.get('searched', 0)} choices simulated, {stats.get('pruned', 0)} pruned by memory or "
        f"a time bound",
        *[f"Note: {n}" for n in dict.fromkeys(notes)],
        "Next best (the search's model: step time on the timeline, peak ~):",
    ]
    for o in others:
        lines.append(f"  {_secs(o.seconds)}, peak ~{show_bytes(o.peak)}: {o.choice.describe()}")
    if not others:
        lines.append("  none: no other choice fits")
    if flat is not None:
        lines.append(f"Without a pipeline: {flat}")
    return lines


def _secs(s: float) -> str:
    return f"{s:.4g} s" if s >= 1 else f"{s * 1e3:.4g} ms"


def _budget_of(text: str) -> int:
    from planc.lang.transform import parse_quantity
    return int(parse_quantity(text)[0])


def _distinct(options: list[PipeOption], best: PipeOption, k: int) -> list[PipeOption]:
    """The next `k` options, one per (tensor, pipeline, schedule, stages per rank) other than the best's."""
    def key(o):
        c = o.choice
        return (c.tensor, c.pp, c.schedule, c.stages_per_rank)
    seen = {key(best)}
    out = []
    for o in options:
        if key(o) not in seen:
            seen.add(key(o))
            out.append(o)
    return out[:k]


def suggest_pipeline(graph, model_ref: str | None, world: int, budget: int, seq: int, global_batch: int, *,
                     hardware="h100", optimizer: str = "adamw", budget_text: str, parallel: tuple[str, ...] = (),
                     tensors=(1,), pipelines=(2, 4, 8), schedules=DEFAULT_SCHEDULES, alternatives: int = 3,
                     verify: bool = True, flat=None, notes=()) -> PipeSuggestion:
    """The fastest pipeline plan that fits `budget` per rank (module docstring). `flat`: a line for
    the header saying what the search without a pipeline found (the caller's)."""
    from planc.estimate.trace import TraceError
    from planc.suggest.evaluate import RulesRejected
    t0, c0 = time.perf_counter(), time.process_time()
    hw = hardware_of(hardware)
    notes, models = list(notes), {}
    total = graph.subtree_numel.get("", 0)
    for t in tensors:
        usable = [p for p in pipelines if world % (p * t) == 0]
        if not usable:
            continue
        # a bound from below, before the profile: the busiest rank holds at least 1/P of the parameters, gathered
        # in bf16 with their bf16 gradients, at best split T ways (the largest degree is always profiled)
        floor = 4 * total // (max(usable) * t)
        if floor > budget and t != max(tensors):
            notes.append(f"tensor {t} not profiled: 1/{max(usable)} of the parameters gathered in bf16 with their "
                         f"gradients, split {t} ways, take {show_bytes(floor)} alone")
            continue
        try:
            models[t] = Model(profile(graph, model_ref, world, seq, optimizer, t, parallel), graph, world, hw, optimizer)
        except RulesRejected as err:
            notes.append(f"tensor {t}: rejected by planc's checks: {err.errors[0].code} {err.errors[0].message}")
        except TraceError as err:
            if t == 1:
                raise
            notes.append(f"tensor {t}: the model did not run as one tensor rank: {str(err).splitlines()[0][:160]}")
    stats = {"profile_s": time.perf_counter() - t0, "profile_cpu_s": time.process_time() - c0}
    bound, excluded = budget, set()
    best = smallest = None
    fitting: list[PipeOption] = []
    searched = pruned = 0
    for _ in range(6):
        fitting, smallest, s, p = search(models, world, global_batch, bound, pipelines, schedules, excluded)
        searched, pruned = searched + s, pruned + p
        if not fitting:
            break
        cand = fitting[0]
        if not verify:
            best = cand
            break
        text = plan_text(models[cand.choice.tensor].prof.chain, model_ref, cand.choice, parallel)
        peak, where, sec, bubble, _ = exact(graph, text, world, (cand.choice.local_batch, seq), hw, optimizer)
        if peak <= budget:
            best = PipeOption(cand.choice, sec, peak, True, where, bubble)
            break
        excluded.add(cand.choice)
        bound -= peak - budget + max(1, budget // 1000)
        notes.append(f"the search's model put {cand.choice.describe()} at ~{show_bytes(cand.peak)}, the role "
                     f"estimator at {show_bytes(peak)}: searched again under a bound {show_bytes(peak - budget)} lower")
    stats.update(searched=searched, pruned=pruned, search_s=time.perf_counter() - t0,
                 search_cpu_s=time.process_time() - c0)
    if best is None and smallest is None:  # not a budget question: no choice at all
        raise NoPipeline(f"no choice of {', '.join(schedules)} at pipeline {', '.join(map(str, pipelines))}: each "
                         "data-parallel rank's batch must divide into at least one microbatch per stage, in counts "
                         "torch builds the schedule with")
    if best is None:
        return PipeSuggestion(None, [], smallest, None, budget, searched, pruned, stats, notes)
    others = _distinct(fitting, best, alternatives)
    c = best.choice
    chain = models[c.tensor].prof.chain
    from planc.suggest.space import expect_line
    expects = ["# the budget on the binding pipeline rank, checked by `planc check` (re-run `planc suggest` when it fails)",
               expect_line(budget_text, float(budget), world, (c.local_batch, seq))]
    header = _header(model_ref, world, hw, budget_text, seq, global_batch, best, others, flat, notes,
                     {"searched": searched, "pruned": pruned})
    text = plan_text(chain, model_ref, c, parallel, header, expects)
    stats.update(total_s=time.perf_counter() - t0, total_cpu_s=time.process_time() - c0)
    return PipeSuggestion(best, others, None, text, budget, searched, pruned, stats, notes)


class NoPipeline(Exception):
    """No pipeline degree asked for can be searched (the message says why, per degree)."""


def why_not(world: int, global_batch: int, pp: int, tensors, pieces: int) -> str | None:
    """Why degree `pp` has no choice at any tensor degree (None when it has one, given the schedules)."""
    whys = []
    for t in tensors:
        if world % (pp * t):
            whys.append(f"pipeline {pp} x tensor {t} does not divide {world} ranks")
        elif global_batch % (world // (pp * t)):
            whys.append(f"{global_batch} sequences do not divide among {world // (pp * t)} data-parallel ranks "
                        f"(tensor {t})")
        elif global_batch // (world // (pp * t)) < pp:
            whys.append(f"{global_batch // (world // (pp * t))} sequences per data-parallel rank (tensor {t}) are "
                        f"fewer than the {pp} stages")
        else:
            return None if pp <= pieces else f"the model cuts into at most {pieces} stages"
    return "; ".join(whys)


def default_pipelines(world: int) -> tuple[int, ...]:
    return tuple(p for p in (1, 2, 4, 8, 16) if world % p == 0)


def suggest_all(graph, model_ref: str | None, world: int, budget: int, shape: tuple[int, int], *, hardware="h100",
                optimizer: str = "adamw", budget_text: str, parallel: tuple[str, ...] | None = None, tensors=None,
                pipelines=None, schedules=DEFAULT_SCHEDULES, global_batch: int | None = None):
    """`planc suggest --pipeline`: the pipeline search over `pipelines` (degree 1 is the search without
    a pipeline, `planc.suggest.search.suggest`, run when the global batch divides among the world) and the
    fastest of them. Returns the `PipeSuggestion` or, when no pipeline wins, the flat `Suggestion`."""
    from planc.resolve.split import block_list, split_items
    from planc.suggest.search import default_degrees, suggest
    seq = shape[1]
    gb = global_batch or world * shape[0]
    pipelines = tuple(sorted(set(pipelines or default_pipelines(world))))
    tensors = tuple(sorted(set(tensors or (default_degrees(world, hardware) if parallel else (1,)))))
    blocks = block_list(graph)
    if blocks is None:
        raise ValueError("the model has no list of repeated blocks to cut into stages")
    before, items, after = split_items(graph, blocks)
    pieces = len(items) + bool(before) + bool(after)
    skipped = {p: why_not(world, gb, p, tensors, pieces) for p in pipelines if p > 1}
    degrees = [p for p, why in skipped.items() if why is None]
    flat = None
    if 1 in pipelines:
        if gb % world:
            skipped[1] = f"{gb} sequences do not divide among {world} ranks"
        else:
            flat = suggest(graph, model_ref, world, budget, (gb // world, seq), hardware=hardware, optimizer=optimizer,
                           budget_text=budget_text, parallel=parallel, tensors=list(tensors) if parallel else None)
    if not degrees and flat is None:
        raise NoPipeline("; ".join(f"pipeline {p}: {why}" for p, why in skipped.items()))
    notes = [f"pipeline {p} not searched: {why}" for p, why in skipped.items() if why]
    flat_line = None
    if flat is not None:
        flat_line = (f"{_secs(flat.best.seconds)}, peak {show_bytes(flat.best.peak)} ({flat.best.candidate.describe()}"
                     f"{f', tensor {flat.tensor}' if flat.tensor > 1 else ''})" if flat.best is not None
                     else "nothing fits the budget")
    if not degrees:
        return flat
    piped = suggest_pipeline(graph, model_ref, world, budget, seq, gb, hardware=hardware, optimizer=optimizer,
                             budget_text=budget_text, parallel=tuple(parallel or ()), tensors=tensors,
                             pipelines=tuple(degrees), schedules=tuple(schedules), flat=flat_line, notes=notes)
    if flat is not None and flat.best is not None and (piped.best is None or flat.best.seconds < piped.best.seconds):
        if piped.best is not None:
            flat.text = (f"# Note: no pipeline is faster: the pipeline search's best is {_secs(piped.best.seconds)} "
                         f"({piped.best.choice.describe()})\n" + flat.text)
        return flat
    if piped.best is None and flat is not None and flat.smallest is not None \
            and (piped.smallest is None or flat.smallest.peak < piped.smallest.peak):
        return flat
    return piped
