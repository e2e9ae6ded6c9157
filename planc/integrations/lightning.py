"""Shard a LightningModule's model with a plan inside Lightning's `ModelParallelStrategy`.

Lightning (2.4+) builds a 2-D device mesh `(data_parallel, tensor_parallel)` and calls the
module's `configure_model()` hook, where the module shards itself; the optimizer is made
after. `shard_in_configure_model(module.model, plan, module.device_mesh)` applies a plan on
the mesh's `data_parallel` dimension (with an HSDP plan, on that dimension split as the
plan's `mesh` says). Run it with `ModelParallelStrategy(data_parallel_size=N,
tensor_parallel_size=1)`; tensor parallelism is not planned by planc. See docs/trainers.md.
"""

from __future__ import annotations

from torch import nn


def shard_in_configure_model(model: nn.Module, plan, device_mesh):
    """`planc.apply(model, plan)` on Lightning's data-parallel mesh; the `AppliedPlan`.

    Args:
        model: the module to shard (e.g. `self.model` of the LightningModule), not yet sharded.
        plan: as for `planc.apply`.
        device_mesh: `LightningModule.device_mesh`, as `ModelParallelStrategy` sets it.

    Raises:
        PlanError: as `planc.apply` does; P602 if the data-parallel size does not fit the plan.
    """
    from planc.backends.runtime import apply
    mesh = device_mesh["data_parallel"] if "data_parallel" in (device_mesh.mesh_dim_names or ()) else device_mesh
    return apply(model, plan, mesh=mesh)
