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


def fsdp_mesh_worker(rank: int, world: int) -> dict:
    """What `fully_shard` does with the 2-D (shard, context) mesh vs the flattened one (facts for P49x)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("shard", "context"))
    two_d = fully_shard(torch.nn.Linear(8, 8, bias=False), mesh=mesh)
    flat = fully_shard(torch.nn.Linear(8, 8, bias=False), mesh=mesh["shard", "context"]._flatten("fsdp"))
    return {name: (tuple(m.weight.placements), tuple(m.weight.to_local().shape))
            for name, m in (("two_d", two_d), ("flat", flat))}


def llama_worker(rank: int, world: int, steps: int) -> dict:
    """zoo Llama tiny fp32, context=`world` head-tail, AdamW: losses and grads vs one unsharded process."""
    import copy

    import torch.nn.functional as F

    from planc.zoo import llama3

    torch.manual_seed(0)
    ref = llama3.llama_tiny()
    model = copy.deepcopy(ref)
    for layer in model.layers:
        context.attend_over_context(layer.attention)
    opt_ref, opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model))
    seq = 16
    g = torch.Generator().manual_seed(1)
    positions = context.shard_positions(seq, world, rank)
    out = {"ref": [], "cp": [], "grad": []}
    for _ in range(steps):
        tokens = torch.randint(0, ref.config.vocab_size, (2, seq + 1), generator=g)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        loss = F.cross_entropy(ref(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        logits = model(context.shard(inputs, 1, world, rank), positions=positions)
        local = F.cross_entropy(logits.flatten(0, 1), context.shard(labels, 1, world, rank).flatten(),
                                reduction="sum") / labels.numel()
        local.backward()
        total = local.detach().clone()
        dist.all_reduce(total)
        for p in model.parameters():  # the context ranks share the weights: sum their gradients
            dist.all_reduce(p.grad)
        out["ref"].append(loss.item())
        out["cp"].append(total.item())
        out["grad"].append(max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    return out


def llama_fsdp_worker(rank: int, world: int, steps: int) -> dict:
    """zoo Llama tiny on a (shard=2, context=2) mesh, FSDP over the flattened axes: losses vs one process."""
    import copy

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from planc.zoo import llama3

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "context"))
    cp_group, cp, cp_rank = mesh["context"].get_group(), 2, mesh["context"].get_local_rank()
    dp_rank = mesh["shard"].get_local_rank()
    torch.manual_seed(0)
    ref = llama3.llama_tiny()
    model = copy.deepcopy(ref)
    flat = mesh["shard", "context"]._flatten("fsdp")
    for layer in model.layers:
        context.attend_over_context(layer.attention, cp_group)
        fully_shard(layer, mesh=flat)
    fully_shard(model, mesh=flat)
    opt_ref, opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model))
    seq, g = 16, torch.Generator().manual_seed(1)
    positions = context.shard_positions(seq, cp, cp_rank)
    out = {"ref": [], "cp": []}
    for _ in range(steps):
        tokens = torch.randint(0, ref.config.vocab_size, (4, seq + 1), generator=g)  # 2 per shard rank
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        loss = F.cross_entropy(ref(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        mine = slice(2 * dp_rank, 2 * dp_rank + 2)
        logits = model(context.shard(inputs[mine], 1, cp, cp_rank), positions=positions)
        local_sum = F.cross_entropy(logits.flatten(0, 1), context.shard(labels[mine], 1, cp, cp_rank).flatten(),
                                    reduction="sum")
        (local_sum * world / labels.numel()).backward()  # FSDP averages gradients over the 4 ranks
        total = local_sum.detach() / labels.numel()
        dist.all_reduce(total)
        out["ref"].append(loss.item())
        out["cp"].append(total.item())
        out.setdefault("grad", []).append(max((p.grad.full_tensor() - q.grad).abs().max().item()
                                              for p, q in zip(model.parameters(), ref.parameters())))
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    out["params"] = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return out
