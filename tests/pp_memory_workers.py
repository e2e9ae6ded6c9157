"""Workers for tests/test_roles_memory_dist.py: a hand-written pipeline step measured by two oracles.

The step is written as torchtitan writes a pipeline (`pipeline_module_split` by hand: each
rank keeps its stage's modules), with torch's own `PipelineStage` and schedule, `fully_shard`
per unit on the data-parallel axis of a ("pp", "dp") mesh with no reshard after forward (the PP
default), AdamW (foreach). Each pipeline rank's peak of the second of two steps is measured by

* FSDPMemTracker (planc.analysis.simulate's, which keeps FSDP2's group hooks), by category;
  it cannot run the split-backward schedules (their `autograd.grad` on the stage inputs fails
  under its module hooks);
* `LiveBytes` (a dispatch mode, no module hooks): every storage alive when the step starts,
  plus each storage an op creates, minus it when the storage dies (by weakref). It runs every
  schedule; on those the tracker runs too, the two agree (tests/test_roles_memory_dist.py).
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class First(nn.Module):
    """Stage 0: the token embedding and block 0."""

    def __init__(self, model):
        super().__init__()
        self.tok_embeddings, self.layers = model.tok_embeddings, nn.ModuleDict({"0": model.layers[0]})

    def forward(self, tokens):
        return self.layers["0"](self.tok_embeddings(tokens))


class Last(nn.Module):
    """Stage 1: block 1, the norm and the head."""

    def __init__(self, model):
        super().__init__()
        self.layers, self.norm, self.output = nn.ModuleDict({"1": model.layers[1]}), model.norm, model.output

    def forward(self, h):
        return self.output(self.norm(self.layers["1"](h)))


def lm_loss(logits, labels):  # cross-entropy over fp32 logits, summed / tokens (torchtitan's)
    return nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum") / labels.numel()


def pipeline_peaks(rank: int, world: int, names: tuple[str, ...], microbatches: int, batch: int, seq: int) -> dict:
    """Schedule name -> this rank's measurement (one launch measures several schedules)."""
    return {name: pipeline_peak(rank, world, name, microbatches, batch, seq) for name in names}


def pipeline_peak(rank: int, world: int, name: str, microbatches: int, batch: int, seq: int) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    before = alive()
    mesh, model = _start(world)
    pp = mesh["pp"].get_local_rank()
    stage_mod = First(model) if pp == 0 else Last(model)
    del model
    units = [stage_mod.tok_embeddings, stage_mod.layers["0"]] if pp == 0 else [stage_mod.layers["1"],
                                                                                [stage_mod.norm, stage_mod.output]]
    for unit in units:
        fully_shard(unit, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(stage_mod, mesh=mesh["dp"], reshard_after_forward=False)
    stage = PipelineStage(stage_mod, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = get_schedule_class(name)(stage, n_microbatches=microbatches, loss_fn=lm_loss, scale_grads=False)
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=1e-3, foreach=True)
    tokens = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(1))

    def step():
        schedule.step(tokens) if pp == 0 else schedule.step(target=tokens)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _measure(stage_mod, opt, tokens, step, pp, before=before)


class Embed(nn.Module):
    """Stage 0 of 4: the token embedding."""

    def __init__(self, model):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings

    def forward(self, tokens):
        return self.tok_embeddings(tokens)


class Block(nn.Module):
    """Stage 1 or 2 of 4: one block."""

    def __init__(self, model, i: int):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): model.layers[i]})

    def forward(self, h):
        return next(iter(self.layers.values()))(h)


class Head(nn.Module):
    """Stage 3 of 4: the norm and the head."""

    def __init__(self, model):
        super().__init__()
        self.norm, self.output = model.norm, model.output

    def forward(self, h):
        return self.output(self.norm(h))


class Held(nn.Module):
    """A rank's stages, under one module for the tracker (never called itself)."""

    def __init__(self, stages):
        super().__init__()
        self.stages = nn.ModuleList(stages)


def looped_peaks(rank: int, world: int, names: tuple[str, ...], microbatches: int, batch: int, seq: int,
                 tracked: tuple[str, ...] | None = None) -> dict:
    """Schedule name -> this rank's measurement, 4 stages on 2 ranks (2 each: loop or V placement);
    FSDPMemTracker measures the schedules in `tracked` (default all), `LiveBytes` every one."""
    return {name: looped_peak(rank, world, name, microbatches, batch, seq, tracked is None or name in tracked)
            for name in names}


