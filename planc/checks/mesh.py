"""Mesh checks: the mesh against the world size (P401), reshard group sizes (P402, P406), and
parameter placements against their shapes and the shard size (P403, P404)."""

from __future__ import annotations

from typing import Iterator

from planc.checks.context import Context, by_key, err, listed
from planc.diagnostics import Diagnostic


def check_mesh(ctx: Context) -> Iterator[Diagnostic]:
    """P401: the mesh must multiply to the world size."""
    mesh, world = ctx.res.mesh, ctx.world_size
    if world is None or mesh.span is None:
        return
    r, s = mesh.replicate, mesh.shard
    if r is not None and s is not None and r * s != world:
        yield err("P401", f"mesh {mesh} has {r * s} ranks, but the world size is {world}", mesh.span,
                  f"{r} x {s} != {world}", ("use `*` for one dimension to fill the world",))
    elif (r is None and s and world % s) or (s is None and r and world % r):
        fixed = s if r is None else r
        yield err("P401", f"mesh {mesh} cannot fill a world of {world} ranks", mesh.span,
                  f"{world} is not a multiple of {fixed}", (f"pick a size that divides {world}",))


def check_reshard_size(ctx: Context) -> Iterator[Diagnostic]:
    """P402: `reshard after_forward = N` needs N to divide the shard size."""
    sizes = ctx.mesh_sizes
    if sizes is None or sizes[1] is None:
        return
    shard = sizes[1]
    found = []
    for u in ctx.res.units:
        value = u["reshard_after_forward"]
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if value > shard or shard % value:
            setting = u.settings["reshard_after_forward"]
            found.append(((setting.span or u.span, value), u.name))
    divisors = [d for d in range(1, shard + 1) if shard % d == 0]
    yield from _degenerate_reshard(ctx, shard)
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
