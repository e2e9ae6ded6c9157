"""The compile pipeline: parse -> graph -> resolve -> validate, as one lazy `CompiledPlan`.

Each phase is a cached property (the vyper `phases.py` pattern), so `planc check` pays only
for what it asks and `planc explain` reuses the same object for the memory model.
"""

from __future__ import annotations

import os
from functools import cached_property

from torch import nn

from planc.checks.validate import Context, validate
from planc.diagnostics import Diagnostic, PlanError, sort_diagnostics
from planc.lang import syntax as st
from planc.lang.parse import load
from planc.limits import rank_count
from planc.lower.job import Job
from planc.lower.lowering import lower_job
from planc.lower.program import Program
from planc.model.graph import ModelGraph, paused_gc
from planc.resolve.ir import Resolution, Unit
from planc.resolve.mesh import Mesh
from planc.resolve.resolver import resolve


class CompiledPlan:
    """A plan resolved and validated against one model (and optionally a world size).

    Attributes:
        plan: the parsed plan (syntax tree).
        graph: the model graph, or None when compiled without a model.
        world_size: the number of ranks the plan was checked for, if known.
    """

    def __init__(self, plan: st.Plan, graph: ModelGraph | None, world_size: int | None = None, *,
                 check_memory: bool = True, routing=None):
        self.plan = plan
        self.graph = graph
        self.world_size = world_size
        self.check_memory = check_memory  # evaluate memory `expect`s (see `compile`)
        self.routing = routing  # a measured routing histogram the estimates use (planc/estimate/routing.py)
        self._estimates: dict = {}  # (world, input shape) -> Estimate, or the TraceError it raised

    # ----------------------------------------------------------------- phases
    @cached_property
    def _resolved(self) -> tuple[Resolution, list[Diagnostic]]:
        with paused_gc():
            res, diags = resolve(self.plan, self.graph)
        split_by_compute(self.plan, self.graph, res, diags)
        return res, diags

    @property
    def resolution(self) -> Resolution:
        return self._resolved[0]

    @cached_property
    def diagnostics(self) -> list[Diagnostic]:
        """Every finding of resolution and validation, errors and warnings alike."""
        res, diags = self._resolved
        # which checks run follows from what the context holds (each check declares its
        # needs, planc/checks/validate.py); memory is estimated only for a valid plan with
        # a model, and only when asked for
        routing = self._routing_problems() if not any(d.is_error for d in diags) else []
        clean = self.check_memory and self.graph is not None and not any(d.is_error for d in diags + routing)
        ctx = Context(self.plan, self.graph, res, self.world_size, metrics=self._metric if clean else None,
                      memory=self.memory_at if clean else None)
        with paused_gc():
            return sort_diagnostics(list(diags) + routing + validate(ctx))

    def _routing_problems(self) -> list[Diagnostic]:
        """P436: the routing histogram against the containers this plan dispatches (at its world size),
        before any estimate reads it; nothing when there is none, or no job to read (the checks say why)."""
        if self.routing is None or self.graph is None:
            return []
        from planc.estimate.expert_local import expert_degree
        from planc.estimate.routing import routing_problems
        try:
            program = self.program
        except Exception:  # a plan the checks refuse may not lower (or is a pipeline's): they report it
            return []
        return routing_problems(self.routing, program, expert_degree(program, self.world_size or 1))

    def _metric(self, name: str, world: int | None, input_shape: tuple[int, ...] | None = None) -> float | None:
        from planc.estimate.memory import metric  # the memory model is only built when a plan asks
        return metric(self, name, world, input_shape)

    def memory_at(self, world: int | None = None, input_shape: tuple[int, ...] | None = None):
        """The memory estimate at `world` ranks (default: this plan's world size), activations
        traced for a (batch, seq) `input_shape` as `planc explain --input-shape` traces them,
        or left out without one. Cached per (world, input shape), so several `expect` lines
        trace the model once. Raises `planc.estimate.trace.TraceError` when the model cannot run on
        that input.
        """
        from planc.estimate.memory import estimate
        from planc.estimate.trace import TraceError
        world = world or self.world_size or 1
        key = (world, None if input_shape is None else tuple(input_shape))
        if key not in self._estimates:
            # lowered at `world`: what the job places depends on it (the experts' FSDP dim, 0 or 1, on
            # efsdp x expert against the experts count), and a plan checked without a world size
            # (an `expect ... at world = N` line) was lowered without one
            at = self if world == self.world_size else CompiledPlan(self.plan, self.graph, world, check_memory=False,
                                                                    routing=self.routing)
            try:
                self._estimates[key] = estimate(at, world, input_shape=key[1])
            except TraceError as err:  # remembered too: each expect with this input reports it
                self._estimates[key] = err
        found = self._estimates[key]
        if isinstance(found, TraceError):
            raise found
        return found

    @cached_property
    def job(self) -> Job:
        """The lowered job every backend interprets (`planc/lower/job.py`): views, parts,
        schedule, step ops.

        Only a plan without errors lowers to a meaningful job: callers check `ok` (or
        `raise_for_errors()`) first, as `planc.apply` and `planc emit` do.

        Raises:
            ValueError: the plan was compiled without a model.
        """
        if self.graph is None:
            raise ValueError("a plan is lowered against a model: compile it with one")
        return lower_job(self.resolution, self.graph, self.world_size)

    @property
    def program(self) -> Program:
        """The program of a job with one part (the whole model): `job.program`.

        Raises:
            ValueError: the plan was compiled without a model, or its job has several parts
                (pipeline stages: interpret `job.parts`).
        """
        return self.job.program

    # ----------------------------------------------------------------- results
    @property
    def units(self) -> list[Unit]:
        """Units in application order: bottom-up, the root last."""
        return self.resolution.units

    @property
    def mesh(self) -> Mesh:
        return self.resolution.mesh

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.is_error]

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def sources(self) -> dict[str, str]:
        return dict(self.plan.sources)

    def raise_for_errors(self) -> "CompiledPlan":
        """Raise `PlanError` with every diagnostic if any is an error; else return self."""
        if self.errors:
            raise PlanError(list(self.diagnostics), self.sources)
        return self

    def unit(self, name: str) -> Unit:
        return self.resolution.unit(name)

    def __repr__(self) -> str:
        return f"<CompiledPlan {self.plan.file}: {len(self.units)} units, {len(self.errors)} errors>"


