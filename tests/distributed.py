"""Run a test body in several real processes: gloo, CPU device mesh, real collectives.

`run(fn, world_size, *args)` spawns `world_size` processes, initialises a gloo process
group in each, calls `fn(rank, world_size, *args)`, and returns what each rank returned
(it must be picklable). A failure on any rank raises here with that rank's traceback.
`fn` must be a module-level function so the spawned processes can import it.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # 2 cores shared by all ranks: avoid oversubscription
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    else:
        # NOTE: a rank that is done first must not tear gloo down under a peer still in its
        # last collective: the peer then aborts ("terminate called without an active
        # exception", SIGABRT). Seen once in CI; examples/train.py guards its exit the same way.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(fn, world_size: int, *args, timeout: float = 300.0) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return per-rank results."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker, args=(world_size, _free_port(), out_dir, fn, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        failed = None
        deadline = time.monotonic() + timeout
        try:
            # join() returns False while some rank is still running (it wakes on each exit)
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for proc in ctx.processes:
                        proc.kill()
                    failed = TimeoutError(f"ranks still running after {timeout:.0f} s")
                    break
        except Exception as err:  # ProcessRaisedException and friends
            failed = err
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"{rank}.pt")
            if not os.path.exists(path):
                results.append(None)
                continue
            record = torch.load(path, weights_only=False)
            if not record["ok"]:
                raise AssertionError(f"rank {rank} failed:\n{record['error']}")
            results.append(record["result"])
        if failed is not None:
            done = [r for r in range(world_size) if results[r] is not None]
            raise AssertionError(f"distributed run failed: {failed} (ranks that finished their body: {done})")
        return results
