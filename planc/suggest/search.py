"""`suggest`: the fastest plan whose estimated per-rank peak fits a budget (see planc/suggest/solve.py)."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from planc.estimate import memory as mem_model
from planc.estimate.collectives import RoutingUnknown
from planc.estimate.hardware import hardware as hardware_of
from planc.estimate.trace import Example, TraceError, default_input, trace_for
from planc.quantities import show_bytes
from planc.suggest.cost import context as cost_context
from planc.suggest.cost import cost
from planc.suggest.degrees import (
    AXES,
    NOT_TRIED,
    Degrees,
    axis_lines,
    combinations,
    default_context,
    default_expert,
    does_not_fill,
    input_text,
)
from planc.suggest.evaluate import Evaluator, RulesRejected, compress
from planc.suggest.solve import Subproblem, build, globals_for, lower_bound, min_peak_choice, solve, surely_infeasible
from planc.suggest.space import Candidate, expect_line, find_chain


@dataclass
class Option:
    """One evaluated candidate."""

    candidate: Candidate
    seconds: float
    peak: int                 # bytes, per the memory model (`exact`) or the linear model
    exact: bool
    where: str = ""           # the moment of the peak (exact estimates only)


@dataclass
class Suggestion:
    """The result: the best option (None when nothing fits), alternatives, and the plan text."""

    best: Option | None
    alternatives: list[Option]
    smallest: Option | None   # the smallest peak found, when nothing fits
    text: str | None
    budget: int
    searched: int             # global choices solved
    pruned: int               # global choices skipped by their time bound
    seconds: float
    stats: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)   # what the search left out, and why
    tensor: int = 1                              # the winner's tensor-parallel degree
    degrees: list = field(default_factory=list)  # (Degrees, Option | None, what happened) per combination searched
    evaluator: Evaluator | None = field(default=None, repr=False)
    combo: Degrees = field(default_factory=Degrees)  # the winner's degrees (tensor, context, expert)
    axes: tuple = ()                                 # the axes searched beside FSDP (`planc.suggest.degrees.AXES`)


def exact_peak(ev: Evaluator, c: Candidate) -> tuple[int, str]:
    """The memory model's peak of `c` and its moment: `c`'s own trace (checkpointing applied),
    shortened by `compress` (the same peak as `planc.estimate.memory.estimate`)."""
    compiled = ev.compiled(c)
    if not any(m != "none" for m in c.checkpoint):
        trace = None
    else:
        with warnings.catch_warnings():  # torch's, on the model's own code (the Evaluator's trace mutes them too)
            warnings.simplefilter("ignore")
            tp, cp, ep = ev.rank_degrees
            trace = compress(trace_for(compiled, ev.local_inputs, None, tp, repeat=True, cp=cp, ep=ep))
    if trace is None:
        from planc.suggest.evaluate import remap
        program = compiled.program
        trace = remap(ev.atom_trace, ev.atom_program.units, program.units) if c.merge != 1 else ev.atom_trace
    r = ev._replay(compiled.program, trace, _Replay=mem_model._Replay)
    peak = max(r.timeline, key=lambda m: m.total)
    return peak.total, peak.label


ALTERNATIVE_S = 1.0  # seconds HiGHS may take on a global choice that cannot win (an alternative)


class NoDegree(Exception):
    """Every combination of degrees asked for was skipped (the message says why, per combination)."""

    def __init__(self, message: str, axes: tuple[str, ...] = ("tensor",)):
        super().__init__(message)
        self.axes = axes  # the axes searched beside FSDP


def default_degrees(world: int, hardware) -> list[int]:
    """The tensor-parallel degrees searched by default: 1, 2, 4, 8 dividing `world`, within a node."""
    node = hardware_of(hardware).gpus_per_node
    return [t for t in (1, 2, 4, 8) if world % t == 0 and t <= node]


def suggest(graph, model_ref: str | None, world: int, budget: int, shape: tuple[int, ...] | None, *,
            hardware: str = "h100", optimizer: str = "adamw", budget_text: str | None = None,
            progress: Callable[[int, int], None] | None = None, alternatives: int = 3,
            cost_fn=cost, parallel: tuple[str, ...] | None = None, tensors: list[int] | None = None,
            inputs=None, inputs_name: str | None = None, context_rules: tuple[str, ...] | None = None,
            contexts: list[int] | None = None, expert_rules: tuple[str, ...] | None = None,
            experts: list[int] | None = None) -> Suggestion:
    """Search the space of planc/suggest/space.py for `graph` at `world` ranks.

    Args:
        graph: the model graph (with its model, for the trace).
        budget: per-rank bytes the estimated peak must not exceed.
        shape: (batch, sequence) of token ids per rank; None with `inputs`.
        inputs: the step's inputs per rank instead of token ids (a tuple, a kwargs dict or an
            `Example`, as an input factory of `planc explain --inputs` returns them: T5's decoder
            ids, images). The plan's `expect` line then has no `input =` (it names token ids
            only): the header says so and how to check the bound with the inputs.
        inputs_name: what the header calls `inputs` (the factory, `pkg.module:fn`).
        hardware: a profile name or file (`planc.estimate.hardware`), or a `Hardware`.
        progress: called with (done, total) global choices as the search goes.
        cost_fn: `cost(program, context) -> seconds` (default planc's step-time model).
        parallel: `parallel` statements (plan text, one statement each): with them the search
            runs once per tensor-parallel degree in `tensors` (default `default_degrees`), the
            mesh gaining `tensor = t` and the statements added; degree 1 is the 1-D search. A
            degree the rules fail planc's checks at is skipped with a note. Each degree keeps
            the tokens per rank: the data-parallel input is batch x t (a tensor group shares
            it), so every degree trains world x batch sequences per step.
        context_rules, contexts: `parallel ... context` statements and the context degrees (default
            `default_context`, tried only when nothing without a context axis fits: degrees.py's rule;
            given, always). A context group of c ranks shares the batch x sequence input, each rank
            holding sequence / c of it; combinations are compared per world x batch sequences.
        expert_rules, experts: `parallel ... expert` statements and the expert degrees (default
            `default_expert`). Every (tensor, context, expert) combination of the lists is one search
            (planc/suggest/degrees.py); one planc's checks reject is skipped with its code.
    """
    if budget_text is None:  # a size the `expect` line can spell exactly (whole KiB at least)
        budget, budget_text = budget_spelling(budget)
    if (shape is None) == (inputs is None):
        raise TypeError("suggest: give `shape` (token ids) or `inputs`, not both")
    rules = {"tensor": tuple(parallel or ()), "context": tuple(context_rules or ()), "expert": tuple(expert_rules or ())}
    axes = tuple(a for a in AXES if rules[a])
    if not axes:
        return _suggest_one(graph, model_ref, world, budget, shape, hardware=hardware, optimizer=optimizer,
                            budget_text=budget_text, progress=progress, alternatives=alternatives, cost_fn=cost_fn,
                            inputs=inputs, inputs_name=inputs_name)
    if inputs is not None:  # each degree scales the batch of token ids (below); arbitrary inputs cannot be
        raise TypeError("suggest: the search over degrees takes `shape` (token ids), not `inputs`")
    combos = combinations((tensors or default_degrees(world, hardware)) if rules["tensor"] else [1],
                          (contexts or default_context(world)) if rules["context"] else [1],
                          (experts or default_expert(world)) if rules["expert"] else [1])
    kw = dict(hardware=hardware, optimizer=optimizer, budget_text=budget_text, progress=progress,
              alternatives=alternatives, cost_fn=cost_fn)
    deferred = [d for d in combos if d.context > 1 and contexts is None]  # the default rule (planc/suggest/degrees.py)
    results = [_search_degrees(graph, model_ref, world, budget, shape, d, d.rules(rules), **kw)
               for d in combos if d not in deferred]
    if deferred and any(r is not None and r.best is not None for _, r, _ in results):
        results += [(d, None, NOT_TRIED) for d in deferred]
    else:
        results += [_search_degrees(graph, model_ref, world, budget, shape, d, d.rules(rules), **kw) for d in deferred]
    fitting = [(d, r) for d, r, _ in results if r is not None and r.best is not None]
    if not fitting:  # the smallest peak over the degrees, for P950
        tried = [r for _, r, _ in results if r is not None]
        if not tried:
            raise NoDegree("no combination of degrees could be searched: "
                           + "; ".join(f"{d.describe(axes)}: {why}" for d, _, why in results), axes)
        out = min(tried, key=lambda r: r.smallest.peak)
    else:  # compared per world x batch sequences (a context group trains 1 / context of them a step)
        out = min((r for _, r in fitting), key=lambda r: r.combo.per_sequences(r.best.seconds))
    out.degrees = [(d, r.best if r is not None else None, why) for d, r, why in results]
    out.axes = axes
    out.searched = sum(r.searched for _, r, _ in results if r is not None)
    out.pruned = sum(r.pruned for _, r, _ in results if r is not None)
    if out.best is not None:
        ev = out.evaluator
        out.text = render(ev, out.best, out.alternatives, out.budget, budget_text, ev.shape, hardware, optimizer,
                          degrees=out.degrees, shape_1d=shape, axes=axes)
    return out


def _search_degrees(graph, model_ref, world, budget, shape, d: Degrees, rules: tuple[str, ...], **kw):
    """(d, the search at degrees `d`, "") or (d, None, why it was skipped: the code of the check that
    rejects it, or the model not running as one rank of them)."""
    why = does_not_fill(d, world)
    if why:
        return d, None, why
    try:
        r = _suggest_one(graph, model_ref, world, budget, d.group_shape(shape), tensor=d.tensor, context=d.context,
                         expert=d.expert, parallel=rules, **kw)
    except RulesRejected as err:
        first = err.errors[0]
        return d, None, f"rejected by planc's checks: {first.code} {first.message}"
    except TraceError as err:
        if d == Degrees():
            raise
        return d, None, f"the model did not run as one rank of these degrees: {str(err).splitlines()[0][:160]}"
    except RoutingUnknown as err:  # an experts container the style fits, but whose all-to-alls cannot be priced
        return d, None, f"not estimated: P961 {err}"
    return d, r, "" if r.best is not None else f"nothing fits the budget (smallest peak found {show_bytes(r.smallest.peak)})"


def _suggest_one(graph, model_ref: str | None, world: int, budget: int, shape: tuple[int, ...] | None, *,
                 hardware, optimizer: str, budget_text: str, progress, alternatives: int, cost_fn,
                 tensor: int = 1, parallel: tuple[str, ...] = (), inputs=None, inputs_name: str | None = None,
                 context: int = 1, expert: int = 1) -> Suggestion:
    """The search at one combination of degrees (all 1: 1-D plans); `shape` (or `inputs`) is the input of one
    tensor x context group (a data-parallel rank's at degree 1)."""
    t0, c0 = time.perf_counter(), time.process_time()
    hw = hardware_of(hardware)
    shape = None if shape is None else tuple(shape)
    if inputs is not None:
        inputs = Example.of(inputs)
    find_chain(graph)  # ValueError (no block chain) before the model runs
    try:
        ev = Evaluator(graph, model_ref, world, shape, optimizer, tensor, tuple(parallel), inputs, context, expert)
    except (RulesRejected, TraceError, RoutingUnknown):
        raise
    except Exception as err:  # the model's own code, run on fake tensors, can fail on these inputs
        example = Example.of(inputs if inputs is not None else default_input(graph.model, shape))
        raise TraceError(f"the model did not run on inputs of shape {describe_inputs(example)}: "
                         f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from err
    ctx = cost_context(graph, world, shape, hw, optimizer, inputs=inputs)
    t_trace, c_trace = time.perf_counter() - t0, time.process_time() - c0
    subs: list[Subproblem] = [build(ev, g, ctx, cost_fn) for g in globals_for(ev, hw)]
    t_build = time.perf_counter() - t0 - t_trace
    # each global choice's linear relaxation bounds its time from below: solved in that order, a
    # choice whose bound is not below the best found cannot win; it is solved (with a time limit:
    # its incumbent is good enough to list) only while alternatives are wanted
    bound = {id(sp): float("inf") if surely_infeasible(sp, budget) else lower_bound(sp, budget) for sp in subs}
    subs.sort(key=lambda sp: bound[id(sp)])
    found: list[Option] = []
    best: Option | None = None
    searched = pruned = 0
    for k, sp in enumerate(subs):
        if progress:
            progress(k, len(subs))
        losing = best is not None and bound[id(sp)] >= best.seconds
        if bound[id(sp)] == float("inf") or (losing and len(found) > alternatives):
            pruned += 1
            continue
        searched += 1
        option = _solve_fitting(ev, sp, budget, ctx, cost_fn, verify=False, time_limit=ALTERNATIVE_S if losing else None)
        if option is None:
            continue
        found.append(option)
        if best is None or option.seconds < best.seconds:
            best = option
    if progress:
        progress(len(subs), len(subs))
    t_solve = time.perf_counter() - t0 - t_trace - t_build
    c_search = time.process_time() - c0
    smallest = None
    if best is not None:
        # the winner's peak by the memory model itself; if the linear model was optimistic, tighten and re-solve
        sp = next(s for s in subs if s.g == _global(best.candidate))
        verified = _solve_fitting(ev, sp, budget, ctx, cost_fn, verify=True)
        if verified is None:
            found = [o for o in found if o is not best]
            best = min(found, key=lambda o: o.seconds) if found else None
            if best is not None:
                sp = next(s for s in subs if s.g == _global(best.candidate))
                best = _solve_fitting(ev, sp, budget, ctx, cost_fn, verify=True)
        else:
            best = verified
    if best is None:
        for _ in range(3):  # a mode the model cannot be traced with is left out, then again
            cands = []
            for sp in subs:
                ch = min_peak_choice(sp)
                cands.append((sp.peak(ch), sp, ch))
            try:  # the three smallest by the linear model, measured by the memory model
                tried = []
                for _, sp, ch in sorted(cands, key=lambda t: t[0])[:3]:
                    c = sp.candidate(ch)
                    tried.append((*exact_peak(ev, c), c))
                peak, where, c = min(tried, key=lambda t: t[0])
                break
            except TraceError as err:
                bad = next(m for m in ("selective", "full") if m in c.checkpoint)
                ev.notes.append(f"`checkpoint {bad}` left out: {str(err).splitlines()[0][:200]}")
                for other in subs:
                    other.drop_mode(bad)
        smallest = Option(c, cost_fn(ev.compiled(c).program, ctx), peak, True, where)
        if peak <= budget:  # the linear model is conservative here; the memory model says it fits
            best, smallest = smallest, None
    others = sorted((o for o in found if best is None or _global(o.candidate) != _global(best.candidate)),
                    key=lambda o: o.seconds)[:alternatives]
    for o in others:  # costed as whole programs, as the winner is
        o.seconds = cost_fn(ev.compiled(o.candidate).program, ctx)
    others.sort(key=lambda o: o.seconds)
    text = None
    if best is not None:
        text = render(ev, best, others, budget, budget_text, shape, hardware, optimizer, inputs_name=inputs_name)
    total = time.perf_counter() - t0
    stats = {"trace_s": t_trace, "build_s": t_build, "solve_s": t_solve,
             "verify_s": total - t_trace - t_build - t_solve, "total_s": total,
             "trace_cpu_s": c_trace, "search_cpu_s": c_search, "total_cpu_s": time.process_time() - c0}
    return Suggestion(best, others, smallest, text, budget, searched, pruned, time.perf_counter() - t0, stats,
                      list(dict.fromkeys(ev.notes)), tensor, [], ev, Degrees(tensor, context, expert))


def _canonical(sp, choice: list[int], bound: float) -> list[int]:
    """The same choices moved within runs of equal blocks so that the non-default ones come last
    (a MILP's ties are arbitrary; a plan reads better as runs), kept only if the model agrees
    it is no slower and still fits."""
    if len({tuple(sp.d_kept[u]) for u in range(len(choice))}) > 2:
        return choice
    tries = [sorted(choice, key=lambda c: (sp.combos[c][0] != "none", sp.combos[c][1] is not True, str(sp.combos[c])))]
    # else the reshard choices sorted within each run of one checkpoint mode (default last, then first)
    for last in (True, False):
        keyed, k = [], 0
        while k < len(choice):
            j = k
            while j < len(choice) and sp.combos[choice[j]][0] == sp.combos[choice[k]][0]:
                j += 1
            keyed += sorted(choice[k:j], key=lambda c: ((sp.combos[c][1] is not True) == last, str(sp.combos[c][1])))
            k = j
        tries.append(keyed)
    for keyed in tries:
        if sp.peak(keyed) <= bound and sp.seconds(keyed) <= sp.seconds(choice) * (1 + 1e-9):
            return keyed
    return choice


def budget_spelling(budget: int) -> tuple[int, str]:
    """(budget, its plan spelling): exact in GiB, MiB or KiB, else rounded down to whole KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if budget >= scale and budget % scale == 0:
            return budget, f"{budget // scale}{unit}"
    kib = max(1, budget // 1024)
    return kib * 1024, f"{kib}KiB"


def _global(c: Candidate):
    from planc.suggest.solve import Global
    return Global(c.merge, c.replicate, c.prefetch, c.offload)


def _solve_fitting(ev, sp, budget, ctx, cost_fn, *, verify: bool, tries: int = 6,
                   time_limit: float | None = None) -> Option | None:
    """The MILP's best choice for `sp`; with `verify`, re-estimated and the bound lowered until it fits."""
    bound = budget
    for _ in range(tries):
        choice = solve(sp, bound, time_limit=time_limit)
        if choice is None:
            return None
        choice = _canonical(sp, choice, bound)
        c = sp.candidate(choice)
        if not verify:  # the linear model's time (the finalists are costed as whole programs)
            return Option(c, sp.seconds(choice), sp.peak(choice), False)
        seconds = cost_fn(ev.compiled(c).program, ctx)
        try:
            peak, where = exact_peak(ev, c)
        except TraceError as err:  # the model does not run with one of the modes: search without it
            bad = next(m for m in ("selective", "full") if m in c.checkpoint and m in {x for x, _ in sp.combos})
            ev.notes.append(f"`checkpoint {bad}` left out: {str(err).splitlines()[0][:200]}")
            sp.drop_mode(bad)
            continue
        if peak <= budget:
            return Option(c, seconds, peak, True, where)
        bound -= peak - budget + max(1, budget // 1000)
    return None


def _degree_lines(ev: Evaluator, best: Option, degrees, axes, batch: int) -> list[str]:
    """Each combination's best (or why it has none), compared per world x batch sequences."""
    mine = Degrees(ev.tensor, ev.context, ev.expert)
    per = any(d.context > 1 for d, o, _ in degrees if o is not None)
    lines = ["Degrees searched (each combination's best, costed as a whole program"
             + (f"; compared per {ev.world * batch} sequences, the step time x context" if per else "") + "):"]
    for d, o, why in degrees:
        if o is None:
            lines.append(f"  {d.describe(axes)}: skipped, {why}")
            continue
        mark = " (this plan)" if d == mine else \
            f" (+{(d.per_sequences(o.seconds) / mine.per_sequences(best.seconds) - 1) * 100:.1f}%)"
        scaled = f" ({d.per_sequences(o.seconds) * 1e3:.3g} ms per {ev.world * batch} sequences)" if d.context > 1 else ""
        lines.append(f"  {d.describe(axes)}: {o.seconds * 1e3:.3g} ms{scaled}{mark}, peak {show_bytes(o.peak)}: "
                     f"{o.candidate.describe()}")
    return lines


def hw_text(hardware) -> str:
    """The profile and its stated efficiency, as the header names them."""
    hw = hardware_of(hardware)
    return f"{hw.name}, {hw.efficiency:.0%} of peak FLOP/s achieved"


def describe_inputs(example: Example) -> str:
    """An example's tensors by shape, keywords named: `2x16`, `input_ids 2x32, decoder_input_ids 2x16`."""
    def shape(t):
        return "x".join(map(str, t.shape)) or "scalar"
    parts = [shape(t) for t in Example(example.args).tensors()]
    parts += [f"{k} {shape(v)}" for k, v in example.kwargs.items() if isinstance(v, torch.Tensor)]
    return ", ".join(parts) or "no tensors"


def render(ev: Evaluator, best: Option, others: list[Option], budget: int, budget_text: str, shape, hardware: str,
           optimizer: str, degrees=(), shape_1d=None, inputs_name: str | None = None, axes=("tensor",)) -> str:
    """The plan text with its header; `degrees` (searches over degrees) lists each combination's best."""
    c = best.candidate
    given = shape is None  # the step's inputs came from an input factory, not `input = BxS` token ids
    shown = "x".join(map(str, shape)) if not given else describe_inputs(Example.of(ev.inputs))
    if given:
        inp = f"inputs {f'`{inputs_name}` ' if inputs_name else ''}({shown}) per rank, {optimizer},"
    elif ev.tensor > 1 or ev.context > 1:
        inp = input_text(ev, shown, shape_1d or (shape[0] // ev.tensor, *shape[1:]), optimizer)
    else:
        inp = f"input {shown} per rank, {optimizer},"
    first = f"Suggested by `planc suggest` for {ev.model_ref or 'the model'} on {ev.world} ranks ({hardware_of(hardware).name}),"
    header = [
        *([f"{first} {inp}"] if ev.tensor == 1 and ev.context == 1 else [first, inp]),
        f"per-rank budget {budget_text}. Estimates (planc's models, not measurements):",
        f"  peak {show_bytes(best.peak)} per rank at {best.where}: the binding constraint, "
        f"{show_bytes(budget - best.peak)} under the budget",
        f"  step time {best.seconds * 1e3:.3g} ms (planc's step-time model, docs/time-model.md; "
        f"{hw_text(hardware)})",
        f"  choice: {c.describe()}",
        *axis_lines(ev),
        *[f"Note: {n}" for n in dict.fromkeys(ev.notes)],
    ]
    if degrees:
        header += _degree_lines(ev, best, degrees, axes, (shape_1d or shape)[0])
    header.append("Next best (linear-model peaks):")
    for o in others:
        header.append(f"  {o.seconds * 1e3:.3g} ms (+{(o.seconds / best.seconds - 1) * 100:.1f}%), "
                      f"peak ~{show_bytes(o.peak)}: {o.candidate.describe()}")
    if not others:
        header.append("  none: no other global choice fits")
    if given:
        check = (f"planc explain PLAN --world-size {ev.world} --inputs {inputs_name}" if inputs_name
                 else f"planc.estimate.memory.estimate(compiled, {ev.world}, inputs=...)")
        expects = ["# the budget without activations, checked by `planc check` (an `expect` line's `input =` is",
                   "# token ids only, and this model's step takes other inputs); the peak with them, as above:",
                   f"#   {check}",
                   expect_line(budget_text, float(budget), ev.world, None)]
    else:
        expects = ["# the budget, checked by `planc check` (re-run `planc suggest` when it fails)",
                   expect_line(budget_text, float(budget), ev.world, tuple(shape))]
    return ev.text(c, header, expects)
