"""Rank bodies for tests/test_expert_torchtitan_dist.py: expert parallelism by hand with
torchtitan 0.3.0's own pieces against `planc.apply` with the same plan.

One seed builds the zoo's routed MoE tiny (fp32; its experts have torchtitan's layout: `w1`/`w3`
`[E, hidden, dim]`, `w2` `[E, dim, hidden]`, the grouped matmul on rows sorted by expert) twice:

* torchtitan's side, as a torchtitan user writes it by hand: torchtitan's `ParallelDims`
  (`dp_shard = -1, ep = 2`, the `partial_dtensor` backend) gives the `fsdp`, `ep` and `efsdp`
  meshes; each MoE layer's forward is torchtitan's `MoE.forward` (the routing map, the counts per
  expert) around the zoo's router, then torchtitan's own `RoutedExperts.forward` with an
  `AllToAllTokenDispatcher` wired to the `ep` mesh (dispatch: local sort, the counts' all-to-all,
  the host sync, the rows' all-to-all, the permute to expert-major; combine: unpermute,
  all-to-all back, scores multiplied, `deterministic_scatter_add`); each `ep` rank keeps its
  `E / ep` experts (the local view torchtitan's `GroupedExperts` takes with `to_local()`); and
  torchtitan's own `apply_fsdp_to_decoder(ep_degree=2, edp_mesh=efsdp)` shards it (its expert
  `shard_placement_fn`: `ShardPlacementResult` on the `efsdp` mesh, `Shard(0)`, or `Shard(1)` when
  efsdp x ep > experts; the divide factor 1.0; explicit prefetch). The adapter lines that let its
  function read the zoo's tree are marked `# adapter`. Gloo: `set_force_sum_reduction_for_comms`.
* planc's side: `planc.apply` with `PLAN` (torchtitan's units, fp32, its reduction convention).

Both train as torchtitan's trainer does (each rank its own tokens, summed cross-entropy over
the global token count, AdamW), without clipping: torchtitan's EP clipping reads an `ep` axis
on the experts' DTensors, which its `spmd_types` flow gives them and this hand-built one does not.
"""

from __future__ import annotations

import dataclasses
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

EP, STEPS, BATCH, SEQ = 2, 3, 2, 16

PLAN = """model planc.zoo:routed_moe_tiny
mesh (shard = *, expert = 2)
defaults {
  precision param = fp32, reduce = fp32, cast_inputs = false
  reshard after_forward = true
  reduction divide_factor = 1.0, force_sum = true
}
unit tok_embeddings
unit [norm, output] { reshard after_forward = false }
unit layers.*
root { reshard after_forward = false }
parallel layers.*.moe.experts expert
"""


def _model(experts: int):
    from planc.zoo.routed import ROUTED_MOE_TINY_CONFIG, RoutedMoETransformer

    torch.manual_seed(0)
    return RoutedMoETransformer(dataclasses.replace(ROUTED_MOE_TINY_CONFIG, num_experts=experts))


def _titan_meshes(world: int):
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the `fake` backend ParallelDims uses)
    import torchtitan.distributed.parallel_dims as pdims
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")
    pdims.device_type = "cpu"  # torchtitan falls back to "cuda" without an accelerator
    dims = pdims.ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=EP, world_size=world,
                              spmd_backend="partial_dtensor")
    return dims.get_mesh("fsdp"), dims.get_optional_mesh("efsdp"), dims.get_optional_mesh("ep")


def _titan_moe_forward(moe: nn.Module, dispatcher):
    """torchtitan's `MoE.forward` (no expert bias, no shared experts) with the zoo's router."""
    from torchtitan.models.common.moe import RoutedExperts

    routed = types.SimpleNamespace(token_dispatcher=dispatcher,  # what RoutedExperts.forward reads
                                   inner_experts=lambda rows, counts: moe.experts(rows, counts.cumsum(0)))

    def forward(x):
        b, seq, d = x.shape
        ids, scores = moe.router(x.reshape(-1, d))
        ids, scores = ids.view(b, seq, -1), scores.view(b, seq, -1)
        routing_map = torch.zeros(b, seq, moe.num_experts, dtype=torch.bool).scatter_(-1, ids, True)
        return RoutedExperts.forward(routed, x, scores, ids, routing_map.sum(dim=(0, 1)))
    return forward


