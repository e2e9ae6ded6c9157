"""Structure checks: what FSDP2 refuses about which modules and parameters form units.

Containers as units (P204), units their parent never calls (P307), a group acting as root
(P205), tied parameters split across units (P301), parameters under no unit (P302), and
scalar parameters in a unit (P303).
"""

from __future__ import annotations

from typing import Iterator

from planc.checks.context import Context, by_key, err, listed
from planc.diagnostics import Diagnostic
from planc.lang import syntax as st


def check_containers(ctx: Context) -> Iterator[Diagnostic]:
    """P204: ModuleList/ModuleDict have no forward; FSDP2 refuses them."""
    for u in ctx.inner_units():
        for m in u.modules:
            if not ctx.graph.has_forward(m):
                yield err("P204", f"unit `{m}` is a `{ctx.graph.cls(m)}`, which has no `forward`", u.span,
                          "FSDP2 cannot shard a container",
                          (f"make each child a unit: `unit {m}.*`",))


def check_never_called(ctx: Context) -> Iterator[Diagnostic]:
    """P307: a unit inside a module that reads its children's weights without calling them."""
    from planc.resolve.selectors import FORCE_LEAF_MODULES
    g = ctx.graph
    by_rule: dict = {}
    for u in ctx.inner_units():
        for m in u.modules:
            parent = next((a for a in g.ancestors(m) if g.qualname(a) in FORCE_LEAF_MODULES), None)
            if parent is not None:
                by_rule.setdefault(u.span, []).append((m, parent))
    for span, hits in by_rule.items():
        m, parent = hits[0]
        more = f" (and {len(hits) - 1} more)" if len(hits) > 1 else ""
        yield err("P307", f"unit `{m}`{more} is never called: its parent `{parent}` (`{g.cls(parent)}`) "
                  "reads its weights directly", span, "FSDP2 would never gather this unit",
                  (f"make the parent the unit instead: `unit {parent}`",))


def check_group_root(ctx: Context) -> Iterator[Diagnostic]:
    """P205: with `root none`, an outermost group unit would act as an FSDP root."""
    if not ctx.res.root_disabled:
        return
    for u in ctx.inner_units():
        if u.is_group and not any(ctx.res.enclosing(a, ctx.graph) for m in u.modules
                                  for a in ctx.graph.ancestors(m)):
            yield err("P205", f"group unit `{u.name}` would be an FSDP root", u.span,
                      "a list of modules cannot be the root",
                      ("keep the root a unit (remove `root none`), or split the group",))


def check_tied(ctx: Context) -> Iterator[Diagnostic]:
    """P301: one parameter held by modules in two different units."""
    g, res = ctx.graph, ctx.res
    for name, owners in g.tied.items():
        if name in res.ignored:
            continue
        units = {}
        for o in owners:
            u = res.enclosing(o, g)
            units.setdefault(u.name if u else None, (o, u))
        if len(units) < 2:
            continue
        (m1, u1), (m2, u2) = list(units.values())[:2]
        span = (u2.span if u2 and u2.span else u1.span if u1 else None)
        related = [(u.span, f"`{m}` is in unit `{u.name}`") for m, u in ((m1, u1), (m2, u2)) if u and u.span]
        yield err("P301", f"tied parameter `{name}` is split across units `{u1.name if u1 else 'none'}` "
                  f"and `{u2.name if u2 else 'none'}`", span,
                  f"`{m1}` and `{m2}` share one weight", (
                      f"put both in one unit: `unit [{m1}, {m2}]`",
                      f"or leave both to an enclosing unit (drop the rule that makes `{m1}` or `{m2}` a unit)"),
                  related[:1] if span is not None else related)


def check_unowned(ctx: Context) -> Iterator[Diagnostic]:
    """P302: with `root none`, parameters no unit manages stay replicated and unsynchronised."""
    if not ctx.res.root_disabled:
        return
    owned = set(ctx.res.ignored).union(*(u.params for u in ctx.res.units))
    left = [n for n in ctx.graph.params if n not in owned]
    if left:
        stmt = next(s for s in ctx.plan.statements if isinstance(s, st.RootStmt) and s.disabled)
        shown = ", ".join(f"`{n}`" for n in left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        yield err("P302", f"{len(left)} parameter(s) belong to no unit: {shown}", stmt.span,
                  "the root is not a unit", (
                      "remove `root none` so the root unit manages them",
                      "or `ignore` them if something else synchronises their gradients"))


def check_scalar(ctx: Context) -> Iterator[Diagnostic]:
    """P303: FSDP2 cannot shard 0-dim parameters."""
    found = [(u.span, (name, u.name)) for u in ctx.res.units for name in u.params
             if not ctx.graph.params[name].shape]
    for span, items in by_key(found).items():
        names = [n for n, _ in items]
        units = list(dict.fromkeys(u for _, u in items))
        locals_ = {n.rpartition(".")[2] for n in names}
        fix = f"ignore **.{next(iter(locals_))}" if len(names) > 1 and len(locals_) == 1 else f"ignore {names[0]}"
        yield err("P303", f"scalar parameter{'s' * (len(names) > 1)} {listed(names)} in "
                  f"unit{'s' * (len(units) > 1)} {listed(units)}", span,
                  "FSDP2 raises ValueError on 0-dim parameters", (f"add `{fix}`",))
