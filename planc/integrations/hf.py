"""Shard a transformers model with a plan so that `Trainer` (and accelerate) train it as it is.

The Trainer hands its model to `accelerate.Accelerator.prepare`, which wraps a multi-process
model in DDP unless accelerate's own FSDP mode is on; DDP refuses DTensor parameters
(`aten.cat.default got mixed torch.Tensor and DTensor`). transformers (5.x) already knows
models that arrive sharded: one sharded at load time by `from_pretrained(distributed_config=...)`
says so with `is_distributed_loading_by_transformers`, and the Trainer then prepares it with
`prepare_model(..., device_placement=False, evaluation_mode=True)`: no DDP, no second sharding,
no `.to(device)`, and FSDP's own gradient reduction (deferred within gradient accumulation).
`shard_for_trainer` applies a plan and marks the model the same way (the flag, and the
public `config.distributed_config` the Trainer reads the data-parallel sizes from).

    applied = shard_for_trainer(model, "plans/llama.plan")    # after init_process_group
    Trainer(model=model, args=TrainingArguments(..., save_strategy="no"), ...).train()

The mark is the private attribute behind that public property (transformers has no setter);
it is what `from_pretrained(distributed_config=...)` sets, and the Trainer reads nothing else.
Like such a model, one marked here cannot resume from a Trainer checkpoint (the Trainer asks
for `save_strategy="no"` or `save_only_model=True`). Tested with transformers 5.24 and
accelerate 1.16 on gloo (tests/test_trainers_dist.py); see docs/trainers.md.
"""

from __future__ import annotations

from torch import nn

from planc.diagnostics import Diagnostic, PlanError

# transformers.distributed.mixin.DistributedMixin: the flag under the read-only property
# `is_distributed_loading_by_transformers`, which `Trainer.__init__` reads.
MARK = "_is_distributed_loading_by_transformers"


def shard_for_trainer(model: nn.Module, plan, *, mesh=None):
    """`planc.apply(model, plan)`, then mark `model` as sharded for transformers' Trainer.

    Args:
        model: a transformers `PreTrainedModel` (on meta, CPU or the device), not yet sharded.
        plan: as for `planc.apply`: a path, a parsed plan or a compiled plan.
        mesh: as for `planc.apply`; by default built over the default process group.

    Returns:
        The `AppliedPlan`.

    Raises:
        PlanError: P605 if the model is not a transformers model whose Trainer takes a sharded
            model as it is (checked before anything changes); else whatever `planc.apply` raises.
    """
    if not hasattr(type(model), MARK):
        raise PlanError([not_trainer_model(model)])
    from planc.backends.runtime import apply
    applied = apply(model, plan, mesh=mesh)
    setattr(model, MARK, True)
    # The Trainer reads the data-parallel layout from here (gradient accumulation defers the
    # reduce-scatter, or with HSDP only the all-reduce across replicas, to the last micro-batch).
    model.config.distributed_config = distributed_config(applied.mesh, applied.compiled.mesh)
    return applied


def trainer_arguments(applied) -> dict:
    """The `TrainingArguments` keywords the plan's `step` line stands for, so that the Trainer
    accumulates as planc estimated: `gradient_accumulation_steps` = the microbatches (the
    Trainer's `per_device_train_batch_size` is then one microbatch: the plan's step batch / N);
    `sync = last` is the Trainer's own default (it turns FSDP2's gradient sync off before all but
    the last microbatch of a model sharded this way); `sync = every` adds accelerate's
    `sync_each_batch`.

        TrainingArguments(..., **trainer_arguments(applied))

    Raises:
        PlanError: P607 for `sync = last` on a mesh with replicas, where the Trainer defers only the
            all-reduce across replicas.
    """
    from planc.resolve.mesh import Role
    schedule = applied.compiled.job.schedule
    out: dict = {"gradient_accumulation_steps": schedule.microbatches}
    if schedule.microbatches == 1:
        return out
    if schedule.gradient_sync == "every":
        out["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
        return out
    replicas = dict(zip(applied.mesh.mesh_dim_names or (), applied.mesh.mesh.shape)).get(
        applied.compiled.mesh.axis_name(Role.REPLICATE), 1)
    if replicas > 1:
        step = schedule.origin
        raise PlanError([Diagnostic(
            code="P607", severity="error", span=step.span if step is not None else None,
            message=f"the Trainer would reduce-scatter every microbatch on this mesh ({replicas} replicas): it "
                    "defers only the all-reduce across replicas, not what `sync = last` estimates",
            label="sync = last", help=("write `sync = every`, or train without a replicate axis",))])
    return out


def distributed_config(mesh, axes):
    """transformers' `DistributedConfig` for a planc mesh: the shard axis -> fsdp, the replicate
    axis -> replicas, found by their roles in the plan (`axes`, the compiled plan's `Mesh`), since a
    plan names its axes as it likes (`mesh (dp_replicate = 2, fsdp = *)`)."""
    from transformers.distributed import DistributedConfig

    from planc.resolve.mesh import Role
    sizes = dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape))

    def size(role: Role) -> int:
        return sizes.get(axes.axis_name(role), 1)
    return DistributedConfig(fsdp_size=size(Role.SHARD), dp_replicate_size=size(Role.REPLICATE))


def not_trainer_model(model: nn.Module) -> Diagnostic:
    """P605: the model's class has no flag the Trainer reads to leave a sharded model alone."""
    try:
        import transformers
        version = f"transformers {transformers.__version__}"
    except ImportError:
        version = "transformers is not installed"
    return Diagnostic(code="P605", severity="error", span=None,
                      message=f"`{type(model).__name__}` is not a model transformers' Trainer trains "
                              f"sharded as it is ({version})",
                      notes=(f"its class has no `{MARK}` (transformers >= 5 `PreTrainedModel`s have it)",),
                      help=("pass the `PreTrainedModel` itself (not a wrapper), with transformers 5 or newer; "
                            "or call `planc.apply` and train it with your own loop",))
