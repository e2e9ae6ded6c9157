"""Rank bodies for tests/test_context_dist.py (module level, so spawned ranks can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from planc.backends import context


def reference(q, k, v):
    """Plain causal attention over the whole sequence in one process: the oracle."""
    seq = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


def attention_worker(rank: int, world: int, seq: int) -> dict:
    """Head-tail sharded attention on `world` context ranks vs the unsharded oracle: output and dq/dk/dv."""
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, 2, seq, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    weight = torch.randn(1, 2, seq, 8, generator=g, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_(True) for t in full]
    ref = reference(*ref_in)
    (ref * weight).sum().backward()

    positions = context.shard_positions(seq, world, rank)
    local = [context.shard(t, 2, world, rank).requires_grad_(True) for t in full]
    out = context.attention(*local, positions)
    (out * context.shard(weight, 2, world, rank)).sum().backward()
    gathered = context.unshard(out, 2)
    dist.barrier()
    return {
        "out": (out - ref.detach().index_select(2, positions)).abs().max().item(),
        "unsharded": (gathered - ref.detach()).abs().max().item(),
        "grads": [(t.grad - r.grad.index_select(2, positions)).abs().max().item() for t, r in zip(local, ref_in)],
        "grad_norm": min(t.grad.abs().max().item() for t in local),
    }


def gqa_worker(rank: int, world: int, seq: int) -> dict:
    """Grouped-query attention (4 query heads, 2 KV heads) through the style's routing: the 2 KV heads
    gathered, then repeated locally, their gradients reduce-scattered; vs the oracle on the whole sequence."""
    from planc.model.context_attention import route

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, seq, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    weight = torch.randn(1, 4, seq, 8, generator=g, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = reference(ref_in[0], *(t.repeat_interleave(2, dim=1) for t in ref_in[1:]))
    (ref * weight).sum().backward()

    positions = context.shard_positions(seq, world, rank)
    local = [context.shard(t, 2, world, rank).requires_grad_(True) for t in (q, k, v)]
    gathered = []
    comm = context.Collectives()
    comm_all_gather = comm.all_gather
    comm.all_gather = lambda out, t: (gathered.append(t.shape[1]), comm_all_gather(out, t))
    with route(comm):
        out = torch.nn.functional.scaled_dot_product_attention(
            local[0], *(t.repeat_interleave(2, dim=1) for t in local[1:]), is_causal=True)
    (out * context.shard(weight, 2, world, rank)).sum().backward()
    return {
        "out": (out - ref.detach().index_select(2, positions)).abs().max().item(),
        "grads": [(t.grad - r.grad.index_select(2, positions)).abs().max().item() for t, r in zip(local, ref_in)],
        "grad_norm": min(t.grad.abs().max().item() for t in local),
        "gathered_heads": gathered,
    }


def reduce_scatter_facts(rank: int, world: int) -> dict:
    """What gloo does with the two reduce-scatter calls on this torch: both sum right; the single-tensor form
    does work after the collective on its own buffer (a `copy_` into the output under a dispatch mode:
    a hidden copy of the input, tests/test_memory_dist.py), the list form none."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    buf = torch.arange(2.0 * world * 3).reshape(world, 2, 3) * (rank + 1)
    expected = buf[rank] / (rank + 1) * sum(range(1, world + 1))
    out = {}
    flat, rows = buf.view(-1, 3), list(buf.unbind(0))  # made outside the mode: only the collectives' own ops are seen
    for name, call in (("single", lambda o: dist.reduce_scatter_single(o, flat)),
                       ("list", lambda o: dist.reduce_scatter(o, rows))):
        result = torch.empty(2, 3)
        with Ops() as ops:
            call(result)
        out[name] = {"error": (result - expected).abs().max().item(), "ops": ops.seen}
    return out


