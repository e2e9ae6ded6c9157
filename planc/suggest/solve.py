"""The search of `planc suggest`: a MILP per global choice, exact over the block chain.

Global choices (unit granularity, HSDP replicate size, prefetch depth, offload) are few and
enumerated. For each, the per-unit choices (activation checkpointing x reshard after
forward, one of at most 9 combinations per block unit) are a 0/1 programme solved with
HiGHS (`scipy.optimize.milp`):

    minimise    sum_u sum_c  t[u,c] x[u,c]              (step time, from `cost`)
    subject to  sum_c x[u,c] = 1                         (one choice per unit)
                base[w] + shift + sum_{j kept in w} sum_c d_kept[j,c] x[j,c]
                        + sum_c d_local[w,c] x[u(w),c]  <= budget    for every window w

A *window* is a stretch of the base replay (`Evaluator.windows`): one phase, one unit
running, one set of block units holding forward state (activations saved for backward,
parameters kept unsharded). Its bytes are linear in the choices: each kept unit adds what
its choice keeps beyond the base (`d_kept`: checkpointing keeps less, reshard false/N
keeps parameters) and the running unit's own peak moves with its mode (`d_local`, from
the block profiles). `shift` is the state the global choice adds or removes (HSDP's larger
shards, offloaded state). The programme is exact for this model: `exhaustive` enumerates the
same model and tests/test_suggest.py checks they agree (optimality gap 0). The model itself
is checked where it matters: the winner is re-estimated with the memory model; if it does
not fit (the linear model is not exact for every interaction), the window bound is lowered
by the excess and the programme solved again.

The step-time coefficients come from `cost(program, context)` alone: the uniform
candidates (every unit one choice) are costed, and each unit is charged its share (by
parameters) of the difference to the all-default candidate. The few best solutions are
then re-costed as whole programs, so a cost that is not additive still ranks the finalists.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, replace

import numpy as np

from planc.lower.program import Checkpoint, FullyShard, Offload, Program
from planc.resolve.mesh import Mesh
from planc.suggest.cost import CostContext, cost
from planc.suggest.evaluate import Evaluator
from planc.suggest.space import CHECKPOINT_MODES, Candidate, unit_blocks

MERGE_LIMIT = 1 << 30  # bytes: the largest bf16 all-gather a merged unit may make


@dataclass(frozen=True)
class Global:
    """One global choice (the outer enumeration)."""

    merge: int
    replicate: int
    prefetch: int
    offload: bool


@dataclass
class Subproblem:
    """The linear model of one global choice (see the module docstring)."""

    g: Global
    combos: list[tuple[str, bool | int]]   # (checkpoint mode, reshard)
    time: np.ndarray                       # [units, combos] seconds
    base_time: float
    rows: list[tuple[int, tuple[int, ...], int, str]]  # (base bytes + shift, kept units, running unit or -1, phase)
    d_kept: np.ndarray                     # [units, combos]
    d_local: dict                          # phase -> [units, combos]

    @property
    def n_units(self) -> int:
        return self.time.shape[0]

    def peak(self, choice: list[int]) -> int:
        """The linear model's peak for one choice per unit (combo indices)."""
        best = 0
        for base, kept, unit, phase in self.rows:
            v = base + sum(self.d_kept[j, choice[j]] for j in kept)
            if unit >= 0:
                v += self.d_local[phase][unit, choice[unit]]
            best = max(best, v)
        return int(best)

    def seconds(self, choice: list[int]) -> float:
        return self.base_time + float(sum(self.time[u, c] for u, c in enumerate(choice)))

    def drop_mode(self, mode: str) -> None:
        """Leave checkpoint `mode` out of this subproblem (the model cannot be traced with it)."""
        keep = [i for i, (m, _) in enumerate(self.combos) if m != mode]
        self.combos = [self.combos[i] for i in keep]
        self.time, self.d_kept = self.time[:, keep], self.d_kept[:, keep]
        self.d_local = {k: v[:, keep] for k, v in self.d_local.items()}

    def candidate(self, choice: list[int]) -> Candidate:
        return Candidate(merge=self.g.merge, replicate=self.g.replicate, prefetch=self.g.prefetch,
                         offload=self.g.offload, checkpoint=tuple(self.combos[c][0] for c in choice),
                         reshard=tuple(self.combos[c][1] for c in choice))


