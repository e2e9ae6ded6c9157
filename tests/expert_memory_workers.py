"""Rank bodies for tests/test_expert_memory_dist.py (module level, for spawn)."""

from __future__ import annotations

import pathlib

import torch
from distributed import lowest_peak

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLAN = ROOT / "plans" / "routed-moe-ep.plan"
SHAPE = (2, 16)  # (batch, seq) of each rank's batch


def balanced_route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`Router.forward` with balanced routing: token t's j-th expert is (t x top_k + j) mod experts
    (every expert gets tokens x top_k / experts rows from every rank), its weights the router's
    softmax at those experts, renormalised (so the gate still learns)."""
    probs = self.gate(tokens).softmax(dim=-1)
    count, experts = tokens.shape[0], probs.shape[-1]
    ids = torch.arange(count * self.top_k, device=tokens.device).view(count, self.top_k) % experts
    weights = probs.gather(1, ids)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def measure(rank: int, world: int, texts: dict[str, str], clip: float | None = None) -> dict:
    """Each plan applied to the zoo's routed MoE tiny (balanced routing) through `planc.apply`, two
    AdamW steps under FSDPMemTracker (the second measured), FSDP's reduce-scatter as all-reduce +
    slice (what NCCL allocates; see test_memory_dist.py). The lowest peak of two measurements is
    kept (`distributed.lowest_peak`: gloo can delay a free)."""
    return {name: lowest_peak(lambda: _measure_once(rank, name, text, clip)) for name, text in texts.items()}


def _measure_once(rank: int, name: str, text: str, clip: float | None) -> dict:
    import planc
    from planc import zoo
    from planc.analysis.simulate import measure_real
    from planc.zoo import routed

    routed.Router.forward = balanced_route
    torch.manual_seed(0)
    model = zoo.routed_moe_tiny()
    planc.apply(model, planc.loads(text, filename=name))
    tokens = torch.randint(0, 128, SHAPE, generator=torch.Generator().manual_seed(1 + rank))
    m = measure_real(model, (tokens,), nccl_like_reduce_scatter=True, clip=clip)
    return {"peak": m.peak, "breakdown": m.breakdown, "moment": m.moment, "timeline": m.timeline}


def record(rank: int, world: int) -> list[tuple]:
    """The collectives of one forward and backward of `PLAN` (balanced routing) on this real gloo
    rank, as `planc/analysis/comms.py` records them: (kind, unit or "tensor", bytes, ranks, phase).
    A real process group, not the fake one: the dispatch reads its split sizes from the counts'
    all-to-all, which a fake group does not fill."""
    import planc
    from planc import zoo
    from planc.analysis.comms import _attributed, _Recorder
    from planc.zoo import routed

    routed.Router.forward = balanced_route
    torch.manual_seed(0)
    model = zoo.routed_moe_tiny()
    applied = planc.apply(model, planc.loads(PLAN.read_text()))
    names = {tuple(id(model.get_submodule(p)) if p else id(model) for p in op.modules): op.name
             for op in applied.compiled.program.units}
    tokens = torch.randint(0, 128, SHAPE, generator=torch.Generator().manual_seed(1 + rank))
    recorder = _Recorder()
    with _attributed(recorder, names), recorder:
        out = model(tokens)
        recorder.phase = "backward"
        out.float().sum().backward()
    return [(r.kind, r.unit, r.bytes, r.ranks, r.phase) for r in recorder.found]
