"""FSDP2's rules for one parameter and one unit, written once: what memory and time both read.

* the shape FSDP shards: a tensor-parallel parameter's local shard (`fsdp_shape`);
* the elements a rank keeps of it: FSDP2 pads the sharded dim to a multiple of the shard
  size (`shard_numel`; `Shard(d)` placements pad dim d instead of dim 0);
* the dtype each parameter computes in under its unit's precision (`compute_dtypes`);
* what `reshard_after_forward` does at a shard size (`reshard_group`): True (or a group at
  least the shard size) frees the unsharded parameters after forward and all-gathers again in
  backward over the whole shard axis; False keeps them; an int N keeps a copy sharded over N
  ranks (ZeRO++ hpZ) and re-gathers within groups of N;
* the optimizer's state per parameter (`optimizer_state_bytes`);
* which unit owns a module (`owners`), the root unit (`root_index`), and the unit FSDP2
  prefetches in backward when the plan lists none (`default_backward_prefetch`).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

STEP_COUNTER_BYTES = 4  # AdamW keeps a float32 `step` tensor per parameter


def fsdp_shape(shape: tuple[int, ...], tp_dim: int | None, tp: int) -> tuple[int, ...]:
    """The shape FSDP shards: the tensor-parallel local shard on `tp_dim` (ceil, as DTensor pads the last)."""
    if tp_dim is None or tp <= 1:
        return tuple(shape)
    return tuple(-(-n // tp) if d == tp_dim else n for d, n in enumerate(shape))


def shard_numel(shape: tuple[int, ...], shard: int, dim: int = 0) -> int:
    """Elements each rank stores for one parameter: FSDP2 pads `dim` to a multiple of `shard`."""
    if not shape:
        return 1
    rest = math.prod(shape) // shape[dim] if shape[dim] else 0
    return -(-shape[dim] // shard) * rest


def compute_dtypes(program, graph) -> dict[str, torch.dtype]:
    """Each parameter's compute dtype under the plan (its stored dtype outside any unit)."""
    out = {name: info.dtype for name, info in graph.params.items()}
    for op in program.units:
        for name in op.params:
            out[name] = op.policy.precision.compute_dtype(graph.params[name].dtype)
    return out


def reshard_group(reshard: bool | int, shard: int) -> int | None:
    """After forward: None keeps the unsharded parameters (`false`); otherwise the ranks the
    parameters stay sharded over until backward re-gathers them (`shard` for a full reshard)."""
    if reshard is False:
        return None
    if reshard is True or reshard >= shard:
        return shard
    return int(reshard)


def has_moments(optimizer: str) -> bool:
    """Adam and AdamW keep two states the size of the parameters (and a step counter)."""
    return optimizer.startswith("adam")


def optimizer_state_bytes(per_rank: int, dtype: torch.dtype, optimizer: str) -> int:
    """The optimizer's state for one parameter's local shard of `per_rank` elements."""
    if not has_moments(optimizer):
        return 0
    return 2 * per_rank * torch.empty((), dtype=dtype, device="meta").element_size() + STEP_COUNTER_BYTES


def root_index(units) -> int | None:
    """The index of the root unit (`fully_shard(model)`), or None for a plan with `root none`."""
    return next((i for i, u in enumerate(units) if u.is_root), None)


def unit_of_module(units) -> dict[str, int]:
    """Module path -> the index of the (non-root) unit that names it."""
    return {m: i for i, u in enumerate(units) if not u.is_root for m in u.modules}


def owners(units, paths: Iterable[str]) -> dict[str, int]:
    """Module path -> the index of the unit whose parameters it uses: the nearest unit module above
    it, else the root (without a root unit, `len(units)`: outside every unit)."""
    unit_of = unit_of_module(units)
    root = root_index(units)
    root = len(units) if root is None else root
    out: dict[str, int] = {}
    for path in paths:
        p = path
        while p not in unit_of and p:
            p = p.rpartition(".")[0]
        out[path] = unit_of.get(p, root)
    return out


def default_backward_prefetch(post_forward: Sequence[int], i: int, root: int | None) -> list[int]:
    """FSDP2's implicit backward prefetch: at unit i's pre-backward, the unit that ran its
    post-forward just before i's (backward runs in reverse post-forward order; the root never
    prefetched); at a unit outside that order (the root), the first unit of backward."""
    order = [j for j in reversed(post_forward) if j != root]
    return order[order.index(i) + 1:order.index(i) + 2] if i in order else order[:1]


def step_order(units, graph, profile) -> tuple[list[int], dict[int, int], list[int]]:
    """FSDP2's order of the units' pre-forwards and post-forwards, and the post-backwards it leaves
    to the end of backward, from a traced step (`StepProfile`: `order`, the module paths in
    first-forward order; `inputs`, each module's first floating-point input, with `requires_grad`;
    `spans`, its first forward's op range).

    1. A unit's pre-forward runs when its first module runs, FLOPs or not (an embedding); root first.
    2. Its post-forward runs when the last of its modules returns, after the units nested in it:
       unit -> its rank in that order (the root, last, left out).
    3. FSDP2 reduces a unit's gradients when autograd reaches the inputs of the first of its
       modules to run (`RegisterPostBackwardFunction`); a unit whose first module takes no input
       that needs a gradient (token ids: an embedding, the root) reduces in the root's final
       callback, after all backward compute, in its `all_states` order: the root first, then by
       module pre-order (without a trace: the root only).
    """
    root = root_index(units)
    if profile is None:
        return [], {}, [] if root is None else [root]
    executed, inputs, spans = profile.order, profile.inputs, profile.spans
    own = owners(units, executed)
    starts = list(dict.fromkeys(own[p] for p in executed))
    first: dict[int, str] = {}  # unit -> the first of its modules to run
    for p in executed:
        if own[p] < len(units) and own[p] not in first and p in units[own[p]].modules:
            first[own[p]] = p
    needs_grad = {i: getattr(inputs.get(p), "requires_grad", False) for i, p in first.items()}
    late = [i for i in range(len(units)) if i == root or not needs_grad.get(i, False)]
    late.sort(key=lambda i: (i != root, min(graph.pre(m) for m in units[i].modules)))
    ends = {i: max((spans[m][1], -spans[m][0], -graph.pre(m)) for m in u.modules if m in spans)
            for i, u in enumerate(units) if i != root and any(m in spans for m in u.modules)}
    return starts, {i: k for k, i in enumerate(sorted(ends, key=ends.get))}, late