def torchtitan_side(world: int, experts: int):
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    dp_mesh, edp_mesh, ep_mesh = _titan_meshes(world)
    model = _model(experts)
    rank, local = ep_mesh.get_local_rank(), experts // EP
    for layer in model.layers:
        moe = layer.moe
        dispatcher = AllToAllTokenDispatcher(AllToAllTokenDispatcher.Config(num_experts=experts, top_k=moe.router.top_k))
        dispatcher.wire_meshes(ep_mesh=ep_mesh)
        for name, p in list(moe.experts.named_parameters(recurse=False)):  # this ep rank's experts
            moe.experts.register_parameter(name, nn.Parameter(p.detach()[rank * local:(rank + 1) * local].clone()))
        moe.forward = _titan_moe_forward(moe, dispatcher)
        layer.moe_enabled = True  # adapter: torchtitan's block flag
        moe.routed_experts = types.SimpleNamespace(inner_experts=moe.experts)  # adapter: its module path
        moe.experts.num_experts = experts  # adapter: GroupedExperts' (global) expert count
    object.__setattr__(model, "enable_weight_tying", False)  # adapter: torchtitan's Decoder attributes
    object.__setattr__(model, "lm_head", model.output)
    object.__setattr__(model.layers, "items", lambda: list(enumerate(model.layers)))
    object.__setattr__(model.layers, "values", lambda: list(model.layers))
    apply_fsdp_to_decoder(model, dp_mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False,
                          ep_degree=EP, edp_mesh=edp_mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM (same numbers)
    return model


def planc_side(experts: int, plan: str = PLAN):
    import planc

    model = _model(experts)
    planc.apply(model, planc.loads(plan))
    return model


def placements(model) -> dict[str, tuple]:
    """Each parameter's mesh (its ranks), placements and local shape."""
    return {n: (p.device_mesh.mesh.tolist(), str(p.placements), tuple(p.to_local().shape))
            for n, p in model.named_parameters()}


def train(model, rank: int) -> tuple[list[str], list[int], dict]:
    """torchtitan's step, 3 times: the global loss of each step in hex; the rows layers.0's experts
    ran on; this rank's shard of each gradient after the first backward."""
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, weight_decay=0.1, foreach=True)
    gen = torch.Generator().manual_seed(100 + rank)
    rows: list[int] = []
    hook = model.layers[0].moe.experts.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 128, (BATCH, SEQ + 1), generator=gen)
        labels = tokens[:, 1:]
        global_tokens = torch.tensor(float(labels.numel()))
        dist.all_reduce(global_tokens)
        pred = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1),
                                                 reduction="sum") / global_tokens
        loss.backward()
        if not out:
            grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        out.append(total.item().hex())
    hook.remove()
    return out, rows, grads


def parity(rank: int, world: int, experts_counts: list[int]) -> list[dict]:
    torch.set_num_threads(1)
    results = []
    for experts in experts_counts:
        row: dict = {"experts": experts}
        grads = {}
        for side, make in (("torchtitan", lambda: torchtitan_side(world, experts)), ("planc", lambda: planc_side(experts))):
            model = make()
            losses, rows, grads[side] = train(model, rank)
            row[side] = {"placements": placements(model), "losses": losses, "rows": rows}
        row["grads_differ"] = {n: (g - grads["planc"][n]).abs().max().item() / g.abs().max().item()
                               for n, g in grads["torchtitan"].items() if not torch.equal(g, grads["planc"][n])}
        results.append(row)
    return results
