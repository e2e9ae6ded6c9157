"""Rank bodies for tests/test_pipeline_facts_dist.py: what torch's pipelining really does.

Plain torch only (no planc): each case is the smallest code that shows one behaviour the
pipeline checks refuse (`pp`'s P46x diagnostics). One 4-rank launch runs them all: the mesh
is `(pp, dp) = (2, 2)`; the 2-rank cases run on each pipeline group (`{0, 2}`, `{1, 3}`) with
their own short gloo timeout, so a hang shows up as a timeout on that group and the launch
goes on.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist
from torch import nn

D, LAYERS = 8, 4
HANG_TIMEOUT_S = 6.0


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(LAYERS)])


def _loss(out, target):
    return nn.functional.mse_loss(out, target)


def _step(sched, held, n_stages, x, y):
    losses: list = []
    first, last = 0 in held, n_stages - 1 in held
    if first and last:
        sched.step(x, target=y, losses=losses)
    elif first:
        sched.step(x)
    elif last:
        sched.step(target=y, losses=losses)
    else:
        sched.step()
    return losses


def fsdp_split_backward(mesh, name: str, reshard_after_forward: bool) -> dict:
    """A V schedule (2 stages per rank) with `fully_shard` per block and per stage on the
    data-parallel axis, vs one process over the whole global batch: max gradient difference,
    and how many gradients are missing."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torch.distributed.tensor import DTensor

    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    g = torch.Generator().manual_seed(1)
    batch = 8
    X, Y = torch.randn(2 * batch, D, generator=g), torch.randn(2 * batch, D, generator=g)
    x, y = X[dp_rank * batch:(dp_rank + 1) * batch], Y[dp_rank * batch:(dp_rank + 1) * batch]
    ref = _blocks()
    (sum(_loss(ref(X[i * batch:(i + 1) * batch]), Y[i * batch:(i + 1) * batch]) for i in range(2)) / 2).backward()
    n_stages = 4
    held = [pp_rank, n_stages - 1 - pp_rank] if name in ("ZBVZeroBubble", "DualPipeV") else [pp_rank, pp_rank + 2]
    full = _blocks()
    stages = []
    for s in held:
        sub = nn.Sequential(full[s])
        for blk in sub:
            fully_shard(blk, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        fully_shard(sub, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        stages.append(PipelineStage(sub, s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()))
    sched = get_schedule_class(name)(stages, n_microbatches=4, loss_fn=_loss)
    losses = _step(sched, held, n_stages, x, y)
    diff, missing = 0.0, 0
    for s in held:
        for p, rp in zip(full[s].parameters(), ref[s].parameters()):
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            if grad is None:
                missing += 1
            else:
                diff = max(diff, (grad - rp.grad).abs().max().item())
    return {"diff": diff, "missing": missing, "loss": [float(v) for v in losses]}


def tied_across_stages(mesh) -> dict:
    """A weight used by stage 0 and by stage 1 (tied, as an input embedding and a tied head are):
    each pipeline rank trains its own copy. Returns this rank's gradient of it and the
    gradient one process computes (the sum over both uses)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    def build():
        torch.manual_seed(0)
        first, middle, last = nn.Linear(D, D, bias=False), nn.Linear(D, D), nn.Linear(D, D, bias=False)
        last.weight = first.weight
        return nn.Sequential(first, nn.Tanh(), middle, nn.Tanh(), last)

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
    ref = build()
    _loss(ref(x), y).backward()
    pp_rank = mesh["pp"].get_local_rank()
    full = build()
    stage = full[:2] if pp_rank == 0 else full[2:]
    sched = get_schedule_class("1F1B")(PipelineStage(stage, pp_rank, 2, torch.device("cpu"),
                                                     group=mesh["pp"].get_group()), n_microbatches=4, loss_fn=_loss)
    _step(sched, [pp_rank], 2, x, y)
    mine = full[0].weight.grad if pp_rank == 0 else full[4].weight.grad
    return {"grad": mine.clone(), "ref": ref[0].weight.grad.clone()}


def _pp_group(rank: int, world: int):
    """This rank's pipeline group (ranks r and r + 2 of 4) with a short timeout; every rank makes both."""
    mine = None
    for ranks in ([0, 2], [1, 3]):
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=HANG_TIMEOUT_S))
        if rank in ranks:
            mine = group, ranks.index(rank)
    return mine


def _linear_stages(held, n_stages, group, pp_rank):
    from torch.distributed.pipelining import PipelineStage

    torch.manual_seed(0)
    full = nn.Sequential(*[nn.Linear(D, D) for _ in range(n_stages)])
    return [PipelineStage(nn.Sequential(full[s]), s, n_stages, torch.device("cpu"), group=group) for s in held]


def edge(rank: int, world: int, case: str) -> dict:
    """One of torch's failure modes on a 2-rank pipeline group: the error each rank sees and after how long."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    group, pp_rank = _pp_group(rank, world)
    x, y = torch.randn(8, D), torch.randn(8, D)
    start = time.monotonic()
    try:
        if case == "zbv_loop_placement":  # a V schedule given loop placement (stages r, r + pp)
            held, n = [pp_rank, pp_rank + 2], 4
            sched = get_schedule_class("ZBVZeroBubble")(_linear_stages(held, n, group, pp_rank), n_microbatches=4,
                                                        loss_fn=_loss)
        elif case in ("checkpoint_split_backward", "wrapper_split_backward"):  # ZBV, V placement, checkpointing
            held, n = [pp_rank, 3 - pp_rank], 4
            stages = _linear_stages(held, n, group, pp_rank)
            for stage in stages:
                if case == "checkpoint_split_backward":  # torch's composable checkpoint, as planc.apply runs it
                    from torch.distributed._composable import checkpoint
                    checkpoint(stage.submod)
                else:  # torchtitan's: the module wrapped
                    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
                    stage.submod[0] = checkpoint_wrapper(stage.submod[0])
            sched = get_schedule_class("ZBVZeroBubble")(stages, n_microbatches=4, loss_fn=_loss)
        elif case == "uneven_microbatches":  # a local batch of 8 in 3 microbatches
            held, n = [pp_rank], 2
            sched = get_schedule_class("1F1B")(_linear_stages(held, n, group, pp_rank)[0], n_microbatches=3,
                                               loss_fn=_loss)
        else:
            raise ValueError(case)
        _step(sched, held, n, x, y)
        error = None
    except Exception as err:  # noqa: BLE001 - the error is the fact recorded
        error = f"{type(err).__name__}: {str(err)[:300]}"
    return {"error": error, "seconds": time.monotonic() - start}


def launch(rank: int, world: int) -> dict:
    """Every fact in one 4-rank launch (see the module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    out = {}
    for name, raf in (("DualPipeV", True), ("InterleavedZeroBubble", True), ("DualPipeV", False)):
        out[(name, raf)] = fsdp_split_backward(mesh, name, raf)
    dist.barrier()
    out["tied"] = tied_across_stages(mesh)
    dist.barrier()
    # the hang first, the failures last: a failed case leaves messages behind
    for case in ("wrapper_split_backward", "zbv_loop_placement", "uneven_microbatches", "checkpoint_split_backward"):
        out[case] = edge(rank, world, case)
        dist.barrier()
    return out
