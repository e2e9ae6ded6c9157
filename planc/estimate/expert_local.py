"""One expert rank's step on plain tensors: its local experts, and the token dispatch as the runtime allocates it.

Under expert parallelism (`DispatchExperts` ops) each rank of the expert axis keeps `experts /
expert` whole experts of every styled container, and the rows routed to an expert travel to its
rank and back by all-to-all with uneven splits (`planc/backends/experts.py`). The activation
trace (`planc/estimate/trace.py`) runs the model on fake tensors, so the split sizes the runtime
reads from the data (its one host sync) are not known: the trace assumes **balanced routing**:
every rank sends `rows / expert` of its `rows = tokens x top_k` routed rows to each expert rank,
and receives `rows x top_k / experts` rows for each of its local experts from each rank (so
`rows` in all, as many as it sent); or, when the compiled plan carries a measured routing
histogram (`planc/estimate/routing.py`), the rows its binding rank receives, per layer (its
sends are `rows` either way). `emulate_experts` gives each styled container its rank's
`[experts / expert, ...]` parameters and replaces its forward by the runtime's `exchange` with
local stand-ins for the collectives that allocate what the real ones do on one rank (the
all-to-all's output, forward and backward; the counts' exchange buffer), and the regrouping
(`expert_major`'s index tensors, the two `index_select`s, the `argsort` back) and the
`1 / expert` gradient scaling as the runtime runs them. The runtime is the reference:
tests/test_expert_memory_dist.py holds the estimate to FSDPMemTracker on real gloo ranks whose
routing is made balanced, tests/test_routing_dist.py on the router's own (skewed) routing.
"""

from __future__ import annotations

import torch
from torch import nn

from planc.lower.program import DispatchExperts
from planc.model.dispatch import GatherRows, ScaleGrad, TakeRows, expert_major, sorted_rows, token_choice
from planc.resolve.experts import SORTED, expert_degrees, layout

ROUTING = ("balanced routing: each rank sends tokens x top_k / expert rows to every expert rank "
           "and receives as many")


def expert_degree(program, world: int) -> int:
    """The expert axis's size at `world` ranks when the program dispatches experts, else 1."""
    if not program.of_type(DispatchExperts):
        return 1
    sizes = program.mesh.sizes(world)
    degrees = None if sizes is None else expert_degrees(program.mesh, sizes)
    return 1 if degrees is None else degrees[0]


def expert_fsdp_degree(program, world: int) -> int:
    """efsdp: the ranks the experts' FSDP shards over (`shard x context x tensor / expert`), 1 without experts."""
    sizes = program.mesh.sizes(world)
    degrees = None if sizes is None else expert_degrees(program.mesh, sizes)
    return 1 if degrees is None else degrees[1]


def routing_assumed(compiled, ep: int) -> str:
    """The routing the estimate of `compiled` assumes, in words: balanced, or its histogram's."""
    routing = getattr(compiled, "routing", None)
    return ROUTING if routing is None else routing.describe(ep)


