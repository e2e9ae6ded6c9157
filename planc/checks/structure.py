"""Structure checks: what FSDP2 refuses about which modules and parameters form units.

Containers as units (P204), units their parent never calls (P307), a group acting as root
(P205), tied parameters split across units (P301), one module object shared by two units
(P309), parameters under no unit (P302), and scalar parameters in a unit (P303).
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


def _rule_key(u) -> tuple:
    """Plan order of the rule that made unit `u` (the root and implicit units last)."""
    return (0, u.span.file, u.span.line, u.span.column) if u.span and not u.is_root else (1,)


def _unit_word(u) -> str:
    return "the root" if u is None or u.is_root else f"`{u.name}`"


def check_tied(ctx: Context) -> Iterator[Diagnostic]:
    """P301: one parameter held by modules in two or more different units.

    The fix is the one group that joins every holder: the owners of the weight and the other
    members of any group unit one of them is in now, in place of the rules that make those
    units (adding the group beside them would put a module in two units, P203). The
    diagnostic points at the last rule in the plan that made one of the units.
    """
    g, res = ctx.graph, ctx.res
    for name, owners in g.tied.items():
        if name in res.ignored:
            continue
        units: dict = {}  # unit name -> (unit, owners in it)
        for o in owners:
            u = res.enclosing(o, g)
            units.setdefault(u.name if u else None, (u, []))[1].append(o)
        if len(units) < 2:
            continue
        members = set(owners)
        replaced = []  # units the group takes the place of
        for u, held in units.values():
            if u is None or u.is_root:
                continue
            if u.is_group or u.modules[0] in held:
                members.update(u.modules)
                replaced.append(u)
        group = sorted(members, key=g.pre)
        ordered = sorted((u for u, _ in units.values() if u is not None and not u.is_root), key=_rule_key)
        primary = ordered[-1] if ordered else None
        span = primary.span if primary is not None else None
        shown = [_unit_word(u) for u, _ in units.values()]
        where = ", ".join(shown[:-1]) + " and " + shown[-1]
        related = [(u.span, f"{listed(held)} {'is' if len(held) == 1 else 'are'} in unit `{u.name}`")
                   for u, held in units.values() if u is not None and u.span and u is not primary]
        label = (f"`{owners[0]}` and `{owners[1]}` share one weight" if len(owners) == 2 else
                 f"{listed(owners, len(owners))} share one weight")
        instead = ""
        if replaced:
            rules = list(dict.fromkeys(f"`{u.rule}`" for u in sorted(replaced, key=_rule_key)))
            instead = (f" in place of {listed([r.strip('`') for r in rules], len(rules))}"
                       if all(u.rule == f"unit {u.name}" for u in replaced) else
                       f", and take {listed([u.name for u in replaced], len(replaced))} out of "
                       f"{listed([r.strip('`') for r in rules], len(rules))}")
        both = "both" if len(owners) == 2 else "all of them"
        in_units = [o for u, held in units.values() if u is not None and not u.is_root for o in held]
        one = len(in_units) == 1
        yield err("P301", f"tied parameter `{name}` is split across units {where}", span, label, (
                      f"put {both} in one unit: `unit [{', '.join(group)}]`{instead}",
                      f"or leave {both} to an enclosing unit: drop the rule{'s' * (not one)} that put"
                      f"{'s' * one} {listed(in_units, len(in_units))} in {'a unit' if one else 'units'}"),
                  related)


def check_shared_modules(ctx: Context) -> Iterator[Diagnostic]:
    """P309: one module object registered at several paths (ALBERT-style sharing), held by
    different units there. FSDP2 would shard its parameters twice and fail in torch
    (`Cannot concatenate overlapping meshes`). Fine when the module is a unit itself: FSDP2
    shards it once and each unit around one of its paths leaves it out."""
    g, res = ctx.graph, ctx.res
    for path, aliases in g.shared_modules.items():
        if path in res.unit_of_module:
            continue
        first = res.enclosing(path, g)
        others = [(a, res.enclosing(a.rpartition(".")[0], g)) for a in aliases]
        apart = [(a, u) for a, u in others if (u.name if u else None) != (first.name if first else None)]
        if not apart:
            continue
        alias, second = apart[0]
        involved = sorted((u for u in [first, *(u for _, u in apart)] if u is not None and not u.is_root),
                          key=_rule_key)
        primary = involved[-1] if involved else None
        related = [(u.span, f"holds it at `{path}`" if u is first else "holds it at "
                    + listed([a for a, v in apart if v is u], len(aliases)))
                   for u in {u.name: u for u in involved}.values()
                   if u.span and u is not primary and u.span != primary.span]
        more = f" (and {len(apart) - 1} more path{'s' * (len(apart) > 2)})" if len(apart) > 1 else ""
        holders = [first, *(u for _, u in apart)]
        outer = list(dict.fromkeys(u.name for u in holders if u is not None and not u.is_root))
        group = f"`unit [{', '.join(outer)}]`" if len(outer) > 1 else None
        help_ = [f"make the shared module a unit of its own: `unit {path}` (FSDP2 shards it once; "
                 "the units around it leave it out)"]
        if group:
            help_.append(f"or put the units that hold it in one group: {group}")
        yield err("P309", f"module `{path}` is also registered at `{alias}`{more}: units "
                  f"{_unit_word(first)} and {_unit_word(second)} would both shard it",
                  primary.span if primary else None, "one module object in two units", help_, related)


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