def split_by_compute(plan: st.Plan, graph: ModelGraph | None, res: Resolution, diags: list[Diagnostic]) -> None:
    """`pipeline ... { split = compute }`: cut the model again, each block weighing its forward and
    backward FLOPs in the step profile (`planc/estimate/flops.py`) on the plan's first `expect`
    input, else one sequence of 512 tokens; the resolver (below the estimators) cut it by
    parameters. P477 when the model does not run on that input."""
    pp = res.pipeline
    if pp is None or pp.split != "compute" or not pp.stages or graph is None or graph.model is None:
        return
    import dataclasses

    from planc.estimate.flops import step_profile
    from planc.estimate.trace import TraceError
    from planc.resolve.split import auto_split, block_list, split_items

    shape = next((s.input_shape for s in plan.statements
                  if isinstance(s, st.ExpectMetric) and s.input_shape and len(s.input_shape) == 2), (1, 512))
    try:
        prof = step_profile(graph, input_shape=tuple(shape), repeat=True)
    except TraceError as err:
        diags.append(Diagnostic(code="P477", severity="error", span=pp.option_span("split"),
                                message=f"`split = compute` cannot weigh the blocks: {err}", label="no FLOPs",
                                help=("give an `expect ... at input = BxS` the model runs on, or `split = parameters`",)))
        return
    blocks = split_items(graph, block_list(graph))[1]
    weights = {b: prof.subtree(prof.forward, b) + prof.subtree(prof.backward, b) for b in blocks}
    if sum(weights.values()) > 0:
        res.pipeline = dataclasses.replace(pp, stages=tuple(auto_split(graph, len(pp.stages), weights)))


def as_plan(plan: st.Plan | str | os.PathLike) -> st.Plan:
    """A parsed plan from a `Plan` or a path (raises `PlanError` on syntax errors)."""
    if isinstance(plan, st.Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return load(plan)
    raise TypeError(f"expected a Plan or a path, got {type(plan).__name__}")


def compile(plan: st.Plan | str | os.PathLike, model: nn.Module | ModelGraph | None,
            world_size: int | None = None, *, strict: bool = True, check_memory: bool = True,
            routing=None) -> CompiledPlan:
    """Resolve and validate `plan` against `model`.

    Args:
        plan: a parsed `Plan` (from `planc.load`/`planc.loads`) or a path to a .plan file.
        model: the model (any device, meta included), its `ModelGraph`, or None to run only
            the checks that need no model.
        world_size: number of ranks; enables mesh, reshard and placement size checks.
            `TypeError` if not an int, `ValueError` if below 1 or above `planc.limits.MAX_RANKS`.
        strict: raise `PlanError` (carrying every diagnostic) if there is any error.
        check_memory: evaluate memory `expect`s with the memory model (an `input =` clause
            traces one step on fake tensors). `planc.apply` turns this off: the bounds are
            for `planc check` in CI, and the job being sharded measures the real thing.
        routing: a measured routing histogram (`planc.estimate.routing.load_routing(path)`) the memory
            and time estimates of an expert-parallel plan use instead of balanced routing; one that
            does not fit the plan is a P436 diagnostic.

    Returns:
        The `CompiledPlan`, with `.units` in application order and `.diagnostics`.
    """
    if world_size is not None:
        rank_count(world_size)
    parsed = as_plan(plan)
    graph = model if isinstance(model, ModelGraph) or model is None else ModelGraph.from_module(model)
    compiled = CompiledPlan(parsed, graph, world_size, check_memory=check_memory, routing=routing)
    if strict:
        compiled.raise_for_errors()
    return compiled
