"""Expert parallelism made real: whole experts per expert rank, tokens moved by all-to-all.

A plan reaches it through `parallel SELECTOR expert` (`DispatchExperts` ops, run by
`planc.apply` and printed by `planc emit`). An experts container of the known layout
(`planc.zoo.routed.RoutedExperts`: 3-D weights `[experts, ...]`, `forward(rows, offsets)` on
rows sorted by expert, `offsets` the cumulative ends of each expert's group) keeps the
`experts / expert` experts of its expert rank, and its forward becomes:

    counts per expert          -> all-to-all of the counts over the expert axis, then one host
                                  sync for the split sizes (`tolist`)
    rows                       -> all-to-all with uneven splits (autograd: the backward sends
                                  the gradients back the same way), regrouped expert-major
    the local experts          -> the container's own forward on its rows
    outputs                    -> back to source order, all-to-all back to the sending rank

as torchtitan 0.3.0's `AllToAllTokenDispatcher` does (the probe `ep_tt_probe.py` shows it
equal to all experts run locally). Hugging Face's fused 3-D experts (`forward(hidden,
top_k_index, top_k_weights)`, Qwen3-MoE, Mixtral: `planc.resolve.experts.layout`) go the same
way: each (token, expert) pair sorted by expert, run on its rank with weight 1, combined with
the router's weights on the way back. The router and everything else stay dense.

The experts are FSDP-sharded on the expert view's FSDP axes (`efsdp`, with replicate for
HSDP) through `shard_placement_fn` returning torch 2.13's `ShardPlacementResult`: one
`fully_shard` call holds two parameter groups, dense and expert (`expert_placement_fn`).
An expert's gradient already sums the contributions of every rank of its expert group, and
FSDP averages it over the experts' FSDP ranks only (`replicate x efsdp`, `expert` times fewer
than the dense ranks): the dispatched forward scales the experts' weight gradients by
`1 / expert` (`ScaleGrad`), so the average is the one-process gradient. A unit with a
`reduction divide_factor` (torchtitan's convention: the loss over the global token count, FSDP
sums) divides both groups' sums by the same factor: nothing to scale (`averaged=False`;
tests/test_expert_torchtitan_dist.py caught the 1/expert there: AdamW hid it until step 3). (FSDP's own divide
factor is not used: it is per `fully_shard` call, both meshes at once; on a 1-rank mesh torch
2.13 with `set_force_sum_reduction_for_comms` divides twice, and without it reduces with
`ReduceOp.PREMUL_SUM`, which gloo refuses.)

torch 2.13's `clip_grad_norm_` raises on parameters on two meshes ("All operands in
aten.stack.default must have the same mesh"; tests/test_expert_dist.py): `clip_grad_norm_`
here is the working recipe (the norm over both meshes, the experts' part summed over the
expert axis). The foreach AdamW steps parameters on two meshes as they are.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from planc.lower.job import View
from planc.model.dispatch import GatherRows, ScaleGrad, TakeRows, expert_major, sorted_rows, token_choice
from planc.resolve.experts import EFSDP, SORTED, layout
from planc.resolve.mesh import Role

__all__ = ["balanced_routing", "build_expert_mesh", "clip_grad_norm_", "dispatch_experts", "expert_mesh_of",
           "expert_placement_fn", "split_over_tensor", "whole_optimizer_state"]


def build_expert_mesh(view: View, device: str) -> DeviceMesh:
    """The expert view as a `DeviceMesh` over the default process group (its axes' sizes known);
    with a pipeline axis (outermost), this rank's stage's submesh of the other axes: the experts'
    all-to-alls and FSDP stay inside the pipeline rank's ranks."""
    mesh = init_device_mesh(device, tuple(a.size for a in view.axes), mesh_dim_names=view.axis_names)
    inner = tuple(a.name for a in view.axes if a.role is not Role.PIPELINE)
    return mesh if len(inner) == len(view.axes) else mesh[inner]


# The attribute a dispatched experts container carries: (its expert rank, the expert degree), so
# that `planc.materialize(reproducible=True)` initialises all experts and keeps this rank's.
EXPERT_SLICE = "_planc_expert_slice"
WHOLE = "_planc_whole_experts"  # ... and the function that views its experts whole (`_whole`)


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    y = funcol.all_to_all_single_autograd(x, out_splits, in_splits, group)
    return funcol.wait_tensor(y)



_BALANCED: list[bool] = []  # non-empty inside `balanced_routing()`


@contextlib.contextmanager
def balanced_routing():
    """Inside, the dispatch does not exchange the counts per expert (a fake process group cannot
    fill them: `planc check --simulate`) and assumes balanced routing, as the memory estimate does
    (`planc/estimate/expert_local.py`): this rank sends `rows / expert` rows to each expert rank and
    receives as many from each, spread evenly over its local experts."""
    _BALANCED.append(True)
    try:
        yield
    finally:
        _BALANCED.pop()


def _split_sizes(send: torch.Tensor, rows: int, group) -> tuple[torch.Tensor, list[int], list[int]]:
    """(received counts [ranks, local experts], rows sent to each rank, rows received from each):
    the counts' all-to-all and the one host sync, or the balanced assumption (`balanced_routing`)."""
    if not _BALANCED:
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)  # received[j]: what rank j sends me, per local expert
        return received, send.sum(1).tolist(), received.sum(1).tolist()  # the host sync
    ep, local = send.shape
    splits = [rows // ep + (j < rows % ep) for j in range(ep)]
    per_expert = [[n // local + (e < n % local) for e in range(local)] for n in splits]
    return torch.tensor(per_expert, dtype=send.dtype, device=send.device), splits, splits


def dispatch_experts(module: nn.Module, expert_mesh: DeviceMesh, axis: str, tensor_mesh: DeviceMesh | None = None,
                     layer: nn.Module | None = None, averaged: bool = True) -> nn.Module:
    """Keep this expert rank's experts in `module` and route its forward's rows by all-to-all.

    `expert_mesh` is the expert view, `axis` its expert axis. Each 3-D parameter `[E, ...]` of
    `module` is replaced by its rank's slice `[E / expert, ...]` (on meta too: nothing is
    allocated); its forward (either layout) takes this rank's tokens routed over all experts and
    returns their outputs in the same order, as before. `module.state_dict()` gives the
    experts whole-shaped (`_whole`), so a DCP checkpoint saved with expert parallelism loads
    without it and back (`whole_optimizer_state` does the same for the optimizer's moments).

    With a tensor axis (`tensor_mesh`, the dense view's tensor axis) the MoE `layer` holding
    `module` runs on its tensor rank's part of the tensor group's tokens (`split_over_tensor`),
    and the experts' gradients are scaled by tensor / expert instead of 1 / expert: every token
    of the world reaches one expert rank once, and FSDP averages over replicate x efsdp ranks,
    (replicate x shard) x expert / tensor of them.

    `averaged`: FSDP averages the experts' gradients (the default): they are scaled as above;
    False when the unit sets a divide factor (torchtitan's `set_gradient_divide_factor(1.0)` with
    the loss over the global token count): FSDP then divides dense and expert sums alike and the
    gradients are left as they are.
    """
    mesh = expert_mesh[axis]
    group, ep, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    tp = 1 if tensor_mesh is None else tensor_mesh.size()
    scale = tp / ep if averaged else 1.0
    if tensor_mesh is not None and layer is not None:
        split_over_tensor(layer, module, tensor_mesh)
    params = list(module.named_parameters(recurse=False))
    total = params[0][1].shape[0]
    local = total // ep
    for name, p in params:
        kept = p.detach()[rank * local:(rank + 1) * local].clone()
        module.register_parameter(name, nn.Parameter(kept, requires_grad=p.requires_grad))
    forward = module.forward
    kind = layout(module)
    if hasattr(module, "num_experts"):  # Hugging Face's experts count their own (local) experts
        module.num_experts = local

    def exchange(rows: torch.Tensor, counts: torch.Tensor, run) -> torch.Tensor:
        """Rows sorted by global expert (`counts` per expert) to their experts' ranks, `run(rows,
        local counts)` there on the rows regrouped expert-major, the outputs back in the same order."""
        send = counts.view(ep, local).contiguous()  # to rank j: the counts of its experts
        received, in_splits, out_splits = _split_sizes(send, rows.shape[0], group)
        arrived = _a2a(rows, out_splits, in_splits, group)
        order = expert_major(received, sum(out_splits))
        # NOTE: the parameters are read here, after FSDP's pre-forward put the unsharded ones in
        # place; their gradients scaled by tensor / expert (see the module docstring), put back however forward ends
        own = list(module._parameters.items())
        for key, p in own:
            module._parameters[key] = ScaleGrad.apply(p, scale)
        try:
            out = run(arrived.index_select(0, order), received.sum(0))
        finally:
            for key, p in own:
                module._parameters[key] = p
        back = out.index_select(0, torch.argsort(order))
        return _a2a(back, in_splits, out_splits, group)

    module.forward = sorted_rows(forward, exchange) if kind == SORTED else token_choice(forward, exchange, total, local)
    setattr(module, EXPERT_SLICE, (rank, ep))
    whole = _whole(expert_mesh, axis, total)
    setattr(module, WHOLE, whole)

    def hook(module, state_dict, prefix, local_metadata):
        for key in module._parameters:
            if isinstance(state_dict.get(prefix + key), DTensor):
                state_dict[prefix + key] = whole(state_dict[prefix + key])
    module.register_state_dict_post_hook(hook)
    return module


class _SumOver(torch.autograd.Function):
    """The identity forward (a view); the gradient summed over `group` (the tensor group)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def split_over_tensor(layer: nn.Module, experts: nn.Module, tensor_mesh: DeviceMesh) -> nn.Module:
    """Run the MoE `layer` (router, shared experts, the dispatched `experts`) on this tensor rank's
    part of its tensor group's tokens, so that no token is dispatched twice (torchtitan's way).

    Its input as sequence parallelism leaves it (a DTensor sharded over the tensor axis: each rank
    holds other tokens): the local shard, the output local (as a rowwise `output shard(1)` gives it).
    Replicated (a plain tensor, or a replicated DTensor: every rank of the group holds the same
    tokens): the tokens cut in `tensor` equal parts (`TakeRows`: the backward gathers their
    gradients), this rank's run, the outputs all-gathered (`GatherRows`: the backward keeps this
    rank's part). Either way the layer's dense parameters (router, shared experts) see only this
    rank's tokens: their gradients are summed over the tensor group (`_SumOver`), as a DTensor
    replicated over it would be."""
    group, tp, rank = tensor_mesh.get_group(), tensor_mesh.size(), tensor_mesh.get_local_rank()
    gather = functools.partial(dist.all_gather, group=group)
    inside = {id(p) for p in experts.parameters()}
    dense = [(m, key) for m in layer.modules() for key, p in m._parameters.items() if p is not None and id(p) not in inside]
    forward = layer.forward

    def run(x: torch.Tensor, *args, **kwargs):
        # NOTE: read after FSDP's pre-forward put the unsharded parameters in place, put back however forward ends
        own = [(m, key, m._parameters[key]) for m, key in dense]
        for m, key, p in own:
            m._parameters[key] = _SumOver.apply(p, group)
        try:
            return forward(x, *args, **kwargs)
        finally:
            for m, key, p in own:
                m._parameters[key] = p

    def split(x: torch.Tensor, *args, **kwargs):
        if isinstance(x, DTensor):
            if all(p.is_shard() for p in x.placements):
                return run(x.to_local(), *args, **kwargs)
            x = x.to_local()
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] % tp:
            raise ValueError(f"the {rows.shape[0]} tokens reaching an expert-parallel MoE layer do not divide by the "
                             f"tensor degree {tp}: make batch x sequence a multiple of {tp}")
        mine = TakeRows.apply(rows, gather, rank, tp)
        out = run(mine.unsqueeze(0), *args, **kwargs)
        return GatherRows.apply(out.reshape(mine.shape), gather, rank, tp).view_as(x)

    layer.forward = split
    return layer


def _whole(expert_mesh: DeviceMesh, axis: str, total: int):
    """`whole(t)`: FSDP's DTensor of this rank's `[E / expert, ...]` experts (a parameter, or an
    optimizer state shaped like it) as a DTensor of all `[E, ...]` experts sharing its local
    storage, on the expert view with the expert axis moved before efsdp: `Shard(0)` over the
    experts, then FSDP's own placement. DCP saves and loads (in place) through it as any
    sharded tensor (`dispatch_experts`' state-dict hook, `whole_optimizer_state`)."""
    from torch.distributed.tensor import Replicate, Shard

    names = expert_mesh.mesh_dim_names
    order = [i for i, n in enumerate(names) if n != axis]
    order.insert(len(order) - 1, names.index(axis))  # (replicate,) expert, efsdp
    view = DeviceMesh(expert_mesh.device_type, expert_mesh.mesh.permute(order), _init_backend=False,
                      mesh_dim_names=tuple(names[i] for i in order))

    def whole(value: DTensor) -> DTensor:
        placements = (*[Replicate()] * (view.ndim - 2), Shard(0), value.placements[-1])
        shape = (total, *value.shape[1:])
        return DTensor.from_local(value.to_local(), view, placements, run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())
    return whole


def whole_optimizer_state(model: nn.Module, state: dict) -> dict:
    """An optimizer state dict keyed by parameter names (`torch.distributed.checkpoint.state_dict.
    get_state_dict`'s) with the moments of expert-parallel parameters whole-shaped (`_whole`), in
    place, for `dcp.save` and an in-place `dcp.load` (then not `set_state_dict`: the optimizer's
    own tensors were written through the views)."""
    for path, module in model.named_modules():
        whole = getattr(module, WHOLE, None)
        if whole is None:
            continue
        for key, p in module._parameters.items():
            moments = state.get("state", {}).get(f"{path}.{key}" if path else key, {})
            for name, value in list(moments.items()):
                if isinstance(value, DTensor) and value.shape == p.shape:
                    moments[name] = whole(value)
    return state


def expert_placement_fn(experts: dict[nn.Parameter, int], expert_mesh: DeviceMesh, dense_mesh: DeviceMesh,
                        placed: dict[nn.Parameter, int] | None = None):
    """`shard_placement_fn` for one `fully_shard` call with experts: each expert parameter (`experts`:
    parameter -> dim) on the expert view's FSDP mesh, every other on the dense mesh (`Shard(0)`, or
    the dim a `place` statement gave it: `placed`). Parameters are matched by identity."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    on_experts = {id(p): dim for p, dim in experts.items()}
    dense_dims = {id(p): dim for p, dim in (placed or {}).items()}
    expert_info, dense_info = _get_mesh_info(expert_mesh), _get_mesh_info(dense_mesh)

    def placement(param: nn.Parameter) -> ShardPlacementResult:
        dim = on_experts.get(id(param))
        if dim is None:
            return ShardPlacementResult(Shard(dense_dims.get(id(param), 0)), dense_info)
        return ShardPlacementResult(Shard(dim), expert_info)

    return placement


def expert_mesh_of(mesh: DeviceMesh, expert: int, names: tuple[str, ...], pipeline: str | None = None) -> DeviceMesh:
    """The expert view of the ranks of the dense `mesh` (what `planc emit`'s code builds): axes
    `names`, (replicate,) efsdp, expert, the replicate axis as the dense mesh's. With the
    `pipeline` axis of `mesh` (outermost), this rank's stage's submesh of that view (built on
    every rank: its groups are created by all)."""
    pp = mesh[pipeline].size() if pipeline is not None else 1
    replicate = mesh[names[0]].size() if len(names) == 3 else 1
    sizes = ((replicate,) if len(names) == 3 else ()) + (mesh.size() // (pp * replicate * expert), expert)
    if pipeline is None:
        return init_device_mesh(mesh.device_type, sizes, mesh_dim_names=names)
    return init_device_mesh(mesh.device_type, (pp, *sizes), mesh_dim_names=(pipeline, *names))[names]


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, expert_axis: DeviceMesh,
                    norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for parameters on the dense and the expert meshes.

    The norm of each mesh's gradients (a DTensor reduction over that mesh), the expert meshes'
    part summed over `expert_axis` (each expert rank holds other experts), then every gradient
    scaled by `max_norm / (norm + 1e-6)` clamped to 1 (torch's arithmetic). Returns the total norm.
    """
    if norm_type != 2.0:
        raise ValueError("planc's clip_grad_norm_ for expert parallelism computes the 2-norm only")
    grads = [p.grad for p in parameters if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    dense = torch.zeros((), dtype=torch.float32)
    spread = torch.zeros((), dtype=torch.float32)
    for mesh, group in by_mesh.items():
        square = sum(torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) ** 2 for g in group)
        square = square.full_tensor() if isinstance(square, DTensor) else square
        on_experts = mesh is not None and mesh.mesh_dim_names is not None and EFSDP in mesh.mesh_dim_names
        if on_experts:
            spread = spread + square.cpu()
        else:
            dense = dense + square.cpu()
    dist.all_reduce(spread, group=expert_axis.get_group())
    total = torch.sqrt(dense + spread)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch's: no host sync (runs on fake tensors too)
    with torch.no_grad():
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return total
