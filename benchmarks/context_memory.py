"""Benchmark: the activation reduction of context parallelism, estimated and measured.

The same plan with and without the context axis (zoo Llama tiny, fp32, FSDP over every rank):
`mesh (shard = *, context = 2)` + `parallel layers.*.attention context` against `mesh (shard = *)`
at the same world size and the same per-rank batch (2 x 64). Estimated: `planc.estimate.memory`
(one context rank's step traced: `seq / cp` tokens, the K/V gathered per layer, SDPA as the GPU
runs it; and the same trace of the CPU path, whose SDPA also keeps a float mask per chunk). Measured:
FSDPMemTracker on real gloo ranks (`planc.apply`, `applied.shard_batch`, the second of two AdamW
steps, FSDP's reduce-scatter as all-reduce + slice as NCCL allocates). Then estimates only for
a longer sequence (2 x 2048) at context 1, 2, 4, 8 on 8 ranks. Prints one line per case, then one JSON line.

    python benchmarks/context_memory.py           # measured at 2 and 4 ranks, estimates at 2 x 2048
    python benchmarks/context_memory.py --quick   # measured at 2 ranks only
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

import planc  # noqa: E402
from planc.estimate import memory  # noqa: E402
from planc.zoo import llama3  # noqa: E402

CONTEXT = "unit layers.*\nparallel layers.*.attention context\n"
PLANS = {  # (with context, without) at a world size
    2: ("mesh (shard = *, context = 2)\n" + CONTEXT, "mesh (shard = *)\nunit layers.*\n"),
    4: ("mesh (shard = 2, context = 2)\n" + CONTEXT, "mesh (shard = *)\nunit layers.*\n"),
}
SHAPE = (2, 64)


def _estimate(text: str, world: int, shape, cpu_rank: int | None = None) -> memory.Estimate:
    """The estimate (the GPU path), or with `cpu_rank` the trace of that context rank's CPU path."""
    from planc.estimate import context_local
    with torch.device("meta"):
        model = llama3.llama_tiny()
    context_local.CPU_RANK = cpu_rank
    try:
        return memory.estimate(planc.compile(planc.loads(text), model, world), world, input_shape=shape)
    finally:
        context_local.CPU_RANK = None


def measure(rank: int, world: int, plans: tuple[str, str]) -> dict:
    from context_memory_workers import PLANS as NAMED
    from context_memory_workers import measure as measure_named
    NAMED.update({"with": plans[0], "without": plans[1]})
    return measure_named(rank, world, ("with", "without"))


def main() -> None:
    from distributed import run

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    out: dict = {"benchmark": "context_memory", "shape": list(SHAPE), "rows": []}
    for world in (2,) if args.quick else (2, 4):
        with_cp, without = PLANS[world]
        real = run(measure, world, (with_cp, without))[0]
        est, base = _estimate(with_cp, world, SHAPE), _estimate(without, world, SHAPE)
        cpu = _estimate(with_cp, world, SHAPE, cpu_rank=0)  # rank 0's CPU path, as measured
        row = {"world": world, "plan": with_cp.splitlines()[0],
               "activations_estimated": est.activations, "activations_estimated_without": base.activations,
               "activations_measured": real["with"]["breakdown"]["activations"],
               "activations_measured_without": real["without"]["breakdown"]["activations"],
               "peak_estimated": est.peak.total, "peak_measured": real["with"]["peak"],
               "peak_estimated_without": base.peak.total, "peak_measured_without": real["without"]["peak"],
               "peak_cpu_path_traced": cpu.peak.total, "cpu_masks_bytes": cpu.peak.total - est.peak.total}
        row["activation_ratio_estimated"] = round(row["activations_estimated"] / row["activations_estimated_without"], 3)
        row["activation_ratio_measured"] = round(row["activations_measured"] / row["activations_measured_without"], 3)
        out["rows"].append(row)
        print(f"world {world} {row['plan']}: activations {row['activations_estimated']} (estimated) / "
              f"{row['activations_measured']} (measured) vs without context {row['activations_estimated_without']} / "
              f"{row['activations_measured_without']}; peak {row['peak_estimated']} / {row['peak_measured']}", flush=True)
    long = []
    if not args.quick:
        for cp in (1, 2, 4, 8):
            text = f"mesh (shard = *, context = {cp})\n" + CONTEXT if cp > 1 else "mesh (shard = *)\nunit layers.*\n"
            est = _estimate(text, 8, (2, 2048))
            long.append({"context": cp, "activations": est.activations, "peak": est.peak.total})
            print(f"8 ranks, 2 x 2048, context {cp}: activations {est.activations}, peak {est.peak.total}", flush=True)
        out["long_sequence_estimates"] = long
    out["activation_ratio_estimated"] = out["rows"][0]["activation_ratio_estimated"]
    out["activation_ratio_measured"] = out["rows"][0]["activation_ratio_measured"]
    # the CPU path's trace equals the measurement; the estimate (GPU path) is below by the CPU kernel's masks
    out["cpu_path_trace_equals_measured"] = all(r["peak_cpu_path_traced"] == r["peak_measured"] for r in out["rows"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
