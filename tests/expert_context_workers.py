"""Worker bodies of tests/test_expert_context_dist.py (module level, so spawned ranks can import them)."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tp_rules
from expert_workers import CLIP, _batches, _full, _reference, apply_plan, differences, round_trip, whole

# Attention over the context axis (head-tail), the experts expert-parallel borrowing the context
# ranks (efsdp = shard x context / expert), FSDP over shard x context flattened.
PLAN = """model planc.zoo:moe_llama_tiny
mesh (shard = *, context = 2, expert = 2)
unit layers.*
parallel layers.*.attention context
parallel layers.*.moe.experts expert
"""
SEQ = 16  # cuts into 2 x context = 4 chunks

# The same with attention tensor-parallel and sequence-parallel norms (plans/qwen3-moe-ep-tp.plan's
# rules) on a tensor axis: the MoE layer runs on its tensor rank's part of its context shard.
TENSOR_PLAN = PLAN.replace("context = 2,", "context = 2, tensor = 2,") + tp_rules.ATTENTION + tp_rules.head()


def _tiny():
    from planc.zoo import moe_llama_tiny

    return moe_llama_tiny()


def _emitted(model, plan: str):
    """`model` sharded by the code `planc emit` prints: (shard_batch, (dp rank, dp size), unshard, expert axis, clip)."""
    import planc
    from planc.backends import context, experts
    from planc.backends.emit import emit_python
    from planc.backends.runtime import build_mesh

    compiled = planc.compile(planc.loads(plan), model, dist.get_world_size())
    scope: dict = {}
    exec(compile(emit_python(compiled), "<emitted>", "exec"), scope)
    mesh = build_mesh(compiled.mesh)
    scope["apply_plan"](model, mesh)
    ep = compiled.mesh.sizes(dist.get_world_size())["expert"]
    ep_mesh = experts.expert_mesh_of(mesh, ep, ("efsdp", "expert"))["expert"]
    return (lambda tokens, labels: context.Batch(*scope["shard_batch"](tokens, labels, mesh)),
            (mesh["shard"].get_local_rank(), mesh["shard"].size()),
            lambda t: context.unshard(t, 1, mesh["context"].get_group()), ep_mesh,
            lambda: experts.clip_grad_norm_(model.parameters(), CLIP, ep_mesh))


def _applied(model, plan: str, meta: bool):
    model, applied, ep_mesh = apply_plan(model, plan, meta, _tiny)
    return model, (applied.shard_batch, applied.data_parallel_rank(), applied.unshard_sequence, ep_mesh,
                   lambda: applied.clip_grad_norm_(CLIP)), applied.loss_parallel


def train_equal(rank: int, world: int, plan: str, steps: int = 3, lr: float = 1e-2, via: str = "apply",
                unscaled: bool = False) -> dict:
    """The plan's clipped AdamW steps, each rank's plain mean loss over its sequence shard, vs one
    process on the whole batch: max abs differences of the losses, the first step's gradients (and
    the ratio of the experts' gradient norms), the final parameters and the last batch's logits
    (unsharded); the rows per global expert reaching layers.0's experts. `via`: `planc.apply`
    ("apply"), the code `planc emit` prints ("emit"), a meta model applied and materialised
    ("meta"). `unscaled`: the experts' gradient scaling (`ScaleGrad`) off: what torch runs as written."""
    from planc.backends import experts

    torch.manual_seed(0)
    model = _tiny()
    ref = copy.deepcopy(model)
    loss_context = contextlib.nullcontext
    if via == "emit":
        shard_batch, (r, n), unshard, ep_mesh, clip = _emitted(model, plan)
    else:
        model, (shard_batch, (r, n), unshard, ep_mesh, clip), loss_context = _applied(model, plan, via == "meta")
    batches = _batches(steps, n, seq=SEQ)
    ref_losses, ref_grads, ref_params = _reference(ref, batches, lr)
    scale_grad = experts.ScaleGrad
    if unscaled:  # the dispatch reads it at each forward
        experts.ScaleGrad = type("NoScale", (), {"apply": staticmethod(lambda p, scale: p)})
    counts = []
    model.layers[0].moe.experts.register_forward_pre_hook(
        lambda m, args: counts.append(torch.diff(args[1], prepend=args[1].new_zeros(1)).tolist()))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
    loss_diff, grad_diff, ratio = [], {}, []
    for step, tokens in enumerate(batches):
        opt.zero_grad()
        mine = tokens.chunk(n)[r]
        batch = shard_batch(mine[:, :-1], mine[:, 1:])
        with loss_context():
            logits = model(batch.tokens, positions=batch.positions)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch.labels.reshape(-1))
            loss.backward()
        total = _full(loss.detach()).clone()
        dist.all_reduce(total)
        loss_diff.append(abs(total.item() / world - ref_losses[step]))
        if step == 0:
            grad_diff = differences(model, ref_grads, ep_mesh, grad=True)
            ratio = [(whole(name, p.grad, ep_mesh).norm() / ref_grads[name].norm()).item()
                     for name, p in model.named_parameters() if ".experts." in name]
        clip()
        opt.step()
    experts.ScaleGrad = scale_grad
    param_diff = differences(model, ref_params, ep_mesh)
    inputs = batches[-1].chunk(n)[r][:, :-1]
    with torch.no_grad():
        batch = shard_batch(inputs, inputs)
        gathered = unshard(_full(model(batch.tokens, positions=batch.positions)))
        output = (gathered - ref(inputs)).abs().max().item()
    w1 = model.layers[0].moe.experts.w1
    return {"loss": max(loss_diff), "grad": max(grad_diff.values()), "param": max(param_diff.values()),
            "output": output, "grads": len(grad_diff), "counts": counts, "ratio": ratio,
            "placements": {key: str(p.device_mesh.mesh_dim_names) + str(p.placements) for key, p in
                           (("expert", w1), ("dense", model.layers[0].attention.wq.weight))},
            "expert_group": dist.get_process_group_ranks(ep_mesh.get_group())}


