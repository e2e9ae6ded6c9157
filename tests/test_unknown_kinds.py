"""Every interpreter of the job refuses an op, action or step-op kind it has no rule for.

A real plan is compiled against a real model; then a kind no interpreter knows is injected
into its job (an op in the one part's program, an action in the schedule, a step op) and
every interpreter is run on it: the runtime (`planc.apply`, on a fake process group), emit,
the trace (fake-tensor and synthetic), the memory and step-time estimates, the tensor-local
emulation, the repeated-block finder, explain, the collective recorder and the shape check.
Each must raise `UnknownKind` naming the kind, rather than leave it out of what it runs,
prints or estimates. The same interpreters on the job as lowered run (the control).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import planc
from planc.analysis import comms, explain, shapecheck
from planc.analysis.simulate import init_fake, zoo_inputs
from planc.backends import emit, runtime
from planc.estimate import memory, repeat, tensor_local, time, trace
from planc.lower.job import Action, UnknownKind
from planc.zoo import llama_tiny

PLAN = "plans/zoo-llama-tp.plan"  # FSDP, tensor styles, loss_parallel: every step op kind there is
WORLD = 4


@dataclasses.dataclass(frozen=True)
class NewOp:
    """An op kind the lowering might add one day (e.g. a new parallelism's module transform)."""

    module: str


@dataclasses.dataclass(frozen=True)
class NewStepOp:
    """A step op kind no interpreter has a rule for (as context parallelism's `ShardBatch` is for the estimators)."""

    module: str


def _with_op(job):
    part = job.parts[0]
    program = dataclasses.replace(part.program, ops=part.program.ops + (NewOp("layers.0"),))
    return dataclasses.replace(job, parts=(dataclasses.replace(part, program=program),))


def _with_action(job):
    schedule = job.schedule
    actions = (schedule.actions[0] + (Action(0, "NEW_ACTION", 0),),) + schedule.actions[1:]
    return dataclasses.replace(job, schedule=dataclasses.replace(schedule, actions=actions))


def _with_step_op(job):
    return dataclasses.replace(job, step_ops=job.step_ops + (NewStepOp("output"),))


INJECT = {"op": (_with_op, "NewOp"), "action": (_with_action, "0NEW_ACTION0"), "step op": (_with_step_op, "NewStepOp")}


def _compiled(model=None):
    return planc.compile(PLAN, model if model is not None else llama_tiny(), WORLD)


def _interpreters(compiled, build=llama_tiny):
    """Each interpreter, as a call on `compiled` (its job possibly injected; the recorder builds its
    model with `build`)."""
    shape = (2, 16)

    def apply():
        init_fake(WORLD)
        try:
            mesh = runtime.build_mesh(compiled.mesh, WORLD, "cpu")
            return planc.apply(compiled.graph.model, compiled, mesh=mesh)
        finally:
            dist.destroy_process_group()

    def tensor_local_emulation():
        return tensor_local.emulate_layouts(compiled.graph.model, compiled.job.program, compiled.graph, 2)

    def shape_check():
        return shapecheck._Step(compiled, compiled.graph.model, WORLD, 2)

    def recorder():
        try:
            return comms.record_collectives(compiled, build, WORLD, inputs=zoo_inputs(shape))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    est = memory.estimate(_compiled(), WORLD)  # an estimate of the uninjected job, for explain
    return {
        "runtime": apply,
        "emit": lambda: emit.emit_python(compiled),
        "fake trace": lambda: trace.fake_trace(compiled, trace.default_input(compiled.graph.model, shape), tp=2),
        "cached trace": lambda: trace.trace_for(compiled, trace.default_input(compiled.graph.model, shape), tp=2),
        "synthetic trace": lambda: trace.synthetic_trace(compiled),
        "memory": lambda: memory.estimate(compiled, WORLD, input_shape=shape),
        "time": lambda: time.estimate_step_time(compiled, world=WORLD, input_shape=shape),
        "time of a program": lambda: time.estimate_step_time(compiled.job.parts[0].program, world=WORLD,
                                                             graph=compiled.graph),
        "tensor_local": tensor_local_emulation,
        "repeat": lambda: repeat.find_runs(compiled),
        "explain": lambda: explain.report(compiled, est),
        "comms": recorder,
        "shape check": shape_check,
    }


NAMES = (
    "runtime", "emit", "fake trace", "cached trace", "synthetic trace", "memory", "time", "time of a program",
    "tensor_local", "repeat", "explain", "comms", "shape check")
# the interpreters that take a program, not a job: they see ops only
PROGRAM_ONLY = {"tensor_local", "time of a program"}


@pytest.mark.parametrize("name", NAMES)
def test_every_interpreter_runs_the_job_as_lowered(name):
    with torch.device("meta"):
        model = llama_tiny()
    compiled = _compiled(model)
    _interpreters(compiled)[name]()  # the control: no kind is unknown, nothing is refused


@pytest.mark.parametrize("kind", tuple(INJECT))
@pytest.mark.parametrize("name", NAMES)
def test_every_interpreter_refuses_an_unknown_kind(name, kind):
    if name in PROGRAM_ONLY and kind != "op":
        pytest.skip("takes a program: actions and step ops are the job's")
    with torch.device("meta"):
        model = llama_tiny()
    compiled = _compiled(model)
    inject, shown = INJECT[kind]
    compiled.__dict__["job"] = inject(compiled.job)  # `job` is a cached property: replace what it holds
    with pytest.raises(UnknownKind, match=shown):
        _interpreters(compiled)[name]()
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()), \
        "a refused job must leave the model as it was"


