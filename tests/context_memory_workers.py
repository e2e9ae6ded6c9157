"""Rank bodies for tests/test_context_memory_dist.py and benchmarks/context_memory.py (module level, for spawn)."""

from __future__ import annotations

import torch
from distributed import lowest_peak

# name -> plan text; "... without context" is the same plan with the context axis removed
PLANS = {
    "context": "mesh (shard = *, context = 2)\nunit layers.*\nparallel layers.*.attention context\n",
    "shard x context": "mesh (shard = 2, context = 2)\nunit layers.*\nparallel layers.*.attention context\n",
    "without context": "mesh (shard = *)\nunit layers.*\n",
    "context + checkpoint": ("mesh (shard = *, context = 2)\nunit layers.*\ncheckpoint layers.*\n"
                             "parallel layers.*.attention context\n"),
}
SHAPE = (2, 64)  # (batch, seq) of each rank's data-parallel batch; the context axis cuts the 64


def measure(rank: int, world: int, names: tuple[str, ...], shape=SHAPE) -> dict:
    """Each plan applied to zoo Llama tiny (fp32) through `planc.apply`, one batch cut by
    `applied.shard_batch`, two AdamW steps under FSDPMemTracker (the second measured), with
    FSDP's reduce-scatter as all-reduce + slice (what NCCL allocates; see test_memory_dist.py). The
    lowest peak of two measurements is kept (`distributed.lowest_peak`: gloo can delay a free)."""
    import planc
    from planc.analysis.simulate import measure_real
    from planc.estimate.trace import Example
    from planc.zoo import llama3

    def once(name: str) -> dict:
        torch.manual_seed(0)
        model = llama3.llama_tiny()
        applied = planc.apply(model, planc.loads(PLANS[name]))
        tokens = torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(1))
        batch = applied.shard_batch(tokens)
        kwargs = {} if batch.positions is None else {"positions": batch.positions}
        m = measure_real(model, Example((batch.tokens,), kwargs), nccl_like_reduce_scatter=True)
        return {"peak": m.peak, "breakdown": m.breakdown, "moment": m.moment}

    return {name: lowest_peak(lambda: once(name)) for name in names}
