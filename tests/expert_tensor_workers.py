"""Worker bodies of tests/test_expert_tensor_dist.py (module level, so spawned ranks can import them)."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import tp_rules
from expert_workers import CLIP, _batches, _full, _reference, apply_plan, differences

# Attention tensor-parallel with sequence-parallel norms (plans/zoo-llama-tp.plan's rules), the
# experts expert-parallel: expert 2 borrows the tensor ranks (efsdp = shard x tensor / expert).
SP_PLAN = ("model planc.zoo:moe_llama_tiny\nmesh (shard = *, tensor = 2, expert = 2)\nunit layers.*\n" + tp_rules.ATTENTION
           + tp_rules.head() + "parallel layers.*.moe.experts expert\n")

# The same without sequence parallelism: the residual stream replicated over the tensor group,
# so the MoE layer cuts its tokens itself and all-gathers the outputs.
REPLICATED_PLAN = """model planc.zoo:moe_llama_tiny
mesh (shard = *, tensor = 2, expert = 2)
unit layers.*
parallel tok_embeddings replicate
parallel layers.*.{attention_norm,ffn_norm} replicate
parallel layers.*.attention.{wq,wk,wv} colwise
parallel layers.*.attention.wo rowwise
parallel norm replicate
parallel output colwise { output replicate }
parallel layers.*.moe.experts expert
"""


def _tiny():
    from planc.zoo import moe_llama_tiny

    return moe_llama_tiny()


def train_equal(rank: int, world: int, plan: str, steps: int = 3, lr: float = 1e-2, emitted: bool = False,
                twice: bool = False, meta: bool = False) -> dict:
    """The plan's AdamW steps (clipped) vs one process: max abs differences of the losses, the
    first step's gradients and the final parameters; the rows layers.0's experts were sent per step.
    `meta`: built on meta, applied, `planc.materialize(reproducible=True)`.
    `twice`: the fact behind the split: each MoE layer's forward put back as written (every rank of a
    tensor group dispatches the same replicated tokens), which torch runs."""
    import planc
    from planc.backends import experts
    from planc.backends.emit import emit_python
    from planc.backends.runtime import build_mesh

    torch.manual_seed(0)
    model = _tiny()
    ref = copy.deepcopy(model)
    batches = _batches(steps, world, seq=8)
    ref_losses, ref_grads, ref_params = _reference(ref, batches, lr)
    if emitted:
        compiled = planc.compile(planc.loads(plan), model, world)
        namespace: dict = {}
        exec(compile(emit_python(compiled), "<emitted>", "exec"), namespace)
        mesh = build_mesh(compiled.mesh)
        namespace["apply_plan"](model, mesh)
        ep_mesh = experts.expert_mesh_of(mesh, 2, ("efsdp", "expert"))["expert"]
        from torch.distributed.tensor.parallel import loss_parallel
        context = loss_parallel if "loss_parallel" in plan else contextlib.nullcontext
        dp = mesh["shard"]
        r, n = dp.get_local_rank(), dp.size()
        clip = lambda: experts.clip_grad_norm_(model.parameters(), CLIP, ep_mesh)  # noqa: E731
    else:
        model, applied, ep_mesh = apply_plan(model, plan, meta, _tiny)
        r, n = applied.data_parallel_rank()
        context = applied.loss_parallel
        clip = lambda: applied.clip_grad_norm_(CLIP)  # noqa: E731
    if twice:
        for layer in model.layers:
            del layer.moe.forward  # planc's split_over_tensor wrapper (an instance attribute)
    counts = []
    model.layers[0].moe.experts.register_forward_pre_hook(lambda m, args: counts.append(int(args[0].shape[0])))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
    loss_diff, grad_diff = [], {}
    for step, tokens in enumerate(batches):
        opt.zero_grad()
        mine = tokens.chunk(n)[r]
        with context():
            logits = model(mine[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), mine[:, 1:].reshape(-1))
            loss.backward()
        total = _full(loss.detach()).clone()
        dist.all_reduce(total)
        loss_diff.append(abs(total.item() / world - ref_losses[step]))
        if step == 0:
            grad_diff = differences(model, ref_grads, ep_mesh, grad=True)
        clip()
        opt.step()
    param_diff = differences(model, ref_params, ep_mesh)
    return {"loss": max(loss_diff), "grad": max(grad_diff.values()), "param": max(param_diff.values()),
            "grads": len(grad_diff), "rows": counts, "worst": max(param_diff, key=param_diff.get)}


DENSE_PLAN = """model planc.zoo:moe_llama_tiny
unit layers.*
"""


def dcp_round_trip(rank: int, world: int, folder: str) -> dict:
    """Save under expert x tensor (SP_PLAN), load into plain 1-D FSDP (other initial values), save
    that, load into expert x tensor again: max abs difference to the saved values at each end."""
    from expert_workers import round_trip

    import planc

    def model_with(plan: str, seed: int):
        torch.manual_seed(seed)
        model = _tiny()
        return model, planc.apply(model, planc.loads(plan))

    return round_trip(_tiny, model_with, SP_PLAN, DENSE_PLAN, folder)


def train_all(rank: int, world: int, folder: str) -> list[dict]:
    """Sequence parallel through `planc.apply` and through the emitted code; the replicated residual;
    the replicated tokens dispatched twice (one step); the DCP round trip."""
    return [train_equal(rank, world, SP_PLAN), train_equal(rank, world, SP_PLAN, emitted=True),
            train_equal(rank, world, REPLICATED_PLAN), train_equal(rank, world, REPLICATED_PLAN, steps=1, twice=True),
            dcp_round_trip(rank, world, folder)]


def measure(rank: int, world: int, text: str) -> dict:
    """The tiny plan applied to `moe_llama_tiny` (balanced routing), two AdamW steps under
    FSDPMemTracker (the second measured), FSDP's reduce-scatter as all-reduce + slice; each tensor
    group's ranks get the same tokens (their data-parallel rank's); the lower peak of two
    (`distributed.lowest_peak`: gloo can release a buffer late)."""
    from distributed import lowest_peak
    from expert_memory_workers import SHAPE, balanced_route

    import planc
    from planc.analysis.simulate import measure_real
    from planc.zoo import routed

    routed.Router.forward = balanced_route

    def once() -> dict:
        torch.manual_seed(0)
        model = _tiny()
        applied = planc.apply(model, planc.loads(text))
        r, _ = applied.data_parallel_rank()
        tokens = torch.randint(0, 128, SHAPE, generator=torch.Generator().manual_seed(1 + r))
        m = measure_real(model, (tokens,), nccl_like_reduce_scatter=True, clip=None, loss_context=applied.loss_parallel)
        return {"peak": m.peak, "breakdown": m.breakdown, "moment": m.moment, "timeline": m.timeline}

    return lowest_peak(once)


def record(rank: int, world: int, text: str) -> list[tuple]:
    """The collectives of one forward and backward of the tiny plan (balanced routing) on this real
    gloo rank, as `planc/analysis/comms.py` records them: (kind, unit or "tensor", bytes, ranks, phase)."""
    from expert_memory_workers import SHAPE, balanced_route

    import planc
    from planc.analysis.comms import _attributed, _Recorder
    from planc.zoo import routed

    routed.Router.forward = balanced_route
    torch.manual_seed(0)
    model = _tiny()
    applied = planc.apply(model, planc.loads(text))
    names = {tuple(id(model.get_submodule(p)) if p else id(model) for p in op.modules): op.name
             for op in applied.compiled.program.units}
    r, _ = applied.data_parallel_rank()
    tokens = torch.randint(0, 128, SHAPE, generator=torch.Generator().manual_seed(1 + r))
    recorder = _Recorder()
    with _attributed(recorder, names), recorder, applied.loss_parallel():
        out = model(tokens)
        recorder.phase = "backward"
        out.float().sum().backward()
    return [(r.kind, r.unit, r.bytes, r.ranks, r.phase) for r in recorder.found]


def train_meta(rank: int, world: int) -> dict:
    """SP_PLAN on a model built on meta, materialised with `reproducible=True`, against one process."""
    return train_equal(rank, world, SP_PLAN, meta=True)
