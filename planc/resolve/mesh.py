"""The device mesh a plan asks for: an ordered tuple of named axes, sizes filled from the world.

Modelled on torchtitan's `ParallelDims`: each axis has a *role* (what planc does along it:
`replicate` or `shard` for data parallelism, `tensor` for tensor parallelism, the innermost
axis; `expert` and `context` are left for later) and a *dimension name*, the name the real
`DeviceMesh` dimension gets. The name is the word the plan wrote: `mesh (replicate = 2,
shard = *)` builds dimensions `("replicate", "shard")`, torchtitan's spelling
`mesh (dp_replicate = 2, fsdp = *)` builds `("dp_replicate", "fsdp")`.

One contract for sizes: `Mesh.sizes(world)` returns every axis's size, multiplying to the
world, or None when the mesh cannot fill that world (or, with a `*`, when no world is known).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planc.diagnostics import Span

# The words a plan may use for a mesh dimension, and the role each names.
ROLES: dict[str, str] = {
    "replicate": "replicate", "dp_replicate": "replicate",
    "shard": "shard", "dp_shard": "shard", "fsdp": "shard",
    "tensor": "tensor", "tp": "tensor",
}
DATA_PARALLEL = ("replicate", "shard")  # the data-parallel roles, outermost first
TENSOR = "tensor"                        # the tensor-parallel role (innermost: within a node)


@dataclass(frozen=True, slots=True)
class Axis:
    """One mesh dimension: its role, its size (None for `*`) and its `DeviceMesh` name."""

    role: str
    size: int | None
    dim: str

    def __str__(self) -> str:
        return f"{self.dim} = {'*' if self.size is None else self.size}"


def _axes(replicate: int | None, shard: int | None, names: tuple[str, str]) -> tuple[Axis, ...]:
    return (Axis("replicate", replicate, names[0]), Axis("shard", shard, names[1]))


@dataclass(frozen=True)
class Mesh:
    """The plan's mesh: named axes, outermost first (data parallel: replicate x shard)."""

    axes: tuple[Axis, ...] = _axes(1, None, DATA_PARALLEL)
    span: Span | None = None

    @classmethod
    def data_parallel(cls, replicate: int | None = 1, shard: int | None = None, *, span: Span | None = None,
                      names: tuple[str, str] = DATA_PARALLEL) -> "Mesh":
        """A replicate x shard mesh (`None` sizes are `*`): 1-D FSDP when replicate is 1, else HSDP."""
        return cls(_axes(replicate, shard, names), span)

    # ----------------------------------------------------------------- axes
    def axis(self, role: str) -> Axis | None:
        return next((a for a in self.axes if a.role == role), None)

    @property
    def replicate(self) -> int | None:
        """Size of the replicate axis (1 when there is none; None for `*`)."""
        a = self.axis("replicate")
        return 1 if a is None else a.size

    @property
    def shard(self) -> int | None:
        """Size of the shard axis (None for `*`)."""
        a = self.axis("shard")
        return 1 if a is None else a.size

    @property
    def tensor_dim(self) -> str | None:
        """The `DeviceMesh` dimension name of the tensor-parallel axis, or None without one."""
        a = self.axis(TENSOR)
        return None if a is None else a.dim

    @property
    def is_hsdp(self) -> bool:
        return self.replicate != 1

    @property
    def dp_axes(self) -> tuple[Axis, ...]:
        """The axes `fully_shard` runs on: (shard,) for FSDP, (replicate, shard) for HSDP."""
        return tuple(a for a in self.axes if a.role in DATA_PARALLEL and (a.role == "shard" or self.is_hsdp))

    @property
    def device_axes(self) -> tuple[Axis, ...]:
        """The axes of the `DeviceMesh` planc builds: the data-parallel axes, then the tensor axis if any."""
        return self.dp_axes + tuple(a for a in self.axes if a.role == TENSOR)

    @property
    def dp_dims(self) -> tuple[str, ...]:
        """The `DeviceMesh` dimension names of the data-parallel submesh, outermost first."""
        return tuple(a.dim for a in self.dp_axes)

    # ----------------------------------------------------------------- sizes
    @property
    def fixed_world(self) -> int | None:
        """The world size when every axis is fixed, else None."""
        if any(a.size is None for a in self.axes):
            return None
        return math.prod(a.size for a in self.axes)  # type: ignore[misc]

    def sizes(self, world: int | None = None) -> dict[str, int] | None:
        """Every axis's size by role, multiplying to `world`; None when that cannot be.

        At most one axis is `*` (two are P405); it takes what the others leave. Without a
        world, only a fully fixed mesh has sizes.
        """
        free = [a for a in self.axes if a.size is None]
        fixed = math.prod(a.size for a in self.axes if a.size is not None)  # type: ignore[misc]
        if len(free) > 1 or fixed < 1:
            return None
        if world is None:
            return None if free else {a.role: a.size for a in self.axes}  # type: ignore[misc]
        if world < 1 or world % fixed or (not free and fixed != world):
            return None
        return {a.role: (world // fixed if a.size is None else a.size) for a in self.axes}

    def dp_sizes(self, world: int | None) -> tuple[int, int] | None:
        """(replicate, shard) at `world` ranks, or None when the mesh cannot fill it."""
        sizes = self.sizes(world)
        return None if sizes is None else (sizes.get("replicate", 1), sizes.get("shard", 1))

    def __str__(self) -> str:
        return "(" + ", ".join(str(a) for a in self.axes) + ")"
