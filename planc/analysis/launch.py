"""Run a function on several local processes joined by a gloo process group (CPU, real collectives).

`launch(fn, world, *args)` spawns `world` processes, initialises gloo in each, calls
`fn(rank, world, *args)` and returns what each rank returned (picklable). A rank that raises, a
rank that dies, or a run past `timeout` (a hang: every process is killed) is a `LaunchError`
carrying the error of the rank that failed first (its peers then fail on the closed connection).
`planc check --verify` runs its sharded twin with it, and the test suite's multi-process tests
(`tests/distributed.py`) run their bodies with it. `fn` must be a module-level function, so the
spawned processes can import it.

The ranks are forked from multiprocessing's fork server, which imports torch and planc once (per
parent process) instead of each rank importing them afresh as under `spawn`: a launch then costs well
under a second where `spawn` took 10-40 s on a 2-core machine. Each rank is still a new process with
the state of a fresh import (nothing of an earlier launch), and gets the parent's sys.path, working
directory and environment as of the launch, as under `spawn`.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback

import torch

# what the fork server imports once, before it forks the ranks (each rank then imports only its fn's module)
_PRELOAD = ["__main__", "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp", "planc",
            "planc.zoo"]


class LaunchError(RuntimeError):
    """The run failed: `rank` (None when no rank reported), `error` (`Type: message`), `trace` (its traceback)."""

    def __init__(self, message: str, rank: int | None = None, error: str = "", trace: str = "",
                 timed_out: bool = False, finished: tuple[int, ...] = ()):
        super().__init__(message)
        self.rank, self.error, self.trace, self.timed_out, self.finished = rank, error, trace, timed_out, finished


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, env: dict, fn, args) -> None:
    import torch.distributed as dist

    # the fork server's environment is the parent's when the server started: take the parent's as of this launch
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # the ranks share the machine's cores: avoid oversubscription
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException as err:
        torch.save({"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc(),
                    "at": time.time()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    else:
        # a rank done first must not tear gloo down under a peer still in its last collective
        # (the peer then aborts with SIGABRT): wait for every rank
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(fn, world: int, *args, timeout: float = 300.0) -> list:
    """`fn(rank, world, *args)` on `world` gloo ranks; each rank's return value, in rank order.

    Raises:
        LaunchError: a rank raised (the first rank to fail, and its error), died, or the run passed `timeout`.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":
        multiprocessing.get_context(method).set_forkserver_preload(_PRELOAD)  # read when the server starts
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker, args=(world, _free_port(), out_dir, dict(os.environ), fn, args), nprocs=world,
                                 join=False, start_method=method)
        failed, timed_out = None, False
        deadline = time.monotonic() + timeout
        try:
            # join() returns False while some rank is still running (it wakes on each exit)
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for proc in ctx.processes:
                        proc.kill()
                    failed, timed_out = f"ranks still running after {timeout:.0f} s (a hang?)", True
                    break
        except Exception as err:  # ProcessRaisedException, ProcessExitedException
            failed = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        records = []
        for rank in range(world):
            path = os.path.join(out_dir, f"{rank}.pt")
            records.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
        errors = [(record["at"], rank, record) for rank, record in enumerate(records) if record and not record["ok"]]
        if errors:  # the first to fail: its peers then fail too, on the closed connection
            _, rank, record = min(errors, key=lambda e: e[:2])
            raise LaunchError(f"rank {rank} failed: {record['error']}", rank, record["error"], record["trace"])
        if failed is not None:
            done = tuple(r for r, record in enumerate(records) if record is not None)
            raise LaunchError(f"the run failed: {failed} (ranks that finished: {list(done)})", timed_out=timed_out,
                              finished=done)
        return [record["result"] for record in records]
