"""Rank bodies for tests/test_pipeline_expert_dist.py: expert parallelism inside pipeline stages.

The routed MoE tiny (4 experts, top-2) under pipeline 2 x (shard 2, expert 2 borrowing it), through
`planc.apply`: trained by tests/pipeline_workers.py's `train` (3 AdamW steps against one process),
checkpointed by tests/expert_workers.py's `round_trip` (a DCP checkpoint of the stages loads under a
1-D plan and back), built on meta and materialized per stage (then one step), and run as the code `planc emit` prints.
"""

from __future__ import annotations

import expert_workers
import pipeline_workers
import torch

import planc
from planc.zoo import routed_moe_tiny

PLAN = expert_workers.PLAN  # mesh (shard = *, expert = 2); the pipeline axis added outermost
ONE_STAGE = [("tok_embeddings", "layers.0"), ("layers.1", "norm", "output")]  # each stage holds a MoE layer
# two stages per rank: stages 0 and 3 hold no experts (rank 0: stages 0, 2; rank 1: stages 1, 3)
TWO_STAGES = [("tok_embeddings",), ("layers.0",), ("layers.1",), ("norm", "output")]
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")


def _cut(name: str):
    return TWO_STAGES if name == "Interleaved1F1B" else ONE_STAGE


def _compiled(model, world: int, name: str = "1F1B"):
    return pipeline_workers.pipeline_compiled(PLAN, model, world, name, 2, pipeline_workers.MICROBATCHES, _cut(name))


def _pipelined_with(plan: str, seed: int):
    """`round_trip`'s model under `plan`: the pipeline (1F1B) for the expert plan, else the plain plan."""
    import torch.distributed as dist

    torch.manual_seed(seed)
    model = routed_moe_tiny()
    if plan != PLAN:
        return model, planc.apply(model, planc.loads(plan))
    applied = planc.apply(model, _compiled(model, dist.get_world_size()))
    return applied, applied  # its state_dict and named_parameters: this rank's stages


def _materialized(world: int) -> dict:
    """Built on meta, applied, `planc.materialize` per stage (`reproducible=True` refuses a pipeline:
    a rank does not see the whole model's order): this rank's stages' parameters allocated and
    finite, each expert rank holding its 2 of 4 experts, the other stages' left on meta; one step
    of 1F1B runs on them."""
    from planc.backends.experts import EXPERT_SLICE

    with torch.device("meta"):
        model = routed_moe_tiny()
    applied = planc.apply(model, _compiled(model, world))
    planc.materialize(applied, "cpu")
    mine = dict(applied.named_parameters())
    tokens, labels = pipeline_workers.batches(1)[0]
    loss = applied.step(tokens, labels, pipeline_workers.loss_fn)
    return {"names": sorted(mine), "meta": [n for n, p in mine.items() if p.is_meta],
            "finite": all(torch.isfinite(pipeline_workers._full(p)).all().item() for p in mine.values()),
            "others_meta": all(p.is_meta for n, p in model.named_parameters() if n not in mine),
            "experts": sorted({getattr(m, EXPERT_SLICE) for m in model.modules() if hasattr(m, EXPERT_SLICE)}),
            "loss": None if loss is None else loss.item()}


def launch(rank: int, world: int, folder: str) -> dict:
    out = {name: pipeline_workers.train(rank, world, PLAN, name, 2, build=routed_moe_tiny, cut=_cut(name))
           for name in SCHEDULES}
    out["dcp"] = expert_workers.round_trip(routed_moe_tiny, _pipelined_with, PLAN, expert_workers.DENSE_PLAN, folder)
    out["materialized"] = _materialized(world)
    # the code `planc emit` prints (1F1B), every data-parallel rank on the same batch: one process on it
    out["emitted"] = pipeline_workers.emitted(rank, world, "1F1B", 2, PLAN, routed_moe_tiny, ONE_STAGE)["losses"]
    out["emitted_oracle"] = [step[0] for step in pipeline_workers.reference(1, pipeline_workers.MICROBATCHES,
                                                                            routed_moe_tiny)[0]]
    return out
