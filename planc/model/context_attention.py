"""One context rank's attention for the runtime and the estimate's trace: K/V gather, gradient reduce-scatter, causal chunks.

Context parallelism (`parallel SELECTOR context`) gives each rank two of the `2 x cp` chunks of
every sequence (chunk `r` and `2 cp - 1 - r`, "head-tail"). Inside a styled attention
`RouteAttention` (a `TorchFunctionMode`) takes over two calls:

* a grouped-query repeat of the keys or values (`t.repeat_interleave(r, dim=1)` on a 4-D
  `(batch, heads, seq, head_dim)` tensor): the `n_kv_heads` K/V are gathered over the context
  axis first (`Gather`), then repeated locally, so the gather moves and holds `n_kv_heads`
  heads, not `n_heads`;
* the causal `F.scaled_dot_product_attention`: K/V not gathered yet (no repeat) are gathered
  here; each query chunk attends to the prefix of keys up to its own end (`attend`).

`Gather`'s forward all-gathers every rank's shard into one `(cp, ...)` buffer and puts the
sequence in order; its backward copies the whole-sequence gradient into a `(cp, ...)` buffer,
rank by rank, and reduce-scatters it (each rank receives the sum of its own two chunks). What
moves the bytes is a `Comm`: `planc/backends/context.py` issues the collectives on a process
group, `planc/estimate/context_local.py` leaves the buffers as they are (fake tensors: the
allocations are what the memory trace needs), so both run this one code.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class Comm(Protocol):
    """The context axis as `Gather` sees it: its size, this rank, and the two collectives."""

    cp: int
    rank: int

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> None:
        """`out` (`(cp, *t.shape)`, contiguous) <- every rank's `t`, rank by rank."""

    def reduce_scatter(self, out: torch.Tensor, buf: torch.Tensor) -> None:
        """`out` <- the sum over ranks of `buf[rank]` (`buf`: `(cp, *out.shape)`, contiguous)."""


def in_order(parts, dim: int) -> torch.Tensor:
    """Every rank's head-tail shard (`parts[r]`: chunks `r` and `2cp - 1 - r`) as the whole sequence, in order."""
    cp = len(parts)
    chunk = parts[0].shape[dim] // 2
    return torch.cat([parts[j].narrow(dim, 0, chunk) if j < cp else parts[2 * cp - 1 - j].narrow(dim, chunk, chunk)
                      for j in range(2 * cp)], dim)


