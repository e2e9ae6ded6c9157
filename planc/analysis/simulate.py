"""Simulate one training step of a plan as rank r of N, in this process, with no real memory.

A fake process group, fake tensors and FSDP2's own memory tracker: no GPUs, any N.

The recipe (see docs/fsdp2-facts.md): `init_process_group("fake", store=FakeStore(), ...)`;
the device mesh is built outside `FakeTensorMode`; the model is built on meta, sharded by
`planc.apply`, then `to_empty("cpu")` inside fake mode; `FSDPMemTracker` measures two steps
(the faithful training step: forward, the loss as the analytic model takes it -- by default
cross-entropy over fp32 logits for language models -- its backward, `clip_grad_norm_`, the
optimizer step: foreach or fused AdamW/Adam, or SGD) and the second, steady step is
reported. Ops that DTensor's sharding propagation runs on global-shape fake tensors are not
counted: they are metadata work that a real run never allocates, and counting them
inflates the optimizer-step peak 6-40x.
"""

from __future__ import annotations

import contextlib
import threading
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from planc.estimate.trace import Example, LossFn, default_loss

# Tracker categories -> planc.estimate.memory categories.
_CATEGORY = {
    "Sharded Param": "sharded_params", "Unsharded Param": "unsharded_params", "Buffer": "buffers",
    "Sharded Grad": "sharded_grads", "Unsharded Grad": "unsharded_grads", "Activation": "activations",
    "Temp": "activations", "All Gather": "all_gather", "Reduce Scatter": "reduce_scatter",
    "OptState": "optimizer_state", "Inputs": "inputs",
}

_propagating = threading.local()