def dcp_round_trip(rank: int, world: int, folder: str, plan: str) -> dict:
    """Save under expert x context, load into plain 1-D FSDP (other initial values), save that,
    load into expert x context again: max abs difference to the saved values at each end."""
    import planc

    def model_with(text: str, seed: int):
        torch.manual_seed(seed)
        model = _tiny()
        return model, planc.apply(model, planc.loads(text))

    return round_trip(_tiny, model_with, plan, "model planc.zoo:moe_llama_tiny\nunit layers.*\n", folder)


def launch_two(rank: int, world: int) -> list[dict]:
    """2 ranks: context 2, expert 2 borrowing the context pair (efsdp 1); the unscaled fact (one step)."""
    return [train_equal(rank, world, PLAN), train_equal(rank, world, PLAN, steps=1, unscaled=True)]


def launch_tensor(rank: int, world: int) -> list[dict]:
    """4 ranks, context 2 x tensor 2, expert 2 borrowing the tensor pairs (efsdp 2)."""
    return [train_equal(rank, world, TENSOR_PLAN)]


def launch_four(rank: int, world: int, folder: str) -> list[dict]:
    """4 ranks, shard 2 x context 2: expert 2 (efsdp 2) through `planc.apply`, the emitted code and a
    meta model materialised; expert 4 (efsdp 1); the DCP round trip at expert 2."""
    four = PLAN.replace("expert = 2", "expert = 4")
    return [train_equal(rank, world, PLAN), train_equal(rank, world, PLAN, via="emit"),
            train_equal(rank, world, PLAN, via="meta"), train_equal(rank, world, four),
            dcp_round_trip(rank, world, folder, PLAN)]


SHAPE = (2, 64)  # (batch, seq) of each rank's data-parallel batch for the memory measurement


def measure(rank: int, world: int, text: str = PLAN) -> dict:
    """`text` applied to `moe_llama_tiny` (fp32, balanced routing: `expert_memory_workers.balanced_route`)
    through `planc.apply`, one batch cut by `applied.shard_batch`, two AdamW steps under FSDPMemTracker
    (the second measured), FSDP's reduce-scatter as all-reduce + slice (what NCCL allocates); the lower
    peak of two measurements (`distributed.lowest_peak`: gloo can release a buffer late)."""
    from distributed import lowest_peak
    from expert_memory_workers import balanced_route

    import planc
    from planc.analysis.simulate import measure_real
    from planc.estimate.trace import Example
    from planc.zoo import routed

    routed.Router.forward = balanced_route

    def once() -> dict:
        torch.manual_seed(0)
        model = _tiny()
        applied = planc.apply(model, planc.loads(text))
        r, _ = applied.data_parallel_rank()
        tokens = torch.randint(0, 128, SHAPE, generator=torch.Generator().manual_seed(1 + r))
        batch = applied.shard_batch(tokens)
        m = measure_real(model, Example((batch.tokens,), {"positions": batch.positions}), nccl_like_reduce_scatter=True,
                         clip=None)
        return {"peak": m.peak, "breakdown": m.breakdown, "moment": m.moment, "timeline": m.timeline}

    return lowest_peak(once)
