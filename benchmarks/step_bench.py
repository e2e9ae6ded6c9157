"""Benchmark: training-step time of a plan-applied model over the hand-written equivalent.

On 2 gloo ranks (CPU mesh), one process group holds two copies of a small seed transformer
built from the same seed: one sharded by `planc.apply(model, "plans/torchtitan.plan")`, one by
torchtitan's `apply_fsdp` written by hand (`tests/proof_workers.torchtitan_fsdp`). Both take
AdamW steps on the same batches; steps alternate between the two (which one goes first flips
every step) so that machine load hits both alike. Each step (forward, backward, optimizer) is
timed after a barrier, on the slower rank. planc adds nothing at run time -- it only decides
the `fully_shard` arguments -- so the expected ratio is 1.00 within noise, and the losses must
be bitwise equal.

Usage (from the repository root):

    python benchmarks/step_bench.py           # dim 256, 4 blocks, batch 4 x 128, 30 steps
    python benchmarks/step_bench.py --quick   # the zoo's tiny config, 10 steps

The last line printed is a JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import planc  # noqa: E402
from planc import zoo  # noqa: E402
from tests.distributed import run  # noqa: E402
from tests.proof_workers import TORCHTITAN_PLAN, torchtitan_fsdp  # noqa: E402

SMALL = zoo.SeedConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=8)
WARMUP = 2


class Trainer:
    """One sharded model with its AdamW optimizer; `step` times one training step."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        self.losses: list[float] = []
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def step(self, tokens: torch.Tensor) -> None:
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        value = loss.item()  # waits for the step to finish
        self.wall.append(time.perf_counter() - wall)
        self.cpu.append(time.process_time() - cpu)
        self.losses.append(value)


def bench_worker(rank: int, world_size: int, config: zoo.SeedConfig, steps: int, batch: int, seq: int) -> dict:
    """Per rank: interleaved steps of the planc-sharded and the hand-sharded model."""
    torch.manual_seed(0)
    planned = zoo.seed_transformer(config)
    planc.apply(planned, TORCHTITAN_PLAN)
    torch.manual_seed(0)
    by_hand = zoo.seed_transformer(config)
    torchtitan_fsdp(by_hand, init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",)))
    trainers = {"planc": Trainer(planned), "by_hand": Trainer(by_hand)}

    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data, same for both
    for k in range(WARMUP + steps):
        tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=gen)
        order = ("planc", "by_hand") if k % 2 == 0 else ("by_hand", "planc")
        for side in order:
            trainers[side].step(tokens)
    return {side: {"losses": t.losses, "wall": t.wall[WARMUP:], "cpu": t.cpu[WARMUP:]}
            for side, t in trainers.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 10 steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 30; quick 10)")
    args = parser.parse_args(argv)
    config = zoo.SEED_TINY_CONFIG if args.quick else SMALL
    steps = args.steps or (10 if args.quick else 30)
    batch, seq = (2, 16) if args.quick else (4, 128)
    world = 2

    wall = time.perf_counter()
    ranks = run(bench_worker, world, config, steps, batch, seq, timeout=3600)
    wall = time.perf_counter() - wall

    def slowest(side: str, kind: str) -> list[float]:
        return [max(r[side][kind][k] for r in ranks) for k in range(steps)]

    planc_wall, hand_wall = slowest("planc", "wall"), slowest("by_hand", "wall")
    planc_cpu, hand_cpu = slowest("planc", "cpu"), slowest("by_hand", "cpu")
    ratios = [p / h for p, h in zip(planc_wall, hand_wall)]
    cpu_ratios = [p / h for p, h in zip(planc_cpu, hand_cpu)]
    bitwise = all(r["planc"]["losses"] == r["by_hand"]["losses"] for r in ranks)
    params = sum(p.numel() for p in zoo.seed_transformer(config).parameters())
    for k in range(steps):
        print(f"step {k}: wall planc {planc_wall[k] * 1e3:7.1f} ms, by hand {hand_wall[k] * 1e3:7.1f} ms, "
              f"ratio {ratios[k]:.3f} | CPU ratio {cpu_ratios[k]:.3f}")
    print("rank 0 losses (planc):  ", ranks[0]["planc"]["losses"])
    print("rank 0 losses (by hand):", ranks[0]["by_hand"]["losses"])
    result = {
        "benchmark": "step", "model": f"seed_transformer({config})", "params": params,
        "plan": os.path.relpath(TORCHTITAN_PLAN, ROOT), "world_size": world, "backend": "gloo",
        "batch_per_rank": batch, "seq": seq, "steps": steps, "warmup": WARMUP, "quick": args.quick,
        "planc_step_ms_median": round(statistics.median(planc_wall) * 1e3, 2),
        "hand_written_step_ms_median": round(statistics.median(hand_wall) * 1e3, 2),
        "ratio_median": round(statistics.median(ratios), 4),
        "ratio_of_medians": round(statistics.median(planc_wall) / statistics.median(hand_wall), 4),
        "cpu_ratio_median": round(statistics.median(cpu_ratios), 4),
        "losses_bitwise_equal": bitwise, "target": "1.00 +- noise", "wall_s": round(wall, 1),
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