def globals_for(ev: Evaluator, hardware, merges=None, prefetches=(0, 1), offloads=(False, True)) -> list[Global]:
    """The global choices: merges of 1, 2 (and 4 for long chains), HSDP replicate sizes that
    leave whole nodes per shard group, implicit or depth-1 forward prefetch, offload or not."""
    n = ev.chain.n
    # size threshold (FSDP1's min_num_params, in bytes gathered): neighbours are merged only
    # while a unit's bf16 all-gather stays within MERGE_LIMIT
    biggest = max(ev.chain.block_params) * 2
    merges = merges or [m for m in (1, 2, 4) if m == 1 or (m <= n // 2 and m * biggest <= MERGE_LIMIT)]
    dp = ev.dp_world  # with a tensor axis, the replicate x shard ranks (a node holds gpus_per_node / tensor)
    node = min(max(1, hardware.gpus_per_node // ev.tensor), dp // 2)
    reps = [r for r in (1, 2, 4, 8, 16)
            if r == 1 or (dp % r == 0 and r < dp and dp // r >= node and ev.shard_group_ok(dp // r))]
    return [Global(m, r, p, o) for m, r, p, o in itertools.product(merges, reps, prefetches, offloads)]


def reshard_options(ev: Evaluator, g: Global, hardware) -> list[bool | int]:
    shard = ev.dp_world // g.replicate
    opts: list[bool | int] = [True, False]
    node = max(1, hardware.gpus_per_node // ev.tensor)
    if g.replicate > 1 and shard > node and shard % node == 0:
        opts.append(node)
    return opts


def variant(program: Program, blocks: set[str], modules: list[str], *, replicate: int, offload: bool, mode: str,
            reshard) -> Program:
    """`program` (replicate 1, nothing offloaded or checkpointed, reshard true) with every block
    unit (names in `blocks`, block modules `modules`) changed: what compiling the uniform
    candidate gives, for the cost (tests/test_suggest.py checks the cost is the same)."""
    mesh = program.mesh if replicate == 1 else Mesh(tuple(replace(a, size=replicate) if a.role == "replicate" else a
                                                          for a in program.mesh.axes))
    ops = [Checkpoint(m, mode, None) for m in modules] if mode != "none" else []
    for op in program.ops:
        if isinstance(op, FullyShard) and op.name in blocks:
            op = replace(op, policy=replace(op.policy, reshard_after_forward=reshard, offload=Offload(enabled=offload)))
        ops.append(op)
    return Program(mesh, tuple(ops))


def build(ev: Evaluator, g: Global, ctx: CostContext, cost_fn=cost) -> Subproblem:
    """The linear model of `g` (one base replay, shared by every `g` with the same merge and prefetch)."""
    ub = unit_blocks(ev.chain, g.merge)
    nu = len(ub)
    # NOTE: with explicit forward prefetch, the memory model replays the forward pre-hooks that
    # recomputation runs in backward as prefetching again (several units gathered at once), an
    # interaction the linear model does not see: prefetch is paired with no checkpointing
    modes = CHECKPOINT_MODES if not g.prefetch else ("none",)
    options = reshard_options(ev, g, ctx.hardware)
    combos = [(m, r) for m in modes for r in options]
    w = ev.windows(g.merge, g.prefetch)
    base_program = w.program
    block_names = {base_program.units[i].name for i in w.block_unit_index}
    modules = list(ev.chain.blocks)

    def priced(mode, rs):
        return cost_fn(variant(base_program, block_names, modules, replicate=g.replicate, offload=g.offload,
                               mode=mode, reshard=rs), ctx)
    base_cost = priced("none", True)
    uniform = {("m", m): priced(m, True) - base_cost for m in modes}
    uniform.update({("r", r): priced("none", r) - base_cost for r in options})
    weights = np.array([sum(ev.chain.block_params[b] for b in blocks) for blocks in ub], dtype=float)
    weights /= weights.sum()
    time = np.array([[uniform[("m", m)] + uniform[("r", r)] for m, r in combos]] * nu) * weights[:, None]
    # ties (a step bound by communication hides recomputation) go to the simpler choice: no
    # checkpointing before selective before full, reshard true before the others, and a
    # non-default choice on later blocks before earlier ones (plans read as runs)
    simple = np.array([CHECKPOINT_MODES.index(m) * 3 + (0 if r is True else 1 if r is False else 2) for m, r in combos])
    later = (1 - np.arange(nu) / max(nu, 1))[:, None] * (simple > 0)[None, :]
    time = time + (1e-6 * simple[None, :] + 1e-7 * later) * max(base_cost, 1e-6)
    # memory: the base replay's moments, with this global choice's state (HSDP's larger shards,
    # offloaded block units) added exactly; then what each unit's choice changes
    one = ev.unit_memory(base_program, g.merge, g.prefetch, ev.world)
    mine = ev.unit_memory(base_program, g.merge, g.prefetch, ev.world // g.replicate)
    on_device = [not (g.offload and i in set(w.block_unit_index)) for i in range(len(one))]
    d_state = sum(on_device[i] * (m.sharded + m.optimizer) - (o.sharded + o.optimizer) for i, (m, o) in enumerate(zip(mine, one)))
    d_grads = np.array([on_device[i] * m.grads - o.grads for i, (m, o) in enumerate(zip(mine, one))], dtype=float)
    moment = w.totals + d_state + w.reduced @ d_grads
    unsharded = [mine[w.block_unit_index[k]].unsharded for k in range(nu)]
    prof = ev.block_profile
    d_kept = np.zeros((nu, len(combos)))
    d_local = {"forward": np.zeros((nu, len(combos))), "backward": np.zeros((nu, len(combos)))}
    for k, blocks in enumerate(ub):
        for ci, (m, r) in enumerate(combos):
            keep_act = sum(prof[b].kept[m] - prof[b].kept["none"] for b in blocks)
            keep_par = 0 if r is True else (unsharded[k] if r is False else unsharded[k] // int(r))
            d_kept[k, ci] = keep_act + keep_par
            others = sum(prof[b].kept[m] - prof[b].kept["none"] for b in blocks[:-1])
            last = prof[blocks[-1]]
            d_local["forward"][k, ci] = others + last.forward_peak[m] - last.forward_peak["none"]
            d_local["backward"][k, ci] = others + last.backward_peak[m] - last.backward_peak["none"]
    index_of = {ui: k for k, ui in enumerate(w.block_unit_index)}
    rows = []
    for (phase, unit, kept), idx in w.groups.items():
        kept_blocks = tuple(index_of[j] for j in kept if j in index_of)
        running = index_of.get(unit, -1) if phase in ("forward", "backward") else -1
        rows.append((int(moment[idx].max()), kept_blocks, running, phase))
    return Subproblem(g, combos, time, base_cost, rows, d_kept, d_local)


def _programme(sp: Subproblem, budget: float, exclude: list[list[int]] = ()):
    """The MILP's arrays for `scipy.optimize.milp` (None: a window with no choice exceeds the budget)."""
    from scipy.optimize import Bounds, LinearConstraint
    from scipy.sparse import coo_matrix
    nu, nc = sp.time.shape
    nx = nu * nc
    # prefix sums P[k] = what block units 0..k-1 keep beyond the base (continuous, exact: each
    # is fixed by the x), so a window whose kept units are a prefix costs one nonzero, not k*nc
    nvar = nx + nu + 1
    cols = np.arange(nc)
    ri, ci, vals, lo, hi = [], [], [], [], []

    def row(cols_, vals_, lo_, hi_):
        ri.append(np.full(len(cols_), len(lo)))
        ci.append(np.asarray(cols_))
        vals.append(np.asarray(vals_, dtype=float))
        lo.append(lo_)
        hi.append(hi_)
    for u in range(nu):  # one choice per unit
        row(u * nc + cols, np.ones(nc), 1, 1)
    row([nx], [1.0], 0, 0)  # P[0] = 0
    for k in range(nu):  # P[k+1] - P[k] - sum_c d_kept[k,c] x[k,c] = 0
        row(np.concatenate([[nx + k + 1, nx + k], k * nc + cols]),
            np.concatenate([[1.0, -1.0], -sp.d_kept[k]]), 0, 0)
    for base, kept, unit, phase in sp.rows:
        c_, v_ = [], []
        if kept == tuple(range(len(kept))):
            c_.append(np.array([nx + len(kept)]))
            v_.append(np.array([1.0]))
        else:
            for j in kept:
                c_.append(j * nc + cols)
                v_.append(sp.d_kept[j])
        if unit >= 0:  # duplicates are summed by the sparse matrix
            c_.append(unit * nc + cols)
            v_.append(sp.d_local[phase][unit])
        if not c_:
            if base > budget:
                return None
            continue
        row(np.concatenate(c_), np.concatenate(v_), -np.inf, budget - base)
    for ex in exclude:  # no-good cut: not this exact choice again
        row([u * nc + c for u, c in enumerate(ex)], np.ones(nu), -np.inf, nu - 1)
    a = coo_matrix((np.concatenate(vals), (np.concatenate(ri), np.concatenate(ci))), shape=(len(lo), nvar)).tocsr()
    # seconds scaled so the tie-breaks (1e-6 of the step) are far above HiGHS's absolute gap
    scale = 1e9 / max(sp.base_time, float(np.abs(sp.time).max()), 1e-12)
    integrality = np.concatenate([np.ones(nx), np.zeros(nu + 1)])
    bounds = Bounds(np.concatenate([np.zeros(nx), np.full(nu + 1, -np.inf)]),
                    np.concatenate([np.ones(nx), np.full(nu + 1, np.inf)]))
    return dict(c=np.concatenate([sp.time.reshape(-1) * scale, np.zeros(nu + 1)]), integrality=integrality,
                bounds=bounds, constraints=LinearConstraint(a, np.array(lo, float), np.array(hi, float))), scale


def solve(sp: Subproblem, budget: float, exclude: list[list[int]] = (), time_limit: float | None = None) -> list[int] | None:
    """The fastest choice per unit whose linear-model peak is at most `budget` (None: none fits).

    With `time_limit` (seconds), the best choice HiGHS has found by then (not always the
    fastest: `suggest` asks so only for alternatives that cannot be the winner)."""
    from scipy.optimize import milp
    built = _programme(sp, budget, exclude)
    if built is None:
        return None
    args, _ = built
    options = {"disp": False, "mip_rel_gap": 0.0, **({"time_limit": time_limit} if time_limit else {})}
    with _quiet_stdout():
        res = milp(**args, options=options)
    if res.x is None or res.status not in (0, 1):
        return None
    nu, nc = sp.time.shape
    x = np.round(res.x[:nu * nc]).reshape(nu, nc)
    return [int(np.argmax(x[u])) for u in range(nu)]


def lower_bound(sp: Subproblem, budget: float) -> float:
    """The linear relaxation's optimum: no choice of `sp` that fits `budget` is faster (inf: none fits)."""
    from scipy.optimize import milp
    built = _programme(sp, budget)
    if built is None:
        return float("inf")
    args, scale = built
    args["integrality"] = np.zeros_like(args["integrality"])
    with _quiet_stdout():
        res = milp(**args, options={"disp": False})
    if res.status != 0 or res.fun is None:
        return float("inf")
    return sp.base_time + float(res.fun) / scale


@contextlib.contextmanager
def _quiet_stdout():
    """HiGHS (C++) prints solver chatter to file descriptor 1 even with `disp` off: send it to /dev/null."""
    import os
    import sys
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # captured stdout (tests): nothing to redirect
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def exhaustive(sp: Subproblem, budget: float) -> tuple[float, list[int]] | None:
    """Every choice of the linear model, for small spaces: the fastest that fits (the test oracle)."""
    best = None
    for choice in itertools.product(range(len(sp.combos)), repeat=sp.n_units):
        choice = list(choice)
        if sp.peak(choice) <= budget:
            t = sp.seconds(choice)
            if best is None or t < best[0] - 1e-15:
                best = (t, choice)
    return best


def surely_infeasible(sp: Subproblem, budget: float) -> bool:
    """True when some window exceeds `budget` even with every unit at its least-keeping choice
    and the running unit at its smallest own peak (a bound: no MILP needed to say it)."""
    least = sp.d_kept.min(axis=1)
    prefix = np.concatenate([[0.0], np.cumsum(least)])
    for base, kept, unit, phase in sp.rows:
        low = base + (prefix[len(kept)] if kept == tuple(range(len(kept))) else least[list(kept)].sum())
        if unit >= 0:
            low += sp.d_local[phase][unit].min()
        if low > budget:
            return True
    return False


def min_peak_choice(sp: Subproblem) -> list[int]:
    """Per unit the choice that keeps least (the smallest peak this global choice can reach)."""
    return [int(np.argmin(sp.d_kept[u] + sp.d_local["backward"][u])) for u in range(sp.n_units)]