CONTEXT_PLAN = ("model planc.zoo:llama_tiny\nmesh (shard = *, context = 2)\nunit layers.*\n"
                "parallel layers.*.attention context\n")
# The interpreters with rules for context parallelism's kinds (`AttendOverContext`, `ShardBatch`);
# every other one refuses them.
CONTEXT_READERS = {"runtime", "emit", "fake trace", "cached trace", "synthetic trace", "memory", "repeat", "explain",
                   "tensor_local", "time", "time of a program", "comms", "shape check"}


@pytest.mark.parametrize("name", NAMES)
def test_context_kinds_are_run_by_runtime_and_emit_and_refused_by_the_estimators(name):
    with torch.device("meta"):
        model = llama_tiny()
    compiled = planc.compile(planc.loads(CONTEXT_PLAN), model, WORLD)
    run = _interpreters(compiled)[name]
    if name in CONTEXT_READERS:
        run()
        return
    with pytest.raises(UnknownKind, match="AttendOverContext|ShardBatch"):
        run()


EXPERT_READERS = {"runtime", "emit", "fake trace", "cached trace", "synthetic trace", "memory", "time", "shape check", "comms",
                  "repeat", "time of a program", "explain", "tensor_local"}  # tensor_local: expert x tensor (expert_local splits)
EXPERT_PLAN = ("model planc.zoo:routed_moe_tiny\nmesh (shard = *, expert = 2)\nunit layers.*\n"
               "parallel layers.*.moe.experts expert\n")


@pytest.mark.parametrize("name", NAMES)
def test_expert_kind_is_run_by_runtime_and_emit_and_refused_by_the_estimators(name):
    """`DispatchExperts` (expert parallelism): the runtime, emit, the trace, the memory estimate (one
    expert rank's step: planc/estimate/expert_local.py), the repeated-block trace, the step time (its all-to-alls) and
    the tensor-local emulation (expert x tensor: it leaves the MoE layer's tokens to expert_local) run it; every other
    one refuses it; the shape check (`--simulate`) and the collective recorder run it with balanced routing."""
    from planc.zoo import routed_moe_tiny

    with torch.device("meta"):
        model = routed_moe_tiny()
    compiled = planc.compile(planc.loads(EXPERT_PLAN), model, WORLD)
    run = _interpreters(compiled, routed_moe_tiny)[name]
    if name in EXPERT_READERS:
        run()
        return
    with pytest.raises(UnknownKind, match="DispatchExperts"):
        run()
