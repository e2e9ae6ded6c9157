"""Collectives of one step: what each FSDP unit and tensor-parallel style moves, exact bytes, and a collective's time.

`unit_collectives` gives each `fully_shard` unit's all-gathers, reduce-scatters, all-reduces and
host copies (torch 2.13 FSDP2's sizes, over the flattened shard x context ranks with a context
axis); `tp_collectives` each tensor-parallel style's activation collectives; `context_collectives`
each context-parallel attention's K/V gathers and their gradients' reduce-scatters;
`recompute_collectives` what checkpointing reruns; `collective_s` the alpha-beta time of one on a
`Hardware`. The step-time model (`planc/estimate/time.py`) schedules them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

import torch

from planc.estimate.hardware import Hardware
from planc.lower.fsdp import compute_dtypes, fsdp_shape, reshard_group, shard_numel
from planc.lower.job import Schedule
from planc.lower.lowering import tensor_dims
from planc.lower.program import AttendOverContext, Checkpoint, DispatchExperts, FullyShard, Parallelize, Program
from planc.resolve.mesh import Role
from planc.resolve.styles import IN, OUT, STYLES


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


@dataclass(frozen=True)
class Collective:
    """One collective (or host copy) of one unit: `bytes` in nccl-tests' size convention.

    all_gather: the gathered output; reduce_scatter: the input; all_reduce: the buffer;
    host_to_device / device_to_host: the bytes copied. `ranks` is the group size, `axis` the
    mesh axis (`shard`, `replicate`, `tensor`, `host`), `phase` forward or backward.
    """

    kind: str
    axis: str
    ranks: int
    bytes: int
    phase: str
    what: str = ""          # "params", "grads", or the module a TP collective belongs to
    stride: int = 1         # distance between consecutive ranks of the group (link class)
    side: str = ""          # TP, forward: "input" (before the module's ops) or "output" (after)
    times: int = 1          # how often one step runs it: per microbatch, or once (`step { accumulate N }`)


# ===================================================================== communication, exact


def _group_dtype(op: FullyShard, graph) -> torch.dtype:
    infos = [graph.params[p] for p in op.params]
    return infos[0].dtype if infos else torch.float32


def unit_collectives(program: Program, graph, world: int, schedule: Schedule | None = None) -> list[list[Collective]]:
    """Every `fully_shard` unit's collectives for one step at `world` ranks (FSDP part only).

    With several microbatches per step (`schedule`), the all-gathers run once per microbatch,
    the gradient reductions once per microbatch or, with `sync = last`, once (`Collective.times`).

    Bytes are exact for torch 2.13's FSDP2: per parameter `ceil(dim / shard) * rest` elements
    per rank (`Shard(d)` placements pad dim d instead), the tensor-parallel local shape when
    the parameter is TP-sharded; the all-gather packs all of a unit's parameters into one
    collective (`foreach_all_gather`), the reduce-scatter all its gradients.
    """
    sizes = program.mesh.sizes(world) or {"shard": world}
    replicate, tp = sizes.get("replicate", 1), sizes.get("tensor", 1)
    shard = sizes.get("shard", 1) * sizes.get("context", 1)  # FSDP shards over shard x context, flattened
    tp_dims = tensor_dims(program, graph) if tp > 1 else {}
    out: list[list[Collective]] = []
    for op in program.units:
        placed = dict(op.placements)
        precision = op.policy.precision
        ag = rs = sharded = sharded_grad = 0
        experts = dict(op.experts)  # their own parameter group, on the expert view (`_expert_group`)
        for name in op.params:
            if name in experts:
                continue
            info = graph.params[name]
            shape = fsdp_shape(info.shape, tp_dims.get(name), tp)
            per_rank = shard_numel(shape, shard, placed.get(name, 0))
            ag += per_rank * shard * _itemsize(precision.compute_dtype(info.dtype))
            sharded += per_rank * _itemsize(info.dtype)
            if info.requires_grad:
                rs += per_rank * shard * _itemsize(precision.reduce(info.dtype))
                sharded_grad += per_rank * _itemsize(info.dtype)
        cs: list[Collective] = []
        stride = tp  # the shard axis sits outside the tensor axis
        reshard = op.policy.reshard_after_forward
        offload = op.policy.offload.enabled
        if shard > 1 and ag:
            cs.append(Collective("all_gather", "shard", shard, ag, "forward", "params", stride))
            if offload:
                cs.append(Collective("host_to_device", "host", 1, sharded, "forward", "params"))
            group = reshard_group(reshard, shard)
            if group == shard:
                cs.append(Collective("all_gather", "shard", shard, ag, "backward", "params", stride))
                if offload:
                    cs.append(Collective("host_to_device", "host", 1, sharded, "backward", "params"))
            elif group is not None and group > 1:
                # hpZ: the backward all-gather runs within groups of N ranks of the shard axis
                cs.append(Collective("all_gather", "shard", group, ag, "backward", "params", stride))
        if rs and shard > 1:
            cs.append(Collective("reduce_scatter", "shard", shard, rs, "backward", "grads", stride))
        if rs and replicate > 1:
            cs.append(Collective("all_reduce", "replicate", replicate, rs // shard, "backward", "grads",
                                 stride * shard))
        if offload and rs:
            cs.append(Collective("device_to_host", "host", 1, sharded_grad, "backward", "grads"))
        if experts:
            cs += _expert_group(program, op, graph, world, replicate)
        out.append([dataclasses.replace(c, times=_times(c, schedule)) for c in cs])
    return out


def _expert_group(program: Program, op: FullyShard, graph, world: int, replicate: int) -> list[Collective]:
    """The collectives of a unit's expert parameter group (expert parallelism): each rank's
    `[experts / expert, ...]` experts all-gathered and reduce-scattered over the efsdp ranks of
    the expert view (none when efsdp is 1: FSDP2 issues no collective on a 1-rank mesh, seen on
    gloo), all-reduced over replicate. Offload and partial reshard are not modelled here."""
    from planc.resolve.experts import expert_degrees
    sizes = program.mesh.sizes(world) or {}
    degrees = expert_degrees(program.mesh, sizes) if sizes else None
    if degrees is None:
        return []
    ep, efsdp = degrees
    ag = rs = 0
    precision = op.policy.precision
    for name, dim in op.experts:
        info = graph.params[name]
        per_rank = shard_numel((info.shape[0] // ep, *info.shape[1:]), efsdp, dim)
        ag += per_rank * efsdp * _itemsize(precision.compute_dtype(info.dtype))
        if info.requires_grad:
            rs += per_rank * efsdp * _itemsize(precision.reduce(info.dtype))
    cs = []
    if efsdp > 1:
        cs.append(Collective("all_gather", "efsdp", efsdp, ag, "forward", "params"))
        if reshard_group(op.policy.reshard_after_forward, efsdp) == efsdp:
            cs.append(Collective("all_gather", "efsdp", efsdp, ag, "backward", "params"))
        if rs:
            cs.append(Collective("reduce_scatter", "efsdp", efsdp, rs, "backward", "grads"))
    if rs and replicate > 1:
        cs.append(Collective("all_reduce", "replicate", replicate, rs // efsdp, "backward", "grads"))
    return cs


def expert_collectives(program: Program, graph, world: int, tokens: int, top_k: int,
                       dim: int, routing=None) -> dict[str, list[Collective]]:
    """Each expert-parallel container's all-to-alls for one microbatch of `tokens` tokens per rank,
    each routed to `top_k` experts, rows `dim` wide, on the expert axis (balanced routing: a rank
    sends and receives `tokens x top_k` rows in all): forward the dispatch and the combine, backward
    their gradients the same way back; bytes the input's (nccl-tests' convention), in the compute
    dtype of the unit that holds the container. Not counted: the exchange of the per-expert counts
    (`experts` int64 values, one all-to-all per dispatch, a blocking host sync).

    With a measured `routing` histogram (`planc/estimate/routing.py`) the dispatch still sends the
    rank's `tokens x top_k` rows, and the combine (forward) and the dispatch's gradient (backward)
    send back the rows the estimated (binding) expert rank received in that layer.

    With a context axis (`AttendOverContext` ops) `tokens` is the batch its context group shares:
    each rank routes its own sequence shard, `tokens / context` of them. Under a checkpointed
    ancestor the recompute issues the forward's two all-to-alls again in the backward.

    With a tensor axis (`op.tensor`) the MoE layer runs on its tensor rank's part of the tokens,
    `tokens / tensor` (the sequence-parallel form: `split_over_tensor`), and its dense parameters'
    gradients (router, shared experts) are all-reduced over the tensor axis in the backward, in
    their compute dtype. (A replicated input's cut and gather are not counted.)"""
    from planc.resolve.experts import expert_degrees
    sizes = program.mesh.sizes(world) or {}
    degrees = expert_degrees(program.mesh, sizes) if sizes else None
    out: dict[str, list[Collective]] = {}
    if degrees is None:
        return out
    ep, tp = degrees[0], sizes.get(Role.TENSOR, 1)
    cp = sizes.get(Role.CONTEXT, 1) if any(True for _ in program.of_type(AttendOverContext)) else 1
    dtypes = compute_dtypes(program, graph)
    ops = program.of_type(DispatchExperts)
    checkpointed = _ancestors_in({op.module for op in program.of_type(Checkpoint)}, [op.module for op in ops])
    for op in ops:
        rows = (tokens // tp if op.tensor is not None else tokens) // cp * top_k
        back = rows if routing is None else sum(map(sum, routing.received(op.module, ep, rows)))
        item = dim * _itemsize(dtypes[op.params[0]])
        # a checkpointed ancestor's recompute dispatches and combines again, in the backward
        again = ((rows, "backward"), (back, "backward")) if checkpointed.get(op.module) else ()
        out[op.module] = [Collective("all_to_all", op.axis, ep, n * item, phase, op.module)
                          for n, phase in ((rows, "forward"), (back, "forward"), (rows, "backward"), (back, "backward"))
                          + again]
        if op.tensor is not None:
            inside = set(op.params)
            dense = [n for n in sorted(graph.subtree_params(op.layer)) if n not in inside]
            out[op.module] += [Collective("all_reduce", op.tensor, tp, graph.params[n].numel * _itemsize(dtypes[n]),
                                          "backward", op.layer) for n in dense]
    return out


class RoutingUnknown(ValueError):
    """An expert-parallel container whose routing (`top_k`, the rows' width) the step-time model cannot read."""


def routing_of(graph, path: str) -> tuple[int, int]:
    """(top_k, the rows' width) of the experts container at `path`, read from the model: `top_k` from
    its MoE layer (`router.top_k`, planc.zoo's routed MoE; `top_k` or `gate.top_k` as Hugging Face's
    Mixtral and Qwen3-MoE name it), the width from the sorted layout's `w1` `[experts, hidden, dim]`
    or Hugging Face's experts' `hidden_dim`. Raises `RoutingUnknown` saying what it looked for."""
    model = graph.model
    experts = model.get_submodule(path) if model is not None else None
    moe = model.get_submodule(path.rpartition(".")[0]) if model is not None else None
    found = [getattr(m, "top_k", None) for m in (getattr(moe, "router", None), moe, getattr(moe, "gate", None))]
    top_k = next((k for k in found if isinstance(k, int)), None)
    width = graph.params[f"{path}.w1"].shape[-1] if f"{path}.w1" in graph.params else getattr(experts, "hidden_dim", None)
    if top_k is None or not isinstance(width, int):
        missing = " and ".join(w for w, v in (("top_k (`router.top_k`, `top_k` or `gate.top_k` on its MoE layer)", top_k),
                                               ("the rows' width (`w1` [experts, hidden, dim] or `hidden_dim` on the "
                                                "experts)", width)) if not isinstance(v, int))
        raise RoutingUnknown(f"{path}: the step-time model cannot read its routing: no {missing}")
    return top_k, width


def expert_all_to_alls(program: Program, graph, world: int, tokens: int,
                       routing=None) -> dict[str, list[Collective]]:
    """`expert_collectives` with each container's routing read from the model (`routing_of`) and
    `routing` as `expert_collectives`': raises `RoutingUnknown` for a container whose routing it
    cannot read."""
    out: dict[str, list[Collective]] = {}
    for op in program.of_type(DispatchExperts):
        top_k, width = routing_of(graph, op.module)
        out[op.module] = expert_collectives(program, graph, world, tokens, top_k, width, routing)[op.module]
    return out


def _times(c: Collective, schedule: Schedule | None) -> int:
    """How often one step runs `c`: a gradient reduction once per reducing backward, the rest
    once per microbatch."""
    if schedule is None:
        return 1
    if c.what == "grads":
        return sum(1 for a in schedule.actions[0] if schedule.reduces(a))
    return schedule.microbatches


def totals(units: Iterable) -> dict[str, dict[str, int]]:
    """Bytes per collective kind per mesh axis, over the step (`units`: anything with `.collectives`, e.g. `UnitTime`)."""
    out: dict[str, dict[str, int]] = {}
    for u in units:
        for c in u.collectives:
            out.setdefault(c.kind, {}).setdefault(c.axis, 0)
            out[c.kind][c.axis] += c.bytes * c.times
    return out


# ===================================================================== context parallelism


def context_collectives(program: Program, profile, world: int) -> dict[str, list[Collective]]:
    """Module path -> the collectives its `context` style issues on one context rank (the runtime's,
    `planc/backends/context.py`), per SDPA call the profile saw under the module.

    The profile is the whole sequence's step (one data-parallel batch), so each call's key and
    value there are the gathered ones, as the runtime gathers them: before a grouped-query
    repeat of their heads (`n_kv_heads`, the local ones under tensor parallelism; the repeat
    runs after the gather). Forward: an all-gather of the keys and one of the values (B x H_kv
    x S x D each); backward: a reduce-scatter of each of their gradients (the input: the whole
    sequence's gradient; each rank receives its own chunks, summed). A checkpointed ancestor
    reruns the forward gathers in backward.
    """
    sizes = program.mesh.sizes(world) or {}
    cp = sizes.get("context", 1)
    ops = program.of_type(AttendOverContext)
    if cp <= 1 or not ops or profile is None:
        return {}
    stride = sizes.get("tensor", 1)  # the context axis sits outside the tensor axis
    checkpointed = _ancestors_in({op.module for op in program.of_type(Checkpoint)}, [op.module for op in ops])
    out: dict[str, list[Collective]] = {}
    for op in ops:
        prefix = op.module + "."
        calls = [kv for path, kvs in profile.attention.items() if path == op.module or path.startswith(prefix)
                 for kv in kvs]
        cs: list[Collective] = []
        for key, value in calls:
            forward = [Collective("all_gather", "context", cp, t.numel * _itemsize(t.dtype), "forward", op.module,
                                  stride, side="input") for t in (key, value)]
            cs += forward
            cs += [Collective("reduce_scatter", "context", cp, t.numel * _itemsize(t.dtype), "backward", op.module,
                              stride) for t in (key, value) if t.requires_grad]
            if checkpointed.get(op.module):
                cs += [dataclasses.replace(c, phase="backward", what=f"{op.module} (recompute)") for c in forward]
        out[op.module] = cs
    return out


# ===================================================================== tensor parallelism


def tp_collectives(program: Program, graph, profile, world: int, cp: int = 1) -> dict[str, list[Collective]]:
    """Module path -> the activation collectives its tensor-parallel style issues (torch 2.13 DTensor).

    With `cp` > 1 (context parallelism cuts each batch's sequence) a rank's activations are 1/cp
    of the profile's (the whole sequence's): their collectives' bytes are divided by cp.

    Modelled (sizes are the full activation, nccl-tests' convention; shapes from the profile):

    * colwise: input `replicate` (default): backward all-reduce of the input's gradient (a
      partial sum); input `shard(d)` (sequence parallel): forward all-gather of the input,
      backward reduce-scatter of its gradient; output `replicate`: forward all-gather of the
      output (the default `shard(-1)` costs nothing).
    * rowwise: output `replicate` (default): forward all-reduce of the output; output
      `shard(d)`: forward reduce-scatter of the output, backward all-gather of its gradient;
      a `replicate` floating-point input: backward all-gather of its gradient.
    * sequence: backward all-reduce of the parameters' gradients (partial over the sequence
      shards; torch issues it in the owning FSDP unit's post-backward).
    * prepare_input / prepare with a first input `replicate` desired `shard(d)`: a local slice
      forward, backward all-gather of its gradient.
    * prepare_input / prepare with a first input `shard(d)` desired `replicate`: forward
      all-gather of the input; backward reduce-scatter of its (partial) gradient unless
      `local_output true`. A colwise module under such a prepare (its input arrives as a
      DTensor) leaves the reduction to the prepare: no all-reduce of its own.
    * replicate, prepare_output, other prepare layouts: nothing (inputs assumed already in the
      layout the style expects).
    """
    sizes = program.mesh.sizes(world) or {}
    tp = sizes.get("tensor", 1)
    ops = program.of_type(Parallelize)
    if tp <= 1 or not ops or profile is None:
        return {}
    compute = compute_dtypes(program, graph)
    out: dict[str, list[Collective]] = {}
    # modules whose inputs arrive as DTensors from a `prepare_input`/`prepare` above them:
    # a colwise module there leaves its input gradient partial for the prepare to reduce
    dtensor_in = [op.module for op in ops if STYLES[op.style.kind].prepares_input and op.style.use_local_output is not True]
    above = _ancestors_in(dtensor_in, [op.module for op in ops])

    def under_prepare(path: str) -> bool:
        return any(m != path for m in above[path])

    for op in ops:
        style, path, row = op.style, op.module, STYLES[op.style.kind]
        cs: list[Collective] = []
        dtype = _module_dtype(graph, path, compute)
        inp, outp = profile.inputs.get(path), profile.outputs.get(path)
        size = _itemsize(dtype)

        def nbytes(a, size=size) -> int:
            return a.numel * size // cp if a is not None else 0
        in_layout = (style.input_layouts or (None,))[0]
        out_layout = (style.output_layouts or (None,))[0]
        if row.splits == OUT:  # colwise
            if inp is not None and inp.dtype.is_floating_point:
                if in_layout is not None and in_layout.kind == "shard":
                    cs.append(Collective("all_gather", "tensor", tp, nbytes(inp), "forward", path, side="input"))
                    if inp.requires_grad:
                        cs.append(Collective("reduce_scatter", "tensor", tp, nbytes(inp), "backward", path))
                elif inp.requires_grad and not under_prepare(path):
                    cs.append(Collective("all_reduce", "tensor", tp, nbytes(inp), "backward", path))
            if out_layout is not None and out_layout.kind == "replicate":
                cs.append(Collective("all_gather", "tensor", tp, nbytes(outp), "forward", path, side="output"))
        elif row.splits == IN:  # rowwise
            if out_layout is None or out_layout.kind == "replicate":
                cs.append(Collective("all_reduce", "tensor", tp, nbytes(outp), "forward", path, side="output"))
            elif out_layout.kind == "shard":
                cs.append(Collective("reduce_scatter", "tensor", tp, nbytes(outp), "forward", path, side="output"))
                cs.append(Collective("all_gather", "tensor", tp, nbytes(outp), "backward", path))
            if in_layout is not None and in_layout.kind == "replicate" and inp is not None \
                    and inp.dtype.is_floating_point and inp.requires_grad:
                cs.append(Collective("all_gather", "tensor", tp, nbytes(inp), "backward", path))
        elif row.prepares_input:
            desired = (style.desired_input_layouts or (None,))[0]
            if in_layout is not None and in_layout.kind == "shard" and desired is not None \
                    and desired.kind == "replicate" and inp is not None and inp.dtype.is_floating_point:
                cs.append(Collective("all_gather", "tensor", tp, nbytes(inp), "forward", path, side="input"))
                if inp.requires_grad and style.use_local_output is not True:
                    cs.append(Collective("reduce_scatter", "tensor", tp, nbytes(inp), "backward", path))
            elif (in_layout is None or in_layout.kind == "replicate") and desired is not None \
                    and desired.kind == "shard" and inp is not None and inp.dtype.is_floating_point and inp.requires_grad:
                # replicate -> shard(d) is a local slice forward; its gradient is gathered back in backward
                cs.append(Collective("all_gather", "tensor", tp, nbytes(inp), "backward", path))
        elif row.reduces_grad:  # sequence: the whole weights' gradients summed over the tensor axis
            for _, canon in graph.own_params(path):
                info = graph.params[canon]
                if info.requires_grad:
                    cs.append(Collective("all_reduce", "tensor", tp, info.numel * _itemsize(compute[canon]),
                                         "backward", path))
        out[path] = [c for c in cs if c.bytes]
    return out


def recompute_collectives(program: Program, profile, tp_cs: dict[str, list[Collective]]) -> dict[str, list[Collective]]:
    """Module path -> the forward TP collectives a checkpointed ancestor's recompute issues again.

    Checkpoint reruns the module's forward in backward, DTensor redistributions included, up to
    its early stop (the last tensor its forward saved): an input-side collective reruns when its
    module starts before the stop, an output-side one when its module ends before it (a block's
    final reduce-scatter, feeding only a residual add, does not rerun).
    """
    out: dict[str, list[Collective]] = {}
    if profile is None or not tp_cs:
        return out
    modes = {op.module: op.mode for op in program.of_type(Checkpoint)}
    for path, marks in _ancestors_in(modes, tp_cs).items():
        cs = tp_cs[path]
        for m in marks:
            stop = profile.stops.get(m)
            if stop is None:
                continue
            start, end = profile.spans.get(path, (stop + 1, stop + 1))
            for c in cs:
                if c.phase == "forward" and ((c.side == "input" and start <= stop) or (c.side == "output" and end <= stop)):
                    out.setdefault(path, []).append(dataclasses.replace(c, phase="backward", what=f"{path} (recompute)"))
    return out


def _module_dtype(graph, path: str, compute: dict[str, torch.dtype]) -> torch.dtype:
    """The dtype a module computes in: its first parameter's compute dtype, or its subtree's first
    (a container such as an attention block), float32 without any."""
    own = list(graph.own_params(path))
    if own:
        return compute[own[0][1]]
    below = sorted(graph.subtree_params(path))
    return compute[below[0]] if below else torch.float32


def _ancestors_in(marked: Iterable[str], paths: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Each path -> the marked modules at or above it, outermost first."""
    marked = set(marked)
    out: dict[str, tuple[str, ...]] = {}
    for path in paths:
        chain, p = [], path
        while True:
            if p in marked:
                chain.append(p)
            if not p:
                break
            p = p.rpartition(".")[0]
        out[path] = tuple(reversed(chain))
    return out


@dataclass
class _Net:
    """One network: collectives run one at a time in the order they are issued."""

    free: float = 0.0
    busy: float = 0.0

    def run(self, ready: float, seconds: float) -> float:
        start = max(self.free, ready)
        self.free = start + seconds
        self.busy += seconds
        return self.free


def collective_s(c: Collective, hw: Hardware) -> float:
    if c.kind == "host_to_device" or c.kind == "device_to_host":
        return c.bytes / hw.host_bw
    return hw.link(c.ranks * c.stride).collective_s(c.kind, c.bytes, c.ranks)