def _skip_sharding_propagation() -> None:
    """Mark the time spent in DTensor's sharding propagation (patched once, process-wide)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    original = ShardingPropagator._propagate_tensor_meta_non_cached
    if getattr(original, "_planc_marked", False):
        return

    def marked(self, *args, **kwargs):
        _propagating.depth = getattr(_propagating, "depth", 0) + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _propagating.depth -= 1

    marked._planc_marked = True  # type: ignore[attr-defined]
    ShardingPropagator._propagate_tensor_meta_non_cached = marked


@dataclass
class Measurement:
    """What the tracker saw in the steady (second) step on this rank."""

    peak: int
    breakdown: dict[str, int]
    moment: str
    timeline: list[tuple[str, int]] = field(default_factory=list)  # (phase, total bytes) per op
    world: int = 0
    rank: int = 0


def _tracker_class():
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class StepTracker(FSDPMemTracker):
        """FSDPMemTracker that skips sharding propagation and records a per-op timeline."""

        def __init__(self, mod, optm=None):
            super().__init__(mod, optm)
            self.timeline: list[tuple[str, int]] = []
            self.recording = False
            self.best: tuple[int, dict, str] = (-1, {}, "")

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if getattr(_propagating, "depth", 0):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        # NOTE: torch 2.13's tracker removes a group unit's (`fully_shard([a, b])`) forward hooks
        # and installs FSDPState's per module, which turns one group into one unit per module:
        # the group reshards after each member, registers a pre-backward hook on each member's
        # output and a post-backward on each member's inputs, so in backward it is gathered
        # and reduce-scattered once per member (and its exit restores per-module hooks, wrapping
        # `pre_backward` once per member). Real FSDP2 gathers a group once and reduce-scatters
        # it once (planc/analysis/comms.py records it). These two overrides install the
        # tracker's wrappers with FSDP2's own group hooks, once per FSDP state.
        def _instrument_fsdp_module(self) -> None:
            from torch.distributed._tools.fsdp2_mem_tracker import _SavedFSDPMethods
            from torch.distributed.fsdp import FSDPModule
            _merge_param_groups(True)
            self._saved_groups = {}
            for module, state in _fsdp_states(self._root_mod, FSDPModule):
                _remove_forward_hooks(state)
                _install_forward_hooks(state, module, self._fsdp_state_pre_forward(module, state._pre_forward),
                                       self._fsdp_state_post_forward(module, state._post_forward), always=True)
                for group in state._fsdp_param_groups:  # two with expert parallelism (per-parameter meshes)
                    self._instrument_fsdp_sharded_params_grads(group)
                    self._saved_groups[group] = _SavedFSDPMethods(group.pre_backward, group.post_backward)
                    group.pre_backward = self._fsdp_param_group_pre_backward(module, group.pre_backward)
                    group.post_backward = self._fsdp_param_group_post_backward(module, group.post_backward)
                self._fsdp_mod_to_saved_methods[module] = None
            from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
            for buffer in self._root_mod.buffers():  # as the tracker's own method does
                self._update_and_maybe_create_winfos(buffer, _FSDPRefType.BUFFER)

        def _deregister_module_and_optimizer_hooks(self) -> None:
            for module in self._fsdp_mod_to_saved_methods:
                state = module._get_fsdp_state()
                _remove_forward_hooks(state)
                _install_forward_hooks(state, module, state._pre_forward, state._post_forward, always=False)
            for group, saved in self._saved_groups.items():
                group.pre_backward = saved.pre_backward
                group.post_backward = saved.post_backward
            self._fsdp_mod_to_saved_methods.clear()
            _merge_param_groups(False)
            if self._optimizer_hook_handles is not None:
                for handle in self._optimizer_hook_handles:
                    handle.remove()
                self._optimizer_hook_handles = None

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            if not self.recording:
                return
            snap = next(iter(self._curr_mem_snap.values()), {})
            total = snap.get("Total", 0)
            phase = "optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"
            self.timeline.append((phase, total))
            if total > self.best[0]:
                where = max(self._mod_tracker.parents, key=len, default="")
                self.best = (total, deepcopy(snap), f"{phase} of {where}")

    return StepTracker


def _fsdp_states(root: nn.Module, fsdp_module_cls) -> list:
    """(first module, FSDP state) for each FSDP state with parameters under `root`, once each."""
    seen: set[int] = set()
    out = []
    for module in root.modules():
        if isinstance(module, fsdp_module_cls):
            state = module._get_fsdp_state()
            if state._fsdp_param_groups and id(state) not in seen:
                seen.add(id(state))
                out.append((state._modules[0], state))
    return out


class _MergedGroups:
    """Several `FSDPParamGroup`s of one state seen as one by FSDPMemTracker (it reads `fsdp_params`)."""

    def __init__(self, groups) -> None:
        self.fsdp_params = [p for g in groups for p in g.fsdp_params]


def _merge_param_groups(on: bool) -> None:
    """While the tracker runs (`on`), `FSDPState._fsdp_param_group` of a state with several parameter
    groups (expert parallelism: per-parameter meshes) is their merge, not torch 2.13's assertion: the
    tracker reads the singular property; FSDP itself uses `_fsdp_param_groups`."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    saved = getattr(FSDPState, "_planc_single_group", None)
    if saved is None:
        saved = FSDPState._planc_single_group = FSDPState.__dict__["_fsdp_param_group"]
    if not on:
        FSDPState._fsdp_param_group = saved
        return

    def merged(self):
        groups = self._fsdp_param_groups
        return _MergedGroups(groups) if len(groups) > 1 else saved.fget(self)
    FSDPState._fsdp_param_group = property(merged)


def _remove_forward_hooks(state) -> None:
    state._pre_forward_hook_handle.remove()
    if state._post_forward_hook_handle is not state._pre_forward_hook_handle:
        state._post_forward_hook_handle.remove()


def _install_forward_hooks(state, module: nn.Module, pre, post, always: bool) -> None:
    """Forward hooks as `FSDPState.init` registers them: per module, or FSDP2's group hooks for a list unit."""
    if len(state._modules) > 1:
        from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks
        handle = _register_group_forward_hooks(state._modules, pre, post, state._modules_to_run_forward,
                                               state._cast_output_dtype)
        state._pre_forward_hook_handle = state._post_forward_hook_handle = handle
        return
    state._pre_forward_hook_handle = module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
    state._post_forward_hook_handle = module.register_forward_hook(post, prepend=False, always_call=always)


def _innermost(where: str, root_name: str) -> str:
    """`forward of SeedTransformer.transformer_layers.0` -> `forward of transformer_layers.0`."""
    phase, _, fqn = where.partition(" of ")
    path = fqn.split(".", 1)[1] if "." in fqn else ("<root>" if fqn in (root_name, "Global", "") else fqn)
    return f"{phase} of {path}" if phase != "optimizer" else "optimizer step"


