"""One context rank's step on plain tensors: its sequence shard, its positions, and the K/V gathers as the runtime allocates them.

The activation trace (`planc/estimate/trace.py`) runs the model on fake tensors. Under context
parallelism (`ShardBatch`, `AttendOverContext`) a rank holds `seq / cp` tokens of every
sequence (two head-tail chunks) and calls the model with their global `positions=`; every
attention the plan styles gathers all ranks' keys and values. `shard_example` cuts a step's
example as `AppliedPlan.shard_batch` does; `emulate_context` hooks each styled attention so
that its causal SDPA runs the runtime's attention (`planc/backends/context.py`) with the
collectives replaced by local stand-ins that allocate what the real ones do on one rank:
the all-gather's `cp` receive buffers and their concatenation (keys, values and positions),
the backward's full-size gradient (an in-place all-reduce) of which the rank keeps a view.
The runtime is the reference; tests/test_context_memory_dist.py holds the two to the same
bytes (FSDPMemTracker on real gloo ranks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from planc.lower.job import ShardBatch
from planc.lower.program import AttendOverContext


def context_degree(job, world: int) -> int:
    """The context axis's size at `world` ranks when the job cuts batches along the sequence, else 1."""
    if not job.step_op(ShardBatch):
        return 1
    return (job.mesh.sizes(world) or {}).get("context", 1)


def sequence_shard(seq: int, cp: int) -> int:
    """Tokens of a `seq`-long sequence one of `cp` context ranks holds (two chunks of `2 x cp`)."""
    if seq % (2 * cp):
        raise ValueError(f"sequence length {seq} does not divide into 2 x context = {2 * cp} chunks")
    return seq // cp


def shard_example(example, op: ShardBatch, cp: int):
    """`example` (tokens `(batch, seq)` first) as one context rank's: its tokens' share of the
    sequence (`cp` > 1) and `positions=` (`seq / cp` int64 positions), as `shard_batch` gives them."""
    from planc.estimate.trace import Example
    if cp <= 1 or not example.args:
        return example
    dim = dict(op.tensors)["tokens"]
    tokens = example.args[0]
    local = sequence_shard(tokens.shape[dim], cp)
    shape = tuple(local if d == dim else n for d, n in enumerate(tokens.shape))
    sharded = torch.empty(shape, dtype=tokens.dtype, device=tokens.device)
    positions = torch.empty((local,), dtype=torch.long, device=tokens.device)
    return Example((sharded, *example.args[1:]), {**example.kwargs, "positions": positions})


def _gather(t: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """`_gather_plain`'s allocations: `cp` receive buffers, the contiguous input, their concatenation."""
    parts = [torch.empty_like(t) for _ in range(cp)]
    t.contiguous()
    return torch.cat(parts, dim)


class _GatherSequence(torch.autograd.Function):
    """The runtime's `_GatherSequence` on one rank: gather in forward; in backward the whole
    gradient made contiguous (then all-reduced in place) and a view of this rank's part."""

    @staticmethod
    def forward(ctx, t, dim, cp):
        ctx.dim, ctx.length = dim, t.shape[dim]
        return _gather(t, dim, cp)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous().narrow(ctx.dim, 0, ctx.length), None, None


def attention(q, k, v, positions, cp: int):
    """The runtime's `attention` (`planc/backends/context.py`) with local stand-ins for its collectives."""
    seq_dim = q.dim() - 2
    keys = _GatherSequence.apply(k, seq_dim, cp)
    values = _GatherSequence.apply(v, seq_dim, cp)
    key_positions = _gather(positions, 0, cp)
    scores = (q @ keys.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(positions[:, None] < key_positions[None, :], float("-inf"))
    return scores.softmax(-1) @ values


class _ContextSDPA(TorchFunctionMode):
    def __init__(self, positions, cp: int) -> None:
        super().__init__()
        self.positions, self.cp = positions, cp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return attention(*args[:3], self.positions, self.cp)
        return func(*args, **kwargs)


def emulate_context(model: torch.nn.Module, program, cp: int) -> list:
    """Hook every module an `AttendOverContext` op names so that its causal SDPA gathers K/V
    over `cp` ranks (allocations only); the hook handles."""
    handles = []
    for op in program.of_type(AttendOverContext):
        module = model.get_submodule(op.module)
        modes: list[_ContextSDPA] = []

        def enter(_module, args, kwargs, modes=modes):
            mode = _ContextSDPA(kwargs["positions"], cp)
            modes.append(mode)
            mode.__enter__()

        def leave(_module, args, kwargs, output, modes=modes):
            if modes:
                modes.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(module.register_forward_hook(leave, with_kwargs=True, always_call=True))
    return handles
