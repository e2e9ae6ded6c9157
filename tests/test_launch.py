"""The local gloo launcher (planc/analysis/launch.py) that `check --verify` and the multi-process tests use.

Real processes, real collectives: results come back per rank; a rank's exception, and a hang
past the timeout, come back as a `LaunchError` saying which rank and what.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from planc.analysis.launch import LaunchError, launch


def _sum_ranks(rank: int, world: int, scale: int) -> float:
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    return float(t)


def _rank_one_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 waits for a peer that never arrives: the failure must still surface


def _hangs(rank: int, world: int) -> None:
    if rank == 0:
        time.sleep(60)
    dist.barrier()


def test_results_per_rank_after_a_real_all_reduce():
    assert launch(_sum_ranks, 2, 10, timeout=120) == [10.0, 10.0]


def test_a_failing_rank_is_named_with_its_error():
    with pytest.raises(LaunchError) as info:
        launch(_rank_one_fails, 2, timeout=120)
    assert info.value.rank == 1 and info.value.error == "ValueError: rank one is broken"
    assert "raise ValueError" in info.value.trace


def test_a_hang_is_killed_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_hangs, 2, timeout=8)
    assert info.value.timed_out and time.monotonic() - start < 40
