"""Mesh checks: rank counts within planc's limit (P407), the mesh against the world size
(P401), reshard group sizes (P402, P406), and parameter placements against their shapes and
the shard size (P403, P404)."""

from __future__ import annotations

import math
from typing import Iterator

from planc.checks.context import Context, by_key, err, listed
from planc.diagnostics import Diagnostic
from planc.lang import syntax as st
from planc.limits import MAX_RANKS
from planc.resolve.mesh import RULE


def too_many_ranks(n: int, span, what: str) -> Diagnostic:
    """P407 for a rank count above `MAX_RANKS` (`what`: `mesh dimension `shard``, ...)."""
    shown = f"{n:,}" if n < 10**30 else f"a {len(str(n))}-digit number of"
    return err("P407", f"{what} asks for {shown} ranks, more than planc's limit of {MAX_RANKS:,}", span,
               "too many ranks", ("write the number of ranks the job runs on, or `*` to fill the world",))


def check_rank_limits(ctx: Context) -> Iterator[Diagnostic]:
    """P407: no mesh axis, and no mesh, holds more than `MAX_RANKS` ranks."""
    for s in ctx.plan.statements:
        if not isinstance(s, st.MeshStmt):
            continue
        big = [a for a in s.axes if a.size is not None and a.size > MAX_RANKS]
        for a in big:
            yield too_many_ranks(a.size, a.span, f"mesh dimension `{a.name}`")
    mesh = ctx.res.mesh
    total = mesh.fixed_world
    if total is not None and total > MAX_RANKS and mesh.span is not None \
            and max(a.size for a in mesh.axes) <= MAX_RANKS:
        yield too_many_ranks(total, mesh.span, f"mesh {mesh}")


def _small_divisors(n: int, limit: int = 12) -> list[int]:
    """The `limit` smallest divisors of `n`, from the pairs (d, n // d) with d <= sqrt(n)."""
    found: set[int] = set()
    d = 1
    while d * d <= n:
        if n % d == 0:
            found.update((d, n // d))
        d += 1
    return sorted(found)[:limit]


def check_mesh(ctx: Context) -> Iterator[Diagnostic]:
    """P401: the mesh must multiply to the world size."""
    mesh, world = ctx.res.mesh, ctx.world_size
    if world is None or mesh.span is None:
        return
    sizes = [a.size for a in mesh.axes if RULE[a.role].multiplies]  # the expert axis borrows its ranks
    fixed = math.prod(n for n in sizes if n is not None)
    if None not in sizes and fixed != world:
        yield err("P401", f"mesh {mesh} has {fixed} ranks, but the world size is {world}", mesh.span,
                  " x ".join(map(str, sizes)) + f" != {world}", ("use `*` for one dimension to fill the world",))
    elif None in sizes and fixed and world % fixed:
        yield err("P401", f"mesh {mesh} cannot fill a world of {world} ranks", mesh.span,
                  f"{world} is not a multiple of {fixed}", (f"pick a size that divides {world}",))


def check_reshard_size(ctx: Context) -> Iterator[Diagnostic]:
    """P402: `reshard after_forward = N` needs N to divide the shard size."""
    sizes = ctx.mesh_sizes
    if sizes is None or sizes[1] is None:
        return
    shard = sizes[1]
    if shard > MAX_RANKS:
        return  # P407
    found = []
    for u in ctx.res.units:
        value = u["reshard_after_forward"]
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if value > shard or shard % value:
            setting = u.settings["reshard_after_forward"]
            found.append(((setting.span or u.span, value), u.name))
    yield from _degenerate_reshard(ctx, shard)
    divisors = _small_divisors(shard) if found else []
    for (span, value), units in by_key(found).items():
        yield err("P402", f"unit{'s' * (len(units) > 1)} {listed(units)} reshard{'s' * (len(units) == 1)} to "
                  f"groups of {value}, which does not divide the shard size {shard}", span,
                  f"{value} does not divide {shard}", ("choose one of " + ", ".join(map(str, divisors[:12])),))


def _degenerate_reshard(ctx: Context, shard: int) -> Iterator[Diagnostic]:
    """P406: an int reshard size of 1 or of the whole shard group is really a boolean."""
    seen = set()
    for u in ctx.res.units:
        value = u["reshard_after_forward"]
        if isinstance(value, bool) or not isinstance(value, int) or value not in (1, shard):
            continue
        span = u.settings["reshard_after_forward"].span or u.span
        if span in seen:
            continue
        seen.add(span)
        same = "false" if value == 1 else "true"
        yield err("P406", f"`reshard after_forward = {value}` on a shard group of {shard} is the same as "
                  f"`{same}`", span, f"means {same}", (f"write `reshard after_forward = {same}`",),
                  severity="warning")


def check_placements(ctx: Context) -> Iterator[Diagnostic]:
    """P403/P404: `Shard(d)` must name an existing dim, divisible by the shard size when d != 0."""
    sizes = ctx.mesh_sizes
    missing, uneven = [], []
    for name, (dim, span) in ctx.res.placements.items():
        shape = ctx.graph.params[name].shape
        if dim >= len(shape):
            missing.append(((span, dim, len(shape)), name))
        elif dim and sizes is not None and sizes[1] and shape[dim] % sizes[1]:
            uneven.append(((span, dim, shape[dim], sizes[1]), name))
    for (span, dim, ndim), names in by_key(missing).items():
        yield err("P403", f"`Shard({dim})` on {listed(names)}, which ha{'ve' if len(names) > 1 else 's'} "
                  f"only {ndim} dim(s)", span, "no such dimension",
                  (f"use a dim below {ndim}" if ndim else "a 0-dim parameter cannot be sharded; `ignore` it",))
    for (span, dim, size, shard), names in by_key(uneven).items():
        yield err("P404", f"`Shard({dim})` on {listed(names)}: dim {dim} has size {size}, not divisible by "
                  f"the shard size {shard}", span, f"{size} % {shard} != 0",
                  ("use `Shard(0)` (padded automatically) or a shard size that divides it",))
