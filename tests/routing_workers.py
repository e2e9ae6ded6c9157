"""Rank bodies for tests/test_routing_dist.py (module level, for spawn): the zoo's routed MoE tiny with
its own (unbalanced) router under `plans/routed-moe-ep.plan`, its routing recorded on the same step."""

from __future__ import annotations

import torch
from distributed import lowest_peak
from expert_memory_workers import PLAN, SHAPE


def _applied():
    import planc
    from planc import zoo

    torch.manual_seed(0)
    model = zoo.routed_moe_tiny()
    applied = planc.apply(model, planc.loads(PLAN.read_text()))
    return model, applied


def _tokens(rank: int) -> torch.Tensor:
    return torch.randint(0, 128, SHAPE, generator=torch.Generator().manual_seed(1 + rank))


def measure(rank: int, world: int, path: str) -> dict:
    """Two AdamW steps under FSDPMemTracker (the second measured, FSDP's reduce-scatter as all-reduce +
    slice: tests/test_memory_dist.py; the lower peak of two: `distributed.lowest_peak`) with the
    routing of the measured step recorded (saved to `path`);
    then, on a fresh copy, the collectives of one forward and backward (`planc/analysis/comms.py`'s
    recorder) and that step's routing."""
    from planc.analysis.comms import _attributed, _Recorder
    from planc.analysis.routing import record_routing
    from planc.analysis.simulate import measure_real

    def once() -> dict:
        model, _ = _applied()
        with record_routing(model) as recorded:
            m = measure_real(model, (_tokens(rank),), nccl_like_reduce_scatter=True, clip=None)
        return {"peak": m.peak, "breakdown": m.breakdown, "moment": m.moment, "timeline": m.timeline,
                "recorded": recorded}

    best = lowest_peak(once)  # the same seeds: the same routing in every repeat
    routing = best.pop("recorded").save(path)
    for run in best["repeats"]:
        del run["recorded"]

    model, applied = _applied()
    names = {tuple(id(model.get_submodule(p)) if p else id(model) for p in op.modules): op.name
             for op in applied.compiled.program.units}
    recorder = _Recorder()
    with record_routing(model) as again, _attributed(recorder, names), recorder:
        out = model(_tokens(rank))
        recorder.phase = "backward"
        out.float().sum().backward()
    return {**best, "routing": routing.to_json(), "collectives": [(r.kind, r.unit, r.bytes, r.ranks, r.phase)
                                                          for r in recorder.found],
            "step_routing": again.routing().to_json()}


def dense(rank: int, world: int) -> str:
    """The same model and tokens in one process without expert parallelism: the router's top-k counts."""
    from planc import zoo
    from planc.analysis.routing import record_routing

    torch.manual_seed(0)
    model = zoo.routed_moe_tiny()
    with record_routing(model) as recorded:
        model(_tokens(rank)).float().sum().backward()
    return recorded.routing().to_json()
