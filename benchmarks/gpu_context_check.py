"""Context parallelism's attention kernel on a GPU (where one is lent; CI has none): values and memory.

The runtime (`planc/backends/context.py`, `planc/model/context_attention.py`) runs each query
chunk of a head-tail shard as SDPA over its prefix of the gathered keys, causal aligned lower-right (`causal_prefix`: torch's
`causal_lower_right` on CUDA, an explicit boolean mask elsewhere). CPUs test the mask path; this
checks the CUDA path, in one process, with every context rank's share computed from the whole
q, k, v (no collectives: the gathers are the identity here):

1. values: the shards' outputs put back in order, and the gradients of q, k, v, equal plain causal
   SDPA over the whole sequence (fp32 and bf16, cp 2 and 4);
2. memory: one chunk's forward + backward through `causal_prefix` against the same shapes with
   `is_causal=True` (what planc's memory estimate traces for it) and with the explicit mask (the
   CPU path): `torch.cuda.max_memory_allocated` above the inputs.

    python3 benchmarks/gpu_context_check.py     # one line per check, then one JSON line
"""

from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from planc.backends.context import shard_positions  # noqa: E402
from planc.model.context_attention import causal_prefix  # noqa: E402


def values(cp: int, dtype: torch.dtype, seq: int = 1024, heads: int = 4, dim: int = 64) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, heads, seq, dim, device="cuda", dtype=dtype, generator=g).requires_grad_(True)
               for _ in range(3))
    weight = torch.randn(2, heads, seq, dim, device="cuda", dtype=dtype, generator=g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    chunk = seq // (2 * cp)
    out = torch.empty_like(ref)
    loss = 0
    for rank in range(cp):
        pos = shard_positions(seq, cp, rank).to("cuda")
        mine = q.index_select(2, pos)
        ends = ((rank + 1) * chunk, (2 * cp - rank) * chunk)
        part = torch.cat([causal_prefix(mine.narrow(2, i * chunk, chunk), k.narrow(2, 0, end), v.narrow(2, 0, end))
                          for i, end in enumerate(ends)], 2)
        out = out.index_copy(2, pos, part.detach())
        loss = loss + (part * weight.index_select(2, pos)).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    scale = ref.abs().max().item()
    return {"cp": cp, "dtype": str(dtype).replace("torch.", ""),
            "out_max_abs_diff": (out - ref).abs().max().item(), "out_scale": scale,
            "grad_max_abs_diff": max((a - b).abs().max().item() for a, b in zip(grads, ref_grads))}


def peak_above(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def memory(length: int = 4096, total: int = 65536, heads: int = 8, dim: int = 128) -> dict:
    """One tail chunk (L = length) over a prefix of `total` keys, bf16, forward + backward."""
    q = torch.randn(1, heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, heads, total, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    def run(kind):
        def step():
            if kind == "causal_prefix":
                out = causal_prefix(q, k, v)
            elif kind == "is_causal (the estimate's model)":
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                mask = torch.ones(length, total, dtype=torch.bool, device="cuda").tril(total - length)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out.sum().backward()
            q.grad = k.grad = v.grad = None
        step()  # warm-up
        return peak_above(step)
    return {kind: run(kind) for kind in ("causal_prefix", "is_causal (the estimate's model)", "explicit mask (CPU path)")}


def main() -> None:
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "values": [], "memory": None}
    for cp in (2, 4):
        for dtype in (torch.float32, torch.bfloat16):
            row = values(cp, dtype)
            out["values"].append(row)
            print(row, flush=True)
    out["memory"] = memory()
    print(out["memory"], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
