"""Precision checks: dtypes that meet without a conversion between units (P304), and ignored
parameters left in their own dtype inside a casting unit (P308)."""

from __future__ import annotations

from typing import Iterator

import torch

from planc.checks.context import Context, by_key, err, listed
from planc.diagnostics import Diagnostic
from planc.lower.lowering import policy_of
from planc.lower.program import Precision
from planc.resolve.ir import Unit
from planc.resolve.options import DTYPE_NAMES


def check_ignored_precision(ctx: Context) -> Iterator[Diagnostic]:
    """P308: an ignored parameter stays in its own dtype inside a unit that casts the others."""
    g, res = ctx.graph, ctx.res
    by_span: dict = {}
    for name, span in res.ignored.items():
        owner = res.enclosing(g.owners(name)[0], g)
        if owner is None or owner["param_dtype"] is None or owner["param_dtype"] == g.params[name].dtype:
            continue
        by_span.setdefault(span, []).append((name, owner))
    for span, hits in by_span.items():
        name, owner = hits[0]
        more = f" (and {len(hits) - 1} more)" if len(hits) > 1 else ""
        yield err("P308", f"ignored parameter `{name}`{more} stays {DTYPE_NAMES.get(g.params[name].dtype, '?')} "
                  f"in unit `{owner.name}`, which computes in {DTYPE_NAMES[owner['param_dtype']]}", span,
                  "FSDP2 does not cast ignored parameters",
                  ("cast it in the model's forward, or do not ignore it",), severity="warning")


def _precision(u: Unit, cache: dict[int, Precision] | None = None) -> Precision:
    """The unit's precision with FSDP2's defaults applied (planc/lower: the one place they live);
    with `cache` (unit id -> precision, one context's units), each unit's policy is built once."""
    if cache is None:
        return policy_of(u).precision
    found = cache.get(id(u))
    if found is None:
        found = cache[id(u)] = policy_of(u).precision
    return found


def _dtype(u: Unit, model_dtype: torch.dtype, cache: dict[int, Precision] | None = None) -> torch.dtype:
    return _precision(u, cache).compute_dtype(model_dtype)


def check_precision(ctx: Context) -> Iterator[Diagnostic]:
    """P304: an inner unit computing in another dtype than the unit around it, unbridged."""
    g = ctx.graph
    model_dtype = next(iter(g.params.values())).dtype if g.params else torch.float32
    cache = _precisions(ctx)
    found = []
    for u in ctx.inner_units():
        outer = _outer(ctx, u)
        if outer is None:
            continue
        du, do = _dtype(u, model_dtype, cache), _dtype(outer, model_dtype, cache)
        if du == do:
            continue
        gaps = []
        if not _precision(u, cache).casts_inputs:
            gaps.append(f"its inputs arrive in {DTYPE_NAMES[do]} but it computes in {DTYPE_NAMES[du]}")
        if u["output_dtype"] != do:
            gaps.append(f"its outputs return in {DTYPE_NAMES[u['output_dtype'] or du]} to {{outer}} "
                        f"({DTYPE_NAMES[do]})")
        if gaps:
            setting = u.settings["param_dtype"]
            found.append(((setting.span or u.span, du, do, tuple(gaps)), (u.name, outer.name)))
    for (span, du, do, gaps), pairs in by_key(found).items():
        inner, outer = [i for i, _ in pairs], list(dict.fromkeys(o for _, o in pairs))
        where = f"`{outer[0]}`" if len(outer) == 1 else f"the unit{'s' * (len(inner) > 1)} around them"
        gaps = tuple(g.format(outer=where) for g in gaps)
        yield err("P304", f"unit{'s' * (len(inner) > 1)} {listed(inner)} run{'s' * (len(inner) == 1)} in "
                  f"{DTYPE_NAMES[du]} inside {where} ({DTYPE_NAMES[do]})",
                  span, "; ".join(gaps), (
                      f"on {listed(inner, 1) if len(inner) == 1 else 'these units'} set `precision param = "
                      f"{DTYPE_NAMES[du]}, output = {DTYPE_NAMES[do]}, cast_inputs = true`",
                      "or give both units the same param dtype"))

    yield from _sibling_precision(ctx, model_dtype)


def _precisions(ctx: Context) -> dict[int, Precision]:
    """Unit id -> its precision, filled as the checks here ask (the context holds the units)."""
    return ctx.memo("precision.units", dict)


def _outer(ctx: Context, u: Unit) -> Unit | None:
    """The unit around `u`: the one that manages the parent of its first module."""
    parent = next(ctx.graph.ancestors(u.modules[0]), None)
    return None if parent is None else ctx.res.enclosing(parent, ctx.graph)


def _sibling_precision(ctx: Context, model_dtype: torch.dtype) -> Iterator[Diagnostic]:
    """P304 between neighbours: a unit's outputs feed the next unit in model order."""
    g = ctx.graph
    cache = _precisions(ctx)
    inner = sorted(ctx.inner_units(), key=lambda u: g.pre(u.modules[0]))
    found = []
    for a, b in zip(inner, inner[1:]):
        if _outer(ctx, a) is not _outer(ctx, b) or any(g.is_within(m, n) for m in b.modules for n in a.modules):
            continue  # not neighbours at one level: nesting is checked above
        sent = a["output_dtype"] or _dtype(a, model_dtype, cache)
        computes = _dtype(b, model_dtype, cache)
        if sent != computes and not _precision(b, cache).casts_inputs:
            setting = b.settings["cast_inputs"] if b.settings["cast_inputs"].span else b.settings["param_dtype"]
            found.append(((setting.span or b.span, DTYPE_NAMES[sent], DTYPE_NAMES[computes]), (a.name, b.name)))
    for (span, sent, computes), pairs in by_key(found).items():
        a, b = pairs[0]
        more = f" (and {len(pairs) - 1} more pair{'s' * (len(pairs) > 2)})" if len(pairs) > 1 else ""
        yield err("P304", f"unit `{b}` receives {sent} outputs from `{a}` but computes in {computes}{more}",
                  span, "inputs are not cast", (
                      f"set `precision cast_inputs = true` on `{b}`, or `precision output = {computes}` on `{a}`",))
