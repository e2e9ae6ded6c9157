"""The local gloo launcher (planc/analysis/launch.py) that `check --verify` and the multi-process tests use.

Real processes, real collectives: results come back per rank; a rank's exception, and a hang
past the timeout, come back as a `LaunchError` saying which rank and what.
"""

from __future__ import annotations

import os
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


def _default_dtype_then_set(rank: int, world: int, env_name: str) -> tuple[str, str | None]:
    before = str(torch.get_default_dtype())
    torch.set_default_dtype(torch.float64)  # process state: must not reach the next launch's ranks
    return before, os.environ.get(env_name)


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


def test_each_launch_gets_fresh_ranks_and_the_environment_as_of_the_launch(monkeypatch):
    # the ranks fork from a server started at the first launch: they must still start as fresh processes
    # (no state of an earlier launch's ranks) and see the parent's environment as it is now, as under `spawn`
    name = "PLANC_TEST_LAUNCH_ENV"
    monkeypatch.delenv(name, raising=False)
    assert launch(_default_dtype_then_set, 2, name, timeout=120) == [("torch.float32", None)] * 2
    monkeypatch.setenv(name, "set after the first launch")
    assert launch(_default_dtype_then_set, 2, name, timeout=120) == [("torch.float32", "set after the first launch")] * 2
