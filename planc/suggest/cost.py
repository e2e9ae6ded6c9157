"""PROVISIONAL step-time cost of a lowered program, for `planc suggest` to minimise.

    cost(program, context) -> seconds

This is a stand-in until the step-time model of issue 11 (`planc.estimate.time`) lands; it
will be replaced by that model behind the same signature (the search calls nothing else).
It is deliberately simple and says so:

* compute: 6 * N * T FLOPs per unit (N parameters, T tokens per rank; 2NT forward, 4NT
  backward; attention's own FLOPs and embedding lookups are not counted), at the profile's
  peak dense bf16 rate times a stated efficiency; `full` checkpointing recomputes the
  forward (+2NT), `selective` recomputes the non-matmul ops, charged as the bytes of the
  activations it drops read and written once at HBM bandwidth (`context.dropped_bytes`);
* communication, ring alpha-beta per collective: the all-gather of each unit in forward,
  again in backward when resharded (`N`: within N ranks, on the intra-node link), its
  reduce-scatter in the reduce dtype, and with HSDP an all-reduce of the sharded gradient
  over the replicas; a group larger than one node uses the inter-node bandwidth;
* overlap: a unit's collectives hide behind its own compute when prefetched (backward is
  always prefetched, FSDP2's implicit prefetch; forward only with `prefetch forward`),
  else they add up; offloaded units pay host<->device copies (parameters in forward and
  backward, gradients back) over PCIe and a host optimizer step, unoverlapped.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from planc.lower.program import Checkpoint, FullyShard, Program, SetPrefetch


@dataclass(frozen=True)
class Hardware:
    """A provisional hardware profile (vendor peak numbers; `efficiency` is applied to FLOPs)."""

    name: str
    bf16_flops: float          # dense bf16 FLOP/s per GPU
    hbm_bandwidth: float       # bytes/s
    intra_bandwidth: float     # bytes/s per GPU, within a node (NVLink bus bandwidth)
    inter_bandwidth: float     # bytes/s per GPU, across nodes (one NIC per GPU)
    gpus_per_node: int = 8
    latency: float = 10e-6     # alpha per ring step, seconds
    pcie_bandwidth: float = 25e9
    host_optimizer_bandwidth: float = 50e9
    efficiency: float = 0.5    # achievable fraction of peak FLOPs, stated


HARDWARE: dict[str, Hardware] = {
    # NVIDIA data sheets (dense bf16, HBM); NVLink 4 450 GB/s/direction, 400 Gb/s NICs (50 GB/s)
    "h100": Hardware("h100", 989e12, 3.35e12, 450e9, 50e9),
    "h200": Hardware("h200", 989e12, 4.8e12, 450e9, 50e9),
    "a100": Hardware("a100", 312e12, 2.0e12, 300e9, 25e9),
    "b200": Hardware("b200", 2250e12, 8.0e12, 900e9, 50e9),
}


@dataclass
class CostContext:
    """What a cost needs besides the program: the model graph, ranks, tokens, hardware."""

    graph: object
    world: int
    tokens: int                        # tokens per rank per step (batch x sequence)
    hardware: Hardware
    dropped_bytes: dict[str, int] = field(default_factory=dict)  # module -> activation bytes `selective` recomputes


def _ring(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


@functools.lru_cache(maxsize=None)
def _itemsize(dtype) -> int:
    import torch
    return torch.empty((), dtype=dtype, device="meta").element_size()


def unit_costs(program: Program, context: CostContext) -> dict[str, float]:
    """Seconds per unit (the provisional model above); `cost` is their sum."""
    hw, graph = context.hardware, context.graph
    replicate, shard = program.mesh.dp_sizes(context.world) or (1, context.world)
    bw_shard = hw.intra_bandwidth if shard <= hw.gpus_per_node else hw.inter_bandwidth
    # a unit is prefetched in forward when a unit before it lists it
    prefetched = {t for op in program.of_type(SetPrefetch) if op.direction == "forward" for t in op.targets}
    ckpt = {op.module: op.mode for op in program.of_type(Checkpoint)}
    flops = hw.bf16_flops * hw.efficiency
    out: dict[str, float] = {}
    for op in program.units:
        op: FullyShard
        n = sum(graph.params[p].numel for p in op.params)
        pdt_size = rdt_size = 4
        if op.params:
            stored = graph.params[op.params[0]].dtype
            pdt_size = _itemsize(op.policy.precision.compute_dtype(stored))
            rdt_size = _itemsize(op.policy.precision.reduce(stored))
        dense = sum(graph.params[p].numel for p in op.params if len(graph.params[p].shape) >= 2
                    and not graph.cls(p.rpartition(".")[0]).endswith("Embedding"))
        fwd = 2 * dense * context.tokens / flops
        bwd = 4 * dense * context.tokens / flops
        for m in () if op.is_root else op.modules:
            mode = next((ckpt[c] for c in ckpt if c == m or c.startswith(m + ".")), None)
            if mode == "full":
                bwd += 2 * sum(graph.params[p].numel for p in graph.subtree_params(m) if p in op.params
                               and len(graph.params[p].shape) >= 2) * context.tokens / flops
            elif mode == "selective":
                bwd += 2 * context.dropped_bytes.get(m, 0) / hw.hbm_bandwidth
        gathered = n * pdt_size
        ag = _ring(gathered, shard, bw_shard, hw.latency)
        reshard = op.policy.reshard_after_forward
        if reshard is True:
            ag_bwd = ag
        elif reshard is False:
            ag_bwd = 0.0
        else:
            ag_bwd = _ring(gathered * int(reshard) / max(shard, 1), int(reshard), hw.intra_bandwidth, hw.latency)
        rs = _ring(n * rdt_size, shard, bw_shard, hw.latency)
        ar = 2 * _ring(math.ceil(n / shard) * rdt_size, replicate, hw.inter_bandwidth, hw.latency)
        if op.name in prefetched:
            t_fwd = max(fwd, ag)
        else:
            t_fwd = fwd + ag
        t_bwd = max(bwd, ag_bwd + rs + ar)
        host = 0.0
        if op.policy.offload.enabled:
            sharded = math.ceil(n / shard) * 4
            host = (sharded * (2 if reshard is not False else 1) + sharded) / hw.pcie_bandwidth \
                + 4 * sharded / hw.host_optimizer_bandwidth
        out[op.name] = t_fwd + t_bwd + host
    return out


def cost(program: Program, context: CostContext) -> float:
    """Estimated seconds of one training step of `program` (PROVISIONAL; see the module docstring)."""
    return sum(unit_costs(program, context).values())