def local_expert_shape(shape: tuple[int, ...], ep: int) -> tuple[int, ...]:
    """An expert parameter `[experts, ...]` as one of `ep` expert ranks keeps it."""
    return (shape[0] // ep, *shape[1:])


class _AllToAll(torch.autograd.Function):
    """`funcol.all_to_all_single_autograd` on one rank: an output of `sum(out_splits)` rows (its
    values unknown: the trace records bytes); backward the same with the splits reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_rows: int, in_rows: int) -> torch.Tensor:
        ctx.in_rows = in_rows
        return x.new_empty((out_rows, *x.shape[1:]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        return grad.new_empty((ctx.in_rows, *grad.shape[1:])), None, None



def _dispatch(module: nn.Module, ep: int, local: int, total: int, arriving=None):
    """The dispatched forward of either layout on one rank (`local` of `total` experts here): it
    receives as many rows as it sends (balanced), or `arriving(rows sent)` rows (a routing histogram)."""
    forward = module.forward

    def exchange(rows: torch.Tensor, counts: torch.Tensor, run) -> torch.Tensor:
        n = rows.shape[0]
        m = n if arriving is None else arriving(n)
        send = counts.view(ep, local).contiguous()
        received = torch.empty_like(send)  # the counts' all-to-all writes into it
        arrived = _AllToAll.apply(rows, m, n)
        order = expert_major(received, m)
        own = list(module._parameters.items())
        for key, p in own:
            module._parameters[key] = ScaleGrad.apply(p, 1.0 / ep)
        try:
            out = run(arrived.index_select(0, order), received.sum(0))
        finally:
            for key, p in own:
                module._parameters[key] = p
        back = out.index_select(0, torch.argsort(order))
        return _AllToAll.apply(back, n, m)

    if layout(module) == SORTED:
        return sorted_rows(forward, exchange)
    return token_choice(forward, exchange, total, local)


def emulate_experts(model: nn.Module, program, ep: int, tp: int = 1, routing=None) -> list:
    """Give every container a `DispatchExperts` op names its rank's `[experts / ep, ...]` parameters
    (fake, like the model's) and the dispatched forward on one rank (allocations only): balanced
    routing, or the rows `routing` (a `planc.estimate.routing.Routing`) says its estimated rank
    receives; either layout (`planc.resolve.experts.layout`: the zoo's sorted rows, Hugging Face's
    token choice); with a tensor axis (`tp`) each MoE layer as `split_over_tensor` runs it. Returns
    the hook to remove (the model is the trace's own copy: nothing else is put back)."""
    ops = list(program.of_type(DispatchExperts))
    tokens: list[int] = []  # the tokens of the traced input, each tensor rank's (`_split_over_tensor`)
    handles = []
    if tp > 1 and any(op.layer is not None for op in ops):
        handles.append(model.register_forward_pre_hook(_count_tokens(tokens), with_kwargs=True))
    for op in ops:
        module = model.get_submodule(op.module)
        local = op.experts // ep
        for name, p in list(module.named_parameters(recurse=False)):
            kept = p.detach().new_empty(local_expert_shape(tuple(p.shape), ep))
            module.register_parameter(name, nn.Parameter(kept, requires_grad=p.requires_grad))
        arriving = None if routing is None else \
            (lambda n, name=op.module: sum(map(sum, routing.received(name, ep, n))))
        module.forward = _dispatch(module, ep, local, op.experts, arriving)
        if hasattr(module, "num_experts"):  # Hugging Face's experts count their own (local) experts, as the runtime sets
            module.num_experts = local
        if op.layer is not None:
            _split_over_tensor(model.get_submodule(op.layer), module, tp, tokens)
    return handles


def _count_tokens(tokens: list[int]):
    """A forward pre-hook recording the tokens of the model's input (its first tensor: ids [B, S], or
    [B, S, ...] embeddings) into `tokens`."""

    def hook(module, args, kwargs):
        first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        if first is not None:
            tokens[:] = [first.numel() if first.dim() < 2 else first.shape[0] * first.shape[1]]
    return hook


def _nothing(parts, tensor) -> None:
    """The tensor group's all-gather on one rank: its output parts are allocated, nothing moves."""


def _split_over_tensor(layer: nn.Module, experts: nn.Module, tp: int, tokens: list[int]) -> None:
    """The runtime's `split_over_tensor` on one rank, under the tensor-local emulation. A
    sequence-parallel input is this rank's shard already (fewer rows than the traced input's
    tokens): the layer runs on it. A replicated one (every token of the input, each rank of the
    tensor group holding them all) is cut in `tp` parts and the outputs gathered, as the runtime's
    `TakeRows` and `GatherRows` allocate them (the all-gathers moving nothing). Either way the dense
    parameters' gradients are summed over the tensor group (a new tensor each, as the runtime's
    all-reduce of a copy)."""
    inside = {id(p) for p in experts.parameters()}
    dense = [(m, key) for m in layer.modules() for key, p in m._parameters.items() if p is not None and id(p) not in inside]
    forward = layer.forward

    def run(*args, **kwargs):
        own = [(m, key, m._parameters[key]) for m, key in dense]
        for m, key, p in own:
            m._parameters[key] = ScaleGrad.apply(p, 1.0)  # the gradient copied, as the runtime's all-reduce input
        try:
            return forward(*args, **kwargs)
        finally:
            for m, key, p in own:
                m._parameters[key] = p

    def split(x: torch.Tensor, *args, **kwargs):
        rows = x.reshape(-1, x.shape[-1])
        if not tokens or rows.shape[0] != tokens[0] or rows.shape[0] % tp:
            return run(x, *args, **kwargs)  # sequence parallel: this rank's shard
        mine = TakeRows.apply(rows, _nothing, 0, tp)
        out = run(mine.unsqueeze(0), *args, **kwargs)
        return GatherRows.apply(out.reshape(mine.shape), _nothing, 0, tp).view_as(x)

    layer.forward = split


__all__ = ["ROUTING", "emulate_experts", "routing_assumed", "expert_degree", "expert_fsdp_degree", "local_expert_shape"]
