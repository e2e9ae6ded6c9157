"""Record the collectives one training step of a plan issues, in a fake process group.

The check of the step-time model's communication (`planc/estimate/time.py`): the model is
built on meta, sharded by `planc.apply` on a fake process group as rank 0 of N
(`planc.analysis.simulate`'s recipe), and one forward + loss + backward runs on fake CPU
tensors under a dispatch mode that sees every c10d op (`_allgather_base_`,
`_reduce_scatter_base_`, `allreduce_` and the functional collectives DTensor uses). Each
collective is attributed to the FSDP unit whose `unshard` or `post_backward` issued it (FSDP2's
own parameter-group methods, wrapped for the run), or to `tensor` when DTensor issued it
outside them (tensor parallelism), and sized as nccl-tests size them: the all-gather's
output, the reduce-scatter's input, the all-reduce's buffer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from planc.estimate.trace import LossFn, default_loss
from planc.lower.job import FORWARD, FULL_BACKWARD, LossParallel, Reader, ShardBatch
from planc.lower.program import (
    AttendOverContext,
    Checkpoint,
    Compile,
    DispatchExperts,
    FullyShard,
    Parallelize,
    SetPrefetch,
    UnitMethod,
)

# What the recorder runs: the applied plan (the runtime's reader refuses what it cannot
# apply) and one forward, loss (in `loss_parallel()`) and backward, attributed to the units;
# with a context axis each microbatch cut by `applied.shard_batch` as a training loop cuts it;
# expert parallelism's dispatch with balanced routing (`experts.balanced_routing`: a fake process
# group cannot fill the split sizes, so the counts' all-to-all is not issued).
READER = Reader("the collective recorder",
                (FullyShard, Parallelize, AttendOverContext, DispatchExperts, Checkpoint, Compile, SetPrefetch,
                 UnitMethod),
                (FORWARD, FULL_BACKWARD), (LossParallel, ShardBatch))

# c10d op -> (kind, index of the tensor whose bytes are the nccl-tests size)
_OPS = {
    "c10d._allgather_base_": ("all_gather", 0), "c10d.allgather_": ("all_gather", 0),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1), "c10d.reduce_scatter_": ("reduce_scatter", 1),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d.allreduce_": ("all_reduce", 0), "c10d.allreduce_coalesced_": ("all_reduce", 0),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", None),
    "_c10d_functional.all_gather_into_tensor_out": ("all_gather", None),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional.all_reduce": ("all_reduce", 0), "_c10d_functional.all_reduce_": ("all_reduce", 0),
    "_c10d_functional.all_to_all_single": ("all_to_all", 0),
}


@dataclass(frozen=True)
class Recorded:
    """One collective of the recorded step."""

    kind: str
    unit: str          # the FSDP unit that issued it, or "tensor" / "other"
    bytes: int
    ranks: int
    phase: str         # forward | backward


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(t) for t in obj)
    return 0


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[Recorded] = []
        self.unit: list[str] = []
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if name in _OPS:
            kind, index = _OPS[name]
            nbytes = _nbytes(out if index is None else args[index])
            if index is None and isinstance(out, torch.Tensor):
                nbytes = _nbytes(out)
            group = _group_size(name, args, kwargs or {})
            where = self.unit[-1] if self.unit else ("tensor" if name.startswith("_c10d_functional") else "other")
            self.found.append(Recorded(kind, where, nbytes, group, self.phase))
        return out


def _group_size(name: str, args, kwargs) -> int:
    if name.startswith("_c10d_functional"):  # the group is passed by name, last
        for a in reversed(list(args) + list(kwargs.values())):
            if isinstance(a, str):
                try:
                    return dist.distributed_c10d._resolve_process_group(a).size()
                except Exception:  # noqa: BLE001 (the size is informative only)
                    return 0
        return 0
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.distributed_c10d.ProcessGroup.unbox(a).size()
            except Exception:  # noqa: BLE001 (the size is informative only)
                return 0
    return 0


@contextlib.contextmanager
def _attributed(recorder: _Recorder, names: dict[int, str]):
    """Wrap FSDP2's `unshard` and `post_backward` so collectives know their unit."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    saved = {m: getattr(FSDPParamGroup, m) for m in ("unshard", "post_backward")}

    def wrap(method):
        def run(self, *args, **kwargs):
            recorder.unit.append(names.get(tuple(id(m) for m in self.modules), "?"))
            try:
                return method(self, *args, **kwargs)
            finally:
                recorder.unit.pop()
        return run

    for m, fn in saved.items():
        setattr(FSDPParamGroup, m, wrap(fn))
    try:
        yield
    finally:
        for m, fn in saved.items():
            setattr(FSDPParamGroup, m, fn)


def record_collectives(plan, build: Callable[[], nn.Module], world: int, *,
                       inputs: Callable[[nn.Module], tuple] | tuple | None = None,
                       loss: LossFn | None = None) -> list[Recorded]:
    """The collectives of one training step (forward, loss, backward of each of the plan's
    microbatches, the batch split as `AppliedPlan.accumulate` splits it) of `plan` as rank 0 of `world`.

    Args:
        plan: a plan path, `Plan` or `CompiledPlan`.
        build: builds the model (called under `torch.device("meta")`).
        world: ranks to pretend (a fake process group).
        inputs: the model's inputs, or a function of the model returning them (shapes only).
        loss: the step's loss (default `default_loss`).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    import planc
    from planc.analysis.simulate import _skip_sharding_propagation, fake_step_inputs, init_fake, sequence_shard
    from planc.backends.experts import balanced_routing
    from planc.backends.runtime import apply, build_mesh

    _skip_sharding_propagation()
    init_fake(world, 0)
    try:
        with torch.device("meta"):
            model = build()
        compiled = plan if isinstance(plan, planc.CompiledPlan) else planc.compile(plan, model, world)
        READER.compiled(compiled)
        mesh = build_mesh(compiled.mesh, world, "cpu")
        applied = apply(model, compiled.plan, mesh=mesh)
        names = {tuple(id(model.get_submodule(p)) if p else id(model) for p in op.modules): op.name
                 for op in compiled.program.units}
        recorder = _Recorder()
        with FakeTensorMode(allow_non_fake_inputs=True) as fake, balanced_routing():
            example = fake_step_inputs(model, inputs, fake)
            step_loss = loss or default_loss(model)
            with _attributed(recorder, names), recorder:
                k = applied.microbatches
                for mb in range(k):  # the plan's microbatches, each with its gradient sync
                    applied.gradient_sync(mb)
                    part = sequence_shard(applied, example.microbatch(k, mb))
                    recorder.phase = "forward"
                    pred = model(*part.args, **part.kwargs)
                    with applied.loss_parallel():  # vocabulary-sharded logits (`loss_parallel`), as a training loop's
                        value = step_loss(pred, part)
                        del pred
                        recorder.phase = "backward"
                        value.backward()
        return recorder.found
    finally:
        dist.destroy_process_group()
