"""The device mesh a plan asks for: named axes with roles, sized from the world by one table.

Modelled on torchtitan's `ParallelDims`: each axis has a *role* (what planc does along it,
`Role`) and a *name*, the name the real `DeviceMesh` axis gets: the word the plan wrote.
`mesh (replicate = 2, shard = *)` builds axes `("replicate", "shard")`, torchtitan's spelling
`mesh (dp_replicate = 2, fsdp = *)` builds `("dp_replicate", "fsdp")`. "Axis" always means a
mesh axis here; "dim" is a tensor dimension (`Shard(dim)`).

Every rule about a role lives in its row of `RULES` (outermost first): the words that name
it, whether the mesh has it unwritten and at what size, whether it multiplies into the world
or borrows ranks from other axes (expert parallelism: torchtitan's expert mesh reuses the
shard x context x tensor ranks), whether FSDP shards over it, whether the dense `DeviceMesh`
drops it at size 1, and whether planc builds it yet (P408 otherwise). A new axis is a row
flipped to `built`, not code in the resolver.

One contract for sizes: `Mesh.sizes(world)` returns every axis's size by role, the axes that
multiply into the world multiplying to it, or None when the mesh cannot fill that world (or,
with a `*`, when no world is known).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Mapping

from planc.diagnostics import Diagnostic, Span, suggestion
from planc.lang import syntax as st


class Role(enum.StrEnum):
    """What planc does along a mesh axis (a `str`: `Role.SHARD == "shard"`)."""

    PIPELINE = "pipeline"
    REPLICATE = "replicate"
    SHARD = "shard"
    CONTEXT = "context"
    TENSOR = "tensor"
    EXPERT = "expert"


@dataclass(frozen=True)
class RoleRule:
    """One role's rules: one row of `RULES`.

    Attributes:
        role: the role.
        words: the plan words naming it, its own word first (`shard`, `dp_shard`, `fsdp`).
        what: the role in the user's words (`tensor parallelism`).
        implied: the mesh has this axis even when the plan does not write it, of size
            `default` (None: `*`, it fills the world).
        multiplies: the axis's ranks multiply into the world; False for an axis that borrows
            its ranks from the axes in `borrows` (its `*` then means all of them).
        data_parallel: `fully_shard` shards or replicates over it.
        omit_at_one: the dense `DeviceMesh` leaves the axis out when its size is 1 (a
            replicate axis of 1 is plain FSDP, not HSDP).
        built: planc builds the axis; otherwise a mesh naming it is P408.
        star_help: how to fix a second `*` when this axis is one of them (P405).
    """

    role: Role
    words: tuple[str, ...]
    what: str
    implied: bool = False
    default: int | None = 1
    multiplies: bool = True
    borrows: tuple[Role, ...] = ()
    data_parallel: bool = False
    omit_at_one: bool = False
    built: bool = False
    star_help: str = ""


# The roles, outermost axis first: the order the dense `DeviceMesh` has them in (torchtitan's
# pp, dp_replicate, dp_shard, cp, tp), whatever order the plan writes them in.
RULES: tuple[RoleRule, ...] = (
    RoleRule(Role.PIPELINE, ("pipeline", "pp"), "pipeline parallelism", built=True,
             star_help="fix the pipeline size, e.g. `mesh (pipeline = 4, shard = *)`"),
    RoleRule(Role.REPLICATE, ("replicate", "dp_replicate"), "data parallelism (replicated)", implied=True,
             default=1, data_parallel=True, omit_at_one=True, built=True,
             star_help="fix one size, e.g. `mesh (replicate = *, shard = 8)`"),
    RoleRule(Role.SHARD, ("shard", "dp_shard", "fsdp"), "data parallelism (sharded)", implied=True, default=None,
             data_parallel=True, built=True, star_help="fix one size, e.g. `mesh (replicate = *, shard = 8)`"),
    RoleRule(Role.CONTEXT, ("context", "cp"), "context parallelism", built=True,
             star_help="fix the context-parallel size, e.g. `mesh (shard = *, context = 4)`"),
    RoleRule(Role.TENSOR, ("tensor", "tp"), "tensor parallelism", built=True,
             star_help="fix the tensor-parallel size, e.g. `mesh (shard = *, tensor = 8)`"),
    RoleRule(Role.EXPERT, ("expert", "ep"), "expert parallelism", multiplies=False,
             borrows=(Role.SHARD, Role.CONTEXT, Role.TENSOR), built=True,
             star_help="fix the expert size, e.g. `mesh (shard = *, expert = 8)`"),
)
RULE: Mapping[Role, RoleRule] = {r.role: r for r in RULES}
# The words a plan may use for a mesh axis, and the role each names.
ROLES: Mapping[str, Role] = {word: r.role for r in RULES for word in r.words}
DATA_PARALLEL = tuple(r.role for r in RULES if r.data_parallel)  # outermost first
BUILT = tuple(r.role for r in RULES if r.built)


@dataclass(frozen=True, slots=True)
class Axis:
    """One mesh axis: its role, its size (None for `*`) and its `DeviceMesh` axis name."""

    role: Role
    size: int | None
    name: str

    def __str__(self) -> str:
        return f"{self.name} = {'*' if self.size is None else self.size}"


def _axes(sizes: Mapping[Role, int | None], names: Mapping[Role, str]) -> tuple[Axis, ...]:
    """The axes of the roles in `sizes` and the implied ones, in `RULES` order."""
    return tuple(Axis(r.role, sizes[r.role] if r.role in sizes else r.default, names.get(r.role, r.role.value))
                 for r in RULES if r.role in sizes or r.implied)


@dataclass(frozen=True)
class Mesh:
    """The plan's mesh: named axes, outermost first (by default 1-D FSDP: replicate 1 x shard `*`)."""

    axes: tuple[Axis, ...] = _axes({}, {})
    span: Span | None = None

    @classmethod
    def of(cls, sizes: Mapping[Role, int | None], names: Mapping[Role, str] | None = None, *,
           span: Span | None = None) -> "Mesh":
        """The mesh of the roles in `sizes` (None: `*`), the implied axes added, ordered by `RULES`."""
        return cls(_axes(sizes, names or {}), span)

    @classmethod
    def data_parallel(cls, replicate: int | None = 1, shard: int | None = None, *, span: Span | None = None,
                      names: tuple[str, str] = DATA_PARALLEL) -> "Mesh":
        """A replicate x shard mesh (`None` sizes are `*`): 1-D FSDP when replicate is 1, else HSDP."""
        return cls.of({Role.REPLICATE: replicate, Role.SHARD: shard}, dict(zip(DATA_PARALLEL, names)), span=span)

    # ----------------------------------------------------------------- axes
    def axis(self, role: Role | str) -> Axis | None:
        return next((a for a in self.axes if a.role == role), None)

    def axis_name(self, role: Role | str) -> str | None:
        """The `DeviceMesh` axis name of `role`'s axis, or None without one."""
        a = self.axis(role)
        return None if a is None else a.name

    @property
    def replicate(self) -> int | None:
        """Size of the replicate axis (1 when there is none; None for `*`)."""
        a = self.axis(Role.REPLICATE)
        return 1 if a is None else a.size

    @property
    def shard(self) -> int | None:
        """Size of the shard axis (None for `*`)."""
        a = self.axis(Role.SHARD)
        return 1 if a is None else a.size

    @property
    def is_hsdp(self) -> bool:
        return self.replicate != 1

    @property
    def device_axes(self) -> tuple[Axis, ...]:
        """The axes of the dense `DeviceMesh` planc builds: those multiplying into the world,
        outermost first, without the ones `RoleRule.omit_at_one` drops at size 1."""
        return tuple(a for a in self.axes if RULE[a.role].multiplies
                     and not (RULE[a.role].omit_at_one and a.size == 1))

    @property
    def dp_axes(self) -> tuple[Axis, ...]:
        """The axes `fully_shard` runs on: (shard,) for FSDP, (replicate, shard) for HSDP."""
        return tuple(a for a in self.device_axes if RULE[a.role].data_parallel)

    @property
    def dp_axis_names(self) -> tuple[str, ...]:
        """The `DeviceMesh` axis names of the data-parallel submesh, outermost first."""
        return tuple(a.name for a in self.dp_axes)

    @property
    def flattened(self) -> dict[str, tuple[str, ...]]:
        """The axes `fully_shard` needs flattened into one: name -> the axes it joins, outermost first.

        With a context axis, FSDP shards over shard x context as *one* axis (`dp_shard_cp` in
        torchtitan): given the 2-D (shard, context) mesh, `fully_shard` would replicate over
        its first axis instead (silent HSDP; tests/test_context_dist.py shows it). The name
        joins the plan's words: `shard_context`, `dp_shard_cp`.
        """
        context, shard = self.axis(Role.CONTEXT), self.axis(Role.SHARD)
        if context is None or shard is None:
            return {}
        return {f"{shard.name}_{context.name}": (shard.name, context.name)}

    @property
    def fsdp_axis_names(self) -> tuple[str, ...]:
        """The axis names `fully_shard` runs on: the data-parallel ones, with shard x context
        flattened into one (`flattened`) when the mesh has a context axis."""
        flat = self.flattened
        if not flat:
            return self.dp_axis_names
        (name, (shard, _)), = flat.items()
        return tuple(name if a == shard else a for a in self.dp_axis_names)

    # ----------------------------------------------------------------- sizes
    @property
    def _world_axes(self) -> tuple[Axis, ...]:
        return tuple(a for a in self.axes if RULE[a.role].multiplies)

    @property
    def fixed_world(self) -> int | None:
        """The world size when every axis that multiplies into it is fixed, else None."""
        axes = self._world_axes
        if any(a.size is None for a in axes):
            return None
        return math.prod(a.size for a in axes)  # type: ignore[misc]

    def sizes(self, world: int | None = None) -> dict[str, int] | None:
        """Every axis's size by role, the world's axes multiplying to `world`; None when that cannot be.

        At most one of the world's axes is `*` (two are P405); it takes what the others leave.
        An axis that borrows its ranks (`RoleRule.borrows`) has its own size, or with `*` the
        product of the axes it borrows from. Without a world, only a fully fixed mesh has sizes.
        """
        axes = self._world_axes
        free = [a for a in axes if a.size is None]
        fixed = math.prod(a.size for a in axes if a.size is not None)  # type: ignore[misc]
        if len(free) > 1 or fixed < 1:
            return None
        if world is None:
            if free:
                return None
            out = {a.role: a.size for a in axes}
        elif world < 1 or world % fixed or (not free and fixed != world):
            return None
        else:
            out = {a.role: (world // fixed if a.size is None else a.size) for a in axes}
        for a in self.axes:
            if not RULE[a.role].multiplies:
                out[a.role] = a.size or self.borrowed(a.role, out)
        return out  # type: ignore[return-value]

    @staticmethod
    def borrowed(role: Role | str, sizes: Mapping[str, int]) -> int:
        """How many ranks `role` borrows from (the product of its lenders' sizes in `sizes`).

        For the expert axis this is shard x context x tensor; the experts' own FSDP degree
        is that divided by the expert size (torchtitan's `efsdp`).
        """
        return math.prod(sizes.get(r, 1) for r in RULE[Role(role)].borrows)

    def dp_sizes(self, world: int | None) -> tuple[int, int] | None:
        """(replicate, shard) at `world` ranks, or None when the mesh cannot fill it; `shard` is
        the group FSDP shards over: shard x context with a context axis (`flattened`)."""
        sizes = self.sizes(world)
        if sizes is None:
            return None
        return sizes.get(Role.REPLICATE, 1), sizes.get(Role.SHARD, 1) * sizes.get(Role.CONTEXT, 1)

    def __str__(self) -> str:
        return "(" + ", ".join(str(a) for a in self.axes) + ")"


# ===================================================================== the `mesh` statement


def resolve_mesh(stmt: st.MeshStmt | None, diags: list[Diagnostic]) -> Mesh:
    """The mesh a `mesh` statement means (the default 1-D mesh without one), by `RULES`.

    An axis's word names its role (`shard`, `dp_shard` and `fsdp` all shard) and the
    `DeviceMesh` axis it becomes. FSDP1 strategy words map to mesh shapes with a P901 note.
    A mesh with an error resolves to the default mesh, which fits any world (one error, no
    cascade).
    """
    if stmt is None:
        return Mesh()
    sizes: dict[Role, int | None] = {}
    names: dict[Role, str] = {}
    unbuilt = False
    for ax in stmt.axes:
        role = ROLES.get(ax.name)
        if role is None:
            diags.append(Diagnostic(code="P102", severity="error", message=f"unknown mesh dimension `{ax.name}`",
                                    span=ax.span, label="not a mesh dimension",
                                    help=suggestion(ax.name, ROLES) or (
                                        "mesh dimensions: " + ", ".join(f"`{r}`" for r in BUILT),)))
            continue
        if not RULE[role].built:
            built = ", ".join(f"`{r}`" for r in BUILT[:-1]) + f" and `{BUILT[-1]}`"
            written = f"{ax.name} = {'*' if ax.size is None else ax.size}"
            diags.append(Diagnostic(code="P408", severity="error",
                                    message=f"mesh axis `{ax.name}` ({RULE[role].what}) is not supported yet",
                                    span=ax.span, label=("an " if role[0] in "aeiou" else "a ") + f"{role} axis",
                                    help=(f"remove `{written}` from the mesh: planc builds the {built} axes today",)))
            unbuilt = True
            continue
        if role in sizes:
            diags.append(Diagnostic(code="P103", severity="error", message=f"mesh dimension `{role}` given twice",
                                    span=ax.span, label="repeated", help=(f"keep one `{role} = ...`",)))
        if ax.size is not None and ax.size < 1:
            diags.append(Diagnostic(code="P103", severity="error", message=f"mesh dimension `{role}` must be at least 1",
                                    span=ax.span, label=f"{ax.size} ranks",
                                    help=(f"write a rank count such as `{role} = 8`, or `{role} = *` to fill the world",)))
            continue
        sizes[role], names[role] = ax.size, ax.name
    if unbuilt:
        return Mesh(span=stmt.span)
    if stmt.strategy is not None:
        return _fsdp1_mesh(stmt, sizes, names, diags)
    mesh = Mesh.of(sizes, names, span=stmt.span)
    return mesh if _one_star(mesh, stmt, diags) else Mesh(span=stmt.span)


def _one_star(mesh: Mesh, stmt: st.MeshStmt, diags: list[Diagnostic]) -> bool:
    """P405 unless at most one of the world's axes is `*`; the help is that of the innermost
    starred axis that does not fill the world by default (`RoleRule.star_help`)."""
    world_axes = [a for a in mesh.axes if RULE[a.role].multiplies]
    stars = [a for a in world_axes if a.size is None]
    if len(stars) < 2:
        return True
    blamed = next((a for a in reversed(stars) if not (RULE[a.role].implied and RULE[a.role].default is None)),
                  stars[-1])
    n = len(stars)
    count = "both" if n == len(world_axes) == 2 else ("two", "three", "four", "five")[min(n, 5) - 2]
    diags.append(Diagnostic(code="P405", severity="error", message=f"{count} mesh dimensions are `*`",
                            span=stmt.span, label="cannot split the world " + ("two" if n == 2 else str(n)) + " ways",
                            help=(RULE[blamed.role].star_help,)))
    return False


# FSDP1 sharding strategy -> (replicate, shard) sizes (None: `*`; SHARD: the shard size written)
_WRITTEN = object()
FSDP1_MESHES: Mapping[str, tuple[int | None, object]] = {
    "FULL_SHARD": (1, None), "SHARD_GRAD_OP": (1, None), "NO_SHARD": (None, 1),
    "HYBRID_SHARD": (None, _WRITTEN), "_HYBRID_SHARD_ZERO2": (None, _WRITTEN)}


def _fsdp1_mesh(stmt: st.MeshStmt, sizes: Mapping[Role, int | None], names: Mapping[Role, str],
                diags: list[Diagnostic]) -> Mesh:
    """The mesh an FSDP1 strategy word stands for (P901 note), or the default mesh on an error."""
    word = stmt.strategy
    if word not in FSDP1_MESHES:
        diags.append(Diagnostic(code="P102", severity="error", message=f"unknown sharding strategy `{word}`",
                                span=stmt.strategy_span, label="not a strategy",
                                help=suggestion(word, FSDP1_MESHES) or ("strategies are " + ", ".join(FSDP1_MESHES),)))
        return Mesh(span=stmt.span)
    replicate, shard = FSDP1_MESHES[word]
    if shard is _WRITTEN:
        shard = sizes.get(Role.SHARD)
        if shard is None:
            diags.append(Diagnostic(code="P103", severity="error", message=f"`{word}` needs the shard group size",
                                    span=stmt.span, label="how many ranks per shard group?",
                                    help=(f"write `mesh {word} (shard = 8)` for 8 ranks per node",)))
            return Mesh(span=stmt.span)
    mesh = Mesh.data_parallel(replicate, shard, span=stmt.span,  # type: ignore[arg-type]
                              names=tuple(names.get(r, r.value) for r in DATA_PARALLEL))  # type: ignore[arg-type]
    note = (" (resharding is a unit setting: `reshard after_forward = false`)" if word in
            ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2") else "")
    diags.append(Diagnostic(code="P901", severity="note", message=f"FSDP1 `{word}` mapped to FSDP2",
                            span=stmt.strategy_span, label=f"became mesh {mesh}",
                            help=(f"the FSDP2 spelling is `mesh {mesh}`{note}",)))
    return mesh