def looped_peak(rank: int, world: int, name: str, microbatches: int, batch: int, seq: int, tracked: bool = True) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    before = alive()
    mesh, model = _start(world)
    pp = mesh["pp"].get_local_rank()
    held = (pp, 3 - pp) if name in ("ZBVZeroBubble", "DualPipeV") else (pp, pp + 2)
    mods, stages = [], []
    for s in held:
        mod = Embed(model) if s == 0 else Head(model) if s == 3 else Block(model, s - 1)
        for unit in ([mod.tok_embeddings] if s == 0 else [next(iter(mod.layers.values()))] if s in (1, 2)
                     else [[mod.norm, mod.output]]):
            fully_shard(unit, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(mod, mesh=mesh["dp"], reshard_after_forward=False)
        mods.append(mod)
        stages.append(PipelineStage(mod, s, 4, torch.device("cpu"), group=mesh["pp"].get_group()))
    del model  # the other rank's stages (LiveBytes counts every tensor alive)
    schedule = get_schedule_class(name)(stages, n_microbatches=microbatches, loss_fn=lm_loss, scale_grads=False)
    root = Held(mods)
    fully_shard(root, mesh=mesh["dp"], reshard_after_forward=False)
    opt = torch.optim.AdamW(root.parameters(), lr=1e-3, foreach=True)
    tokens = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(1))
    has_first, has_last = 0 in held, 3 in held

    def step():
        if has_first:
            schedule.step(tokens, target=tokens if has_last else None)
        else:
            schedule.step(target=tokens if has_last else None)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _measure(root, opt, tokens, step, pp, tracked, before)


def _start(world: int):
    """The ("pp", "dp") mesh (pipeline 2) and llama_tiny seeded alike on every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from planc.analysis.simulate import _skip_sharding_propagation
    from planc.zoo import llama_tiny

    torch.manual_seed(0)
    _skip_sharding_propagation()
    dist.barrier()
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp")), llama_tiny()


def _measure(root: nn.Module, opt, tokens, step, pp: int, tracked: bool = True, before: dict | None = None) -> dict:
    """This rank's peak of a `step()` after the first: under FSDPMemTracker on `root`, with its
    categories (when `tracked`), and under `LiveBytes` (`live`: its peak and where).

    NOTE: the first step infers the stages' shapes with `autograd.grad` on the stage's inputs,
    which the tracker's module hooks do not support: it runs untracked (it also allocates the
    optimizer state and the stage's receive buffers, which the tracker sees as they are)."""
    import torch.distributed as dist

    from planc.analysis.simulate import _CATEGORY, _tracker_class

    step()
    out = {"rank": pp}
    if tracked:
        tracker = _tracker_class()(root, opt)
        tracker.track_inputs((tokens,))
        with tracker:
            tracker.recording = True
            step()
        total, snap, where = tracker.best
        breakdown: dict[str, int] = {}
        for key, value in snap.items():
            label = getattr(key, "value", key)
            if label != "Total" and value:
                cat = _CATEGORY.get(label, str(label))
                breakdown[cat] = breakdown.get(cat, 0) + value
        out.update(peak=total, breakdown=breakdown, where=where)
    live = LiveBytes(before)
    with live:
        step()
    out["live"] = {"peak": live.peak, "where": live.where, "start": live.start, "sizes": live.sizes}
    dist.barrier()
    return out


def alive() -> dict:
    """Every tensor storage alive now (id -> weakref): what `LiveBytes` leaves out of a later count
    (the earlier schedules' leftovers of one launch measuring several)."""
    gc.collect()
    out = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # (isinstance would touch deprecated proxies)
            t = getattr(obj, "_local_tensor", obj)
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                out[id(st)] = weakref.ref(st)
    return out


class LiveBytes(TorchDispatchMode):
    """Live bytes of a CPU step without module hooks: every tensor storage alive as it starts
    (found by the garbage collector: parameters, gradients, optimizer state, the stages' buffers,
    the batch), plus each storage an op creates, taken off when it dies (by weakref). Sizes are
    read again after every op: FSDP2 allocates and frees a unit's unsharded parameters by
    resizing one storage (`alloc_storage` / `free_storage`), with no op that makes a tensor.
    `peak`: the most at once; `where`: the op that reached it; `sizes`: the storages created in
    the step alive then, largest first (bytes, op)."""

    def __init__(self, before: dict | None = None):
        super().__init__()
        self.before = before or {}  # `alive()` before the step's set-up: another run's leftovers, not counted
        self.live: dict[int, tuple] = {}  # storage id -> (the op that made it, weakref)
        self.nbytes: dict[int, int] = {}  # storage id -> its bytes when last read
        self.cur = self.peak = self.start = 0
        self.where, self.sizes = "", []

    def __enter__(self):
        gc.collect()  # garbage the collector has not freed yet would die while counted
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor):  # (isinstance would touch deprecated proxies)
                self._add(obj, "")
        self.start = self.peak = self._read()
        return super().__enter__()

    def _add(self, t, op: str) -> None:
        t = getattr(t, "_local_tensor", t)  # a DTensor's bytes are its local shard's
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = id(st)
        if key in self.live or (key in self.before and self.before[key]() is st):
            return

        def gone(_ref, key=key):
            self.live.pop(key, None)
            self.cur -= self.nbytes.pop(key, 0)
        self.live[key] = (op, weakref.ref(st, gone))
        self.nbytes[key] = st.nbytes()
        self.cur += self.nbytes[key]

    def _read(self) -> int:
        """Every live storage's bytes now (FSDP2 resizes some in place)."""
        for key, (_, ref) in list(self.live.items()):
            st = ref()
            if st is not None:
                self.nbytes[key] = st.nbytes()
        self.cur = sum(self.nbytes.values())
        return self.cur

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._add(t, str(func))
        if self._read() > self.peak:
            self.peak, self.where = self.cur, str(func)
            self.sizes = sorted(((self.nbytes[k], op) for k, (op, _) in self.live.items() if op), reverse=True)
        return out
