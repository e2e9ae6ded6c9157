"""One context rank's step on plain tensors: its sequence shard, its positions, and the K/V gathers as the runtime allocates them.

The activation trace (`planc/estimate/trace.py`) runs the model on fake tensors. Under context
parallelism (`ShardBatch`, `AttendOverContext`) a rank holds `seq / cp` tokens of every
sequence (two head-tail chunks) and calls the model with their global `positions=`; every
attention the plan styles gathers all ranks' keys and values. `shard_example` cuts a step's
example as `AppliedPlan.shard_batch` does; `emulate_context` hooks each styled attention so
that its causal SDPA runs the runtime's attention (`planc/backends/context.py`) with the
collectives replaced by local stand-ins that allocate what the real ones do on one rank:
the all-gather's `cp` receive buffers and the whole sequence put in order (keys, values), the
backward's full-size gradient (an in-place all-reduce) and the rank's two chunks copied out of
it; each query chunk's SDPA over its prefix of keys as the GPU runs it (`causal_lower_right`,
no mask). The runtime is the reference: tests/test_context_memory_dist.py holds the CPU path's
trace (`CPU_RANK`) to FSDPMemTracker on real gloo ranks byte for byte, and the estimate to it
less exactly the CPU kernel's masks.
"""

from __future__ import annotations

import torch

from planc.lower.job import ShardBatch
from planc.lower.program import AttendOverContext
from planc.model.context_attention import RouteAttention, route


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


class _Local:
    """The context axis as one rank's trace sees it (`Comm`): the collectives leave their
    buffers as they are (fake tensors: the allocations are what the trace measures)."""

    def __init__(self, cp: int, rank: int) -> None:
        self.cp, self.rank = cp, rank

    def all_gather(self, out, t) -> None:
        pass

    def reduce_scatter(self, out, buf) -> None:
        pass


# None: model the GPU path (what planc estimates). A rank: model that context rank's CPU path
# instead, for comparisons with gloo runs (tests/test_context_memory_dist.py): SDPA's CPU kernel
# takes an L x S boolean mask for each chunk that does not end its prefix's diagonal and keeps
# a float copy of it for backward, which the GPU's `causal_lower_right` never builds.
CPU_RANK: int | None = None


def emulate_context(model: torch.nn.Module, program, cp: int, prefix: str = "") -> list:
    """Hook every module an `AttendOverContext` op names so that it gathers K/V over `cp` ranks as
    the runtime does (rank 0, or `CPU_RANK` on its CPU path; allocations only); the hook handles.
    With `prefix`, `model` is the module at that path (one block run alone, as `planc suggest`
    profiles it): only the ops inside it."""
    handles = []
    for op in program.of_type(AttendOverContext):
        if prefix and op.module != prefix and not op.module.startswith(prefix + "."):
            continue
        module = model.get_submodule(op.module[len(prefix) + 1:] if prefix else op.module)
        modes: list[RouteAttention] = []

        def enter(_module, args, kwargs, modes=modes):
            mode = route(_Local(cp, CPU_RANK or 0), cpu_mask=CPU_RANK is not None)
            modes.append(mode)
            mode.__enter__()

        def leave(_module, args, kwargs, output, modes=modes):
            if modes:
                modes.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(module.register_forward_hook(leave, with_kwargs=True, always_call=True))
    return handles