def fsdp_mesh_worker(rank: int, world: int) -> dict:
    """What `fully_shard` does with the 2-D (shard, context) mesh vs the flattened one (facts for P49x)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("shard", "context"))
    two_d = fully_shard(torch.nn.Linear(8, 8, bias=False), mesh=mesh)
    flat = fully_shard(torch.nn.Linear(8, 8, bias=False), mesh=mesh["shard", "context"]._flatten("fsdp"))
    return {name: (tuple(m.weight.placements), tuple(m.weight.to_local().shape))
            for name, m in (("two_d", two_d), ("flat", flat))}


PLANS = {
    "context": "mesh (shard = *, context = 2)\nunit layers.*\nparallel layers.*.attention context\n",
    "shard x context": "mesh (shard = 2, context = 2)\nunit layers.*\nparallel layers.*.attention context\n",
    "context + checkpoint": ("mesh (shard = *, context = 2)\nunit layers.*\ncheckpoint layers.*\n"
                             "parallel layers.*.attention context\n"),
    "context + accumulate": ("mesh (shard = *, context = 2)\nunit layers.*\nstep { accumulate 2, sync = last }\n"
                             "parallel layers.*.attention context\n"),
    "replicate x context": ("mesh (replicate = 2, shard = 1, cp = 2)\nunit layers.*\n"
                            "parallel layers.*.attention context\n"),
    # heads split over the tensor axis, the sequence over the context axis, FSDP over shard x context
    "context x tensor": ("mesh (shard = *, context = 2, tensor = 2)\nunit layers.*\n"
                         "parallel layers.*.attention.{wq,wk,wv} colwise\nparallel layers.*.attention.wo rowwise\n"
                         "parallel layers.*.feed_forward.{w1,w3} colwise\nparallel layers.*.feed_forward.w2 rowwise\n"
                         "parallel tok_embeddings replicate\nparallel layers.*.{attention_norm,ffn_norm} replicate\n"
                         "parallel norm replicate\nparallel output replicate\nparallel layers.*.attention context\n"),
    # the same with sequence parallelism: between blocks each rank holds 1 / tensor of its sequence shard
    "context x sequence parallel": (
        "mesh (shard = *, context = 2, tensor = 2)\nunit layers.*\n"
        "parallel tok_embeddings rowwise {\n  input replicate\n  output shard(1)\n}\n"
        "parallel layers.*.{attention_norm,ffn_norm} sequence\n"
        "parallel layers.*.attention prepare_input {\n  input shard(1)\n  desired_input replicate\n}\n"
        "parallel layers.*.attention.{wq,wk,wv} colwise\nparallel layers.*.attention.wo rowwise { output shard(1) }\n"
        "parallel layers.*.feed_forward prepare_input {\n  input shard(1)\n  desired_input replicate\n}\n"
        "parallel layers.*.feed_forward.{w1,w3} colwise\nparallel layers.*.feed_forward.w2 rowwise { output shard(1) }\n"
        "parallel norm sequence\nparallel output colwise {\n  input shard(1)\n  output replicate\n}\n"
        "parallel layers.*.attention context\n"),
}


def _emitted(model, plan):
    """`model` sharded by the code `planc emit` prints for `plan`: (shard_batch, data-parallel (rank, size), unshard)."""
    import planc
    from planc.backends import runtime
    from planc.backends.emit import emit_python

    compiled = planc.compile(plan, model, dist.get_world_size())
    scope: dict = {}
    exec(compile(emit_python(compiled), "<emitted>", "exec"), scope)
    mesh = runtime.build_mesh(compiled.mesh)
    scope["apply_plan"](model, mesh)
    dp_rank, dp = 0, 1
    for name in compiled.mesh.dp_axis_names:  # the batch index over replicate x shard, by hand
        dp_rank, dp = dp_rank * mesh[name].size() + mesh[name].get_local_rank(), dp * mesh[name].size()

    def shard_batch(tokens, labels):
        return context.Batch(*scope["shard_batch"](tokens, labels, mesh))

    cp_name = compiled.mesh.axis_name("context")
    return shard_batch, (dp_rank, dp), lambda t: context.unshard(t, 1, mesh[cp_name].get_group())


def plan_case(rank: int, world: int, name: str, steps: int, via: str = "apply") -> dict:
    """zoo Llama tiny fp32 under `PLANS[name]` through `planc.apply` and `applied.shard_batch` (or
    through the code `planc emit` prints, `via="emit"`), 3 AdamW steps, vs one unsharded process:
    losses, gradients and final weights."""
    import copy

    import torch.nn.functional as F

    import planc
    from planc.zoo import llama3

    torch.manual_seed(0)
    ref = llama3.llama_tiny()
    model = copy.deepcopy(ref)
    if via == "emit":
        shard_batch, (dp_rank, dp), unshard = _emitted(model, planc.loads(PLANS[name]))
    else:
        applied = planc.apply(model, planc.loads(PLANS[name]))
        shard_batch, (dp_rank, dp), unshard = applied.shard_batch, applied.data_parallel_rank(), applied.unshard_sequence
    opt_ref, opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model))
    seq, per_rank, g = 16, 2, torch.Generator().manual_seed(1)
    out = {"ref": [], "cp": [], "grad": [], "dp": (dp_rank, dp),
           "placements": str(next(model.parameters()).placements),
           "mesh": (next(model.parameters()).device_mesh.mesh_dim_names, tuple(next(model.parameters()).device_mesh.shape))}
    for _ in range(steps):
        tokens = torch.randint(0, ref.config.vocab_size, (per_rank * dp, seq + 1), generator=g)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        loss = F.cross_entropy(ref(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        mine = slice(per_rank * dp_rank, per_rank * (dp_rank + 1))
        k = 1 if via == "emit" else applied.microbatches
        pieces = [(inputs[mine], labels[mine])] if k == 1 else applied.accumulate(inputs[mine], labels[mine])
        total = torch.zeros(())
        for piece in pieces:  # the step's microbatches (`step { accumulate k }`), each cut along the sequence
            batch = shard_batch(*piece)
            logits = model(batch.tokens, positions=batch.positions)
            local = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()) / k  # the plain per-rank mean
            local.backward()
            total += local.detach()
        dist.all_reduce(total)
        out["ref"].append(loss.item())
        out["cp"].append(total.item() / world)
        out["grad"].append(max((p.grad.full_tensor() - q.grad).abs().max().item()
                               for p, q in zip(model.parameters(), ref.parameters())))
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    out["params"] = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    batch = shard_batch(inputs[mine], labels[mine])  # the whole of this rank's last batch
    logits = model(batch.tokens, positions=batch.positions)
    whole = unshard(logits.detach())
    out["unshard"] = (whole - ref(inputs[mine]).detach()).abs().max().item()
    return out


def launch_two(rank: int, world: int) -> dict:
    """The 2-rank launch: attention at context 2, then the `context` plan, with activation checkpointing
    and with gradient accumulation."""
    return {"attention": attention_worker(rank, world, 16), "gqa": gqa_worker(rank, world, 16),
            "reduce_scatter": reduce_scatter_facts(rank, world), "context": plan_case(rank, world, "context", 3),
            "context + checkpoint": plan_case(rank, world, "context + checkpoint", 3),
            "context + accumulate": plan_case(rank, world, "context + accumulate", 3)}


def launch_tensor(rank: int, world: int) -> dict:
    """The 4-rank context x tensor launch (2 x 2): heads over the tensor axis, without and with sequence parallelism."""
    return {name: plan_case(rank, world, name, 3) for name in ("context x tensor", "context x sequence parallel")}


def launch_four(rank: int, world: int) -> dict:
    """The 4-rank launch: attention at context 4, the 2-D-mesh fact, shard x context and replicate x context plans."""
    return {"attention": attention_worker(rank, world, 16), "fsdp_mesh": fsdp_mesh_worker(rank, world),
            **{name: plan_case(rank, world, name, 3) for name in ("shard x context", "replicate x context")},
            **{f"emitted {name}": plan_case(rank, world, name, 3, via="emit")
               for name in ("shard x context", "replicate x context")}}


def dcp_case(rank: int, world: int, path: str) -> dict:
    """One AdamW step of zoo Llama tiny under the shard x context plan (2 x 2), saved with DCP;
    loaded into a fresh, differently seeded model and optimizer under a plan without the
    context axis (FSDP over all 4 ranks); both full state dicts (model and optimizer), rank 0's."""
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from proof_workers import full_state, sharded_load

    import planc
    from planc.zoo import llama3

    torch.manual_seed(0)
    model = llama3.llama_tiny()
    applied = planc.apply(model, planc.loads(PLANS["shard x context"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp_rank, dp = applied.data_parallel_rank()
    tokens = torch.randint(0, model.config.vocab_size, (2 * dp, 17), generator=torch.Generator().manual_seed(1))
    mine = tokens[2 * dp_rank:2 * (dp_rank + 1)]
    batch = applied.shard_batch(mine[:, :-1], mine[:, 1:])
    F.cross_entropy(model(batch.tokens, positions=batch.positions).flatten(0, 1), batch.labels.flatten()).backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = full_state(model, opt)

    torch.manual_seed(1)
    other = llama3.llama_tiny()
    planc.apply(other, planc.loads("mesh (shard = *)\nunit layers.*\n"))
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    before = full_state(other, other_opt)
    sharded_load(other, other_opt, path)
    return {"saved": saved, "loaded": full_state(other, other_opt), "before": before,
            "mesh": next(other.parameters()).device_mesh.mesh_dim_names}