def init_fake(world: int, rank: int = 0) -> None:
    """(Re)start a fake process group: this process plays `rank` of `world`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        dist.destroy_process_group()
    _forget_meshes()  # a group destroyed by anyone leaves meshes of its world in DTensor's caches
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _forget_meshes() -> None:
    """Empty DTensor's caches of sharding propagation and redistribution plans.

    They key on `DeviceMesh` equality (shape, device, axis names), not on its process groups, and
    their entries hold the mesh they were made with: after the process group is restarted, an
    equal new mesh hits an entry whose mesh names a group of the old world, and the collective
    fails with "Could not resolve the process group registered under the name N" (seen when one
    process records several plans' steps in turn, as the test suite does).
    """
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def fake_step_inputs(model: nn.Module, inputs, fake) -> Example:
    """Inside FakeTensorMode `fake`: storage for a meta-sharded `model` (ties restored) and its
    step's inputs (`inputs(model)`, or the args themselves) as fake tensors."""
    model.to_empty(device="cpu")
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()
    return Example.of(inputs(model) if callable(inputs) else (inputs or ())).map(fake.from_tensor)


def simulate(plan, build: Callable[[], nn.Module], world: int, *, rank: int = 0,
             inputs: Callable[[nn.Module], tuple] | tuple | None = None, optimizer: str = "adamw",
             steps: int = 2, loss: LossFn | None = None, clip: float | None = 1.0) -> Measurement:
    """Measure one steady training step of `plan` on rank `rank` of `world`, with fake tensors.

    Args:
        plan: a plan path, `Plan` or `CompiledPlan`.
        build: builds the model (called under `torch.device("meta")`).
        world: number of ranks to pretend.
        rank: the rank this process plays.
        inputs: the model's inputs (a tuple, a dict of keywords or an `Example`), or a
            function of the model returning them; only shapes and dtypes matter.
        optimizer: one of `planc.estimate.memory.OPTIMIZERS`.
        steps: steps to run; the last is measured (the first allocates optimizer state).
        loss: the step's loss, `(output, example) -> tensor` (default `default_loss`).
        clip: `clip_grad_norm_` max norm before the optimizer step (None: no clipping).

    Returns:
        The `Measurement` of the last step.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from planc.limits import rank_count
    rank_count(world, "world")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in 0..{world - 1}, got {rank!r}")
    import planc
    from planc.backends.runtime import apply, build_mesh

    _skip_sharding_propagation()
    init_fake(world, rank)
    try:
        with torch.device("meta"):
            model = build()
        compiled = plan if isinstance(plan, planc.CompiledPlan) else planc.compile(plan, model, world)
        mesh = build_mesh(compiled.mesh, world, "cpu")  # NOTE: outside fake mode
        applied = apply(model, compiled.plan, mesh=mesh)
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            example = fake_step_inputs(model, inputs, fake)
            schedule = compiled.job.schedule
            return _measure(model, example, optimizer, steps, loss, clip, applied.loss_parallel,
                            schedule.microbatches, schedule.gradient_sync, lambda part: sequence_shard(applied, part))
    finally:
        dist.destroy_process_group()


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer | None:
    params = [p for p in model.parameters() if p.requires_grad]
    if name in ("adamw", "adam", "adamw_fused", "adam_fused"):
        cls = torch.optim.AdamW if name.startswith("adamw") else torch.optim.Adam
        fused = name.endswith("_fused")
        return cls(params, lr=1e-3, foreach=not fused, fused=fused or None)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=True)
    return None


def zoo_inputs(input_shape: tuple[int, int] | None = None) -> Callable[[nn.Module], tuple]:
    """Token-id inputs for language models (`config.vocab_size`), default 2 x 16."""
    batch, seq = input_shape or (2, 16)

    def make(model: nn.Module) -> tuple:
        vocab = getattr(getattr(model, "config", None), "vocab_size", 2)
        return (torch.randint(0, vocab, (batch, seq)),)
    return make


def measure_real(model: nn.Module, inputs, optimizer: str = "adamw", steps: int = 2,
                 nccl_like_reduce_scatter: bool = False, loss: LossFn | None = None,
                 clip: float | None = 1.0, loss_context=contextlib.nullcontext) -> Measurement:
    """The same measurement on a live (really sharded, real-tensor) model in a real process group.

    Args:
        loss_context: the loss and backward run inside it (`AppliedPlan.loss_parallel` for a
            plan with `loss_parallel`).
        nccl_like_reduce_scatter: replace FSDP's reduce-scatter with an in-place all-reduce and
            a slice (same values). Stock gloo clones the whole reduce-scatter input and frees
            the clone when its work object dies, which inflates and blurs CPU peaks; NCCL does
            not. With this the real run measures what a GPU run would allocate.
    """
    _skip_sharding_propagation()
    if nccl_like_reduce_scatter:
        use_all_reduce_slice(model)
    return _measure(model, Example.of(inputs), optimizer, steps, loss, clip, loss_context)


def use_all_reduce_slice(model: nn.Module) -> None:
    """Make every FSDP unit of `model` reduce-scatter as all-reduce + slice (see `measure_real`)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class AllReduceSlice(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            work = dist.all_reduce(input_tensor, op=op, group=group, async_op=async_op)
            if work is not None:
                work.wait()
            rank, size = dist.get_rank(group), dist.get_world_size(group)
            output_tensor.copy_(input_tensor.view(size, -1)[rank])
            return None

    for module in model.modules():
        if isinstance(module, FSDPModule):
            # per group: `set_custom_reduce_scatter` refuses a unit with two parameter groups (expert
            # parallelism's per-parameter meshes); the comm reduces over whatever group it is given
            for group in module._get_fsdp_state()._fsdp_param_groups:
                group._reduce_scatter_comm = AllReduceSlice()


def sequence_shard(applied, part: Example) -> Example:
    """`part` (token ids first) as this rank's share under a context axis (`applied.shard_batch`:
    its tokens' head-tail shard, with `positions=`); as it is without one."""
    from planc.lower.job import ShardBatch
    if not applied.compiled.job.step_op(ShardBatch) or not part.args:
        return part
    batch = applied.shard_batch(part.args[0])
    return Example((batch.tokens, *part.args[1:]), {**part.kwargs, "positions": batch.positions})


def _measure(model: nn.Module, example: Example, optimizer: str, steps: int, loss: LossFn | None,
             clip: float | None, loss_context=contextlib.nullcontext, microbatches: int = 1,
             sync: str = "every", shard=lambda part: part) -> Measurement:
    """Run `steps` training steps under the tracker; the last one is measured. The loss and
    backward run inside `loss_context()` (`AppliedPlan.loss_parallel`: vocabulary-sharded logits).
    A step of several microbatches runs each forward and backward on its slice of the batch,
    as a hand-written accumulation loop does: with `sync = "last"`, FSDP2's
    `set_requires_gradient_sync(False)` before all but the last. `shard` cuts each microbatch
    for this rank (`sequence_shard` under a context axis)."""
    opt = _optimizer(model, optimizer)
    tracker = _tracker_class()(model, opt)
    tracker.track_inputs((example.args, example.kwargs))
    step_loss = loss or default_loss(model)
    with tracker:
        for step in range(steps):
            tracker.recording = step == steps - 1
            tracker.reset_mod_stats()  # the tracker refuses a second iteration otherwise
            for mb in range(microbatches):
                part = shard(example.microbatch(microbatches, mb))
                if sync == "last":
                    model.set_requires_gradient_sync(mb == microbatches - 1)
                pred = model(*part.args, **part.kwargs)
                with loss_context():
                    value = step_loss(pred, part)
                    del pred  # as torchtitan's step: the output is not kept during backward
                    value.backward()
                    del value
                del part
            if clip is not None:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip,
                                               foreach=True)
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
    total, snap, where = tracker.best
    breakdown: dict[str, int] = {}
    for key, value in snap.items():
        name = getattr(key, "value", key)
        if name != "Total" and value:
            cat = _CATEGORY.get(name, str(name))
            breakdown[cat] = breakdown.get(cat, 0) + value
    return Measurement(total, breakdown, _innermost(where, type(model).__name__), tracker.timeline,
                       dist.get_world_size(), dist.get_rank())