class Gather(torch.autograd.Function):
    """Forward: every rank's head-tail shard `t` gathered into the whole sequence, in order.
    Backward: the whole sequence's gradient reduce-scattered, this rank's two chunks summed over ranks."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, dim: int, comm: Comm):
        ctx.dim, ctx.comm, ctx.shape = dim, comm, t.shape
        buf = t.new_empty((comm.cp, *t.shape))
        comm.all_gather(buf, t.contiguous())
        return in_order(buf.unbind(0), dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dim, comm = ctx.dim, ctx.comm
        chunk = ctx.shape[dim] // 2
        buf = grad.new_empty((comm.cp, *ctx.shape))
        for r in range(comm.cp):  # rank r's chunks r and 2cp - 1 - r, next to each other
            for i, j in enumerate((r, 2 * comm.cp - 1 - r)):
                buf[r].narrow(dim, i * chunk, chunk).copy_(grad.narrow(dim, j * chunk, chunk))
        out = grad.new_empty(ctx.shape)
        comm.reduce_scatter(out, buf)
        return out, None, None


def causal_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cpu_mask: bool | None = None) -> torch.Tensor:
    """SDPA of `q` (the last `L` positions of a prefix) over the prefix's `k, v` (`S >= L`), causal
    aligned lower-right: query `i` sees keys up to `S - L + i`.

    With `cpu_mask` (default: off CUDA) SDPA gets the L x S boolean mask (its CPU kernel keeps a
    float copy for backward). Otherwise on GPU torch's `causal_lower_right` runs the flash / memory-efficient
    kernels (no mask, no score matrix); on fake tensors (the estimate's trace of the GPU path)
    SDPA runs causal on the same shapes, which allocates and saves what the fused kernel does.
    """
    length, total = q.shape[-2], k.shape[-2]
    if length == total:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if cpu_mask is None:
        cpu_mask = q.device.type != "cuda"
    if cpu_mask:
        mask = torch.ones(length, total, dtype=torch.bool, device=q.device).tril(total - length)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if q.device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(length, total))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cp: int, rank: int,
           cpu_mask: bool | None = None) -> torch.Tensor:
    """This rank's two query chunks (`q`: `(..., seq / cp, head_dim)`) over the gathered, ordered
    keys and values: the head chunk attends to `rank + 1` chunks of keys, the tail to `2 cp - rank`."""
    seq_dim = q.dim() - 2
    chunk = q.shape[seq_dim] // 2
    ends = ((rank + 1) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([causal_prefix(q.narrow(seq_dim, i * chunk, chunk), keys.narrow(seq_dim, 0, end),
                                    values.narrow(seq_dim, 0, end), cpu_mask) for i, end in enumerate(ends)], seq_dim)


_REPEATS = (torch.Tensor.repeat_interleave, torch.repeat_interleave)


def _kv_repeat(args, kwargs) -> tuple[torch.Tensor, int] | None:
    """`(t, repeats)` when the call is a grouped-query repeat: an int repeat of a 4-D tensor's head dim (1)."""
    t = args[0] if args else kwargs.get("input")
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    extra = set(kwargs) - {"input", "repeats", "dim"}
    if isinstance(t, torch.Tensor) and t.dim() == 4 and isinstance(repeats, int) and dim in (1, -3) and not extra:
        return t, repeats
    return None


class RecordKV(TorchFunctionMode):
    """Calls `on_attention(key, value)` at every SDPA call, with the keys and values as the
    context style gathers them: a grouped-query repeat's input in place of its output (the
    profile's record of what a context rank gathers, `planc/estimate/flops.py`). Runs every
    call unchanged, whatever the mask."""

    def __init__(self, on_attention: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        super().__init__()
        self.on_attention = on_attention
        self.sources: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a repeat's output, its input)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _REPEATS and (found := _kv_repeat(args, kwargs)) is not None:
            self.sources.append((out, found[0]))
        elif func is F.scaled_dot_product_attention:
            kv = (args[1] if len(args) > 1 else kwargs.get("key"), args[2] if len(args) > 2 else kwargs.get("value"))
            if all(isinstance(t, torch.Tensor) for t in kv):
                self.on_attention(*(next((src for o, src in self.sources if o is t), t) for t in kv))
            self.sources = []
        return out


class RouteAttention(TorchFunctionMode):
    """Inside one attention's forward: each grouped-query repeat of K/V runs on `gather(t)` (the
    gathered K/V heads, repeated locally), and causal SDPA runs `sdpa(q, keys, values)` on the
    gathered keys and values (gathered here when no repeat gathered them)."""

    def __init__(self, gather: Callable[[torch.Tensor], torch.Tensor],
                 sdpa: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.gather, self.sdpa = gather, sdpa
        self.repeated: list[torch.Tensor] = []  # repeats of gathered K/V not yet passed to SDPA

    def _is_repeated(self, t) -> bool:
        return any(t is r for r in self.repeated)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _REPEATS and (found := _kv_repeat(args, kwargs)) is not None:
            out = torch.repeat_interleave(self.gather(found[0]), found[1], dim=1)
            self.repeated.append(out)
            return out
        if func is F.scaled_dot_product_attention:
            others = {k: v for k, v in kwargs.items()
                      if k != "is_causal" and v is not None and not (isinstance(v, (bool, int, float)) and not v)}
            if not kwargs.get("is_causal") or others or len(args) != 3:  # a scale, dropout or mask would be dropped
                raise NotImplementedError("context parallelism supports causal attention without a mask, scale or "
                                          f"dropout only (got {sorted(others) or 'is_causal=False'})")
            q, k, v = args
            done = (self._is_repeated(k), self._is_repeated(v))
            if done[0] != done[1]:
                raise NotImplementedError("context parallelism: the keys and values are not repeated alike")
            self.repeated = [r for r in self.repeated if r is not k and r is not v]
            if self.repeated:
                raise NotImplementedError("context parallelism: a repeat of a 4-D tensor's heads inside the attention "
                                          "did not reach SDPA as its keys or values")
            keys, values = (k, v) if done[0] else (self.gather(k), self.gather(v))
            return self.sdpa(q, keys, values)
        return func(*args, **kwargs)


def route(comm: Comm, cpu_mask: bool | None = None) -> RouteAttention:
    """One styled attention's mode on `comm`'s context axis: K/V gathered (before any
    grouped-query repeat), each query chunk attended over its prefix (`causal_prefix`'s `cpu_mask`)."""
    def gather(t):
        return Gather.apply(t, t.dim() - 2, comm)

    def sdpa(q, keys, values):
        return attend(q, keys, values, comm.cp, comm.rank, cpu_mask)

    return RouteAttention(gather, sdpa)
