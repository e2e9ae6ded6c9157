"""Run a test body in several real processes: gloo, CPU device mesh, real collectives.

`run(fn, world_size, *args)` runs `fn(rank, world_size, *args)` on `world_size` local gloo
processes (`planc.analysis.launch`, the launcher `planc check --verify` uses) and returns what
each rank returned (it must be picklable). A failure on any rank raises `AssertionError` here
with that rank's traceback; a run past `timeout` kills every rank and fails the same way.
`fn` must be a module-level function so the spawned processes can import it.
"""

from __future__ import annotations

from planc.analysis.launch import LaunchError, launch


def train_example(*args: str, procs: int = 4, timeout: float = 300.0) -> tuple[str, list[float]]:
    """`torchrun --standalone --nproc_per_node=procs examples/train.py *args` from the repository
    root; fails with its output unless it exits 0; returns its stdout and the losses it printed."""
    import pathlib
    import re
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
           "examples/train.py", *args]
    out = subprocess.run(cmd, cwd=pathlib.Path(__file__).resolve().parent.parent, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout, [float(x) for x in re.findall(r"loss (\d+\.\d+)", out.stdout)]


def run(fn, world_size: int, *args, timeout: float = 300.0) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return per-rank results."""
    try:
        return launch(fn, world_size, *args, timeout=timeout)
    except LaunchError as err:
        if err.rank is not None:
            raise AssertionError(f"rank {err.rank} failed:\n{err.trace}") from None
        raise AssertionError(f"distributed run failed: {err}") from None


def lowest_peak(measure_once, repeats: int = 2) -> dict:
    """The lowest-peak result of `repeats` calls of `measure_once()` (each a dict with "peak"), for
    memory measurements compared byte for byte with an estimate.

    gloo's worker thread drops a finished collective's work object (and every tensor it holds)
    only after `wait` has returned to the caller, so on a loaded machine a buffer can outlive its
    last use by a few ops and the tracker counts it at a later moment. A CI run measured 461940 B
    against the usual 457844 B for tests/test_expert_memory_dist.py's 4-rank plan: the 4096 B are
    one all-to-all buffer (32 rows x 32 x 4 B) still alive in the experts' backward. A delayed
    free only ever adds bytes, so the lowest of the repeats is the measurement without the race;
    a real excess shows in every repeat and still fails. The same holds for any other moment: the
    result's "repeats" are every run, for a test that compares one (`lowest_phase`)."""
    runs = [measure_once() for _ in range(repeats)]
    return {**min(runs, key=lambda m: m["peak"]), "repeats": runs}


def lowest_phase(measured: dict, phase: str) -> int:
    """The highest bytes of `phase` ("forward", "optimizer", ...) in a `lowest_peak` result's
    timeline, the lowest over its repeats (a late free only adds bytes to a moment)."""
    return min(max(total for p, total in run["timeline"] if p == phase) for run in measured["repeats"])
