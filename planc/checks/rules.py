"""Rule checks: rules whose effect later rules undo (P207), and the root inheriting a
reshard setting from `defaults` (P902)."""

from __future__ import annotations

from typing import Iterator

from planc.checks.context import Context, err
from planc.diagnostics import Diagnostic
from planc.lang import syntax as st
from planc.resolve.selectors import match_modules


def check_root_reshard(ctx: Context) -> Iterator[Diagnostic]:
    """P902 (note): the root inherits `reshard after_forward = true` from `defaults`."""
    root = next((u for u in ctx.res.units if u.is_root), None)
    if root is None:
        return
    setting = root.settings["reshard_after_forward"]
    if setting.rule == "defaults" and setting.value is True:
        yield err("P902", "the root unit reshards after forward: it inherits this from `defaults`",
                  setting.span, "applies to the root too",
                  ("add `root { reshard after_forward = false }` (FSDP2's default for the root): "
                   "backward needs the root's parameters first",), severity="note")


def check_shadowed(ctx: Context) -> Iterator[Diagnostic]:
    """P207 (warning): a rule whose every unit and option is set again later.

    Not for rules already reported (a bad option, a P203 conflict: the warning would only
    echo the error), nor for rules of an included plan: overriding a base plan is what
    `include` is for. The warning points at a later rule that overrides this one.
    """
    res = ctx.res
    for i, s in enumerate(ctx.plan.statements):
        if isinstance(s, (st.UnitStmt, st.CheckpointStmt, st.CompileStmt)) and not res.rule_effects.get(i) \
                and i not in res.conflicted and i not in res.broken and s.span.file == ctx.plan.file:
            matched = _matched_modules(ctx, s)
            if matched:
                later = _overriding_span(ctx, s, i, matched)
                yield err("P207", "this rule has no effect: later rules set everything it sets", s.span,
                          "overridden", ("remove it, or move it after the rules that override it",),
                          related=((later, "overridden here"),) if later else (), severity="warning")


def _matched_modules(ctx: Context, s) -> list[str]:
    sels = ([s.target] if isinstance(s, st.UnitStmt) and isinstance(s.target, st.Selector) else
            list(s.target.selectors) if isinstance(s, st.UnitStmt) else [s.selector])
    return [p for sel in sels for p in match_modules(ctx.graph, sel, optional=True).paths]


def _overriding_span(ctx: Context, s, i: int, modules: list[str]):
    """The span of a later rule that sets what statement `i` set, on its first module."""
    res, m = ctx.res, modules[0]
    if isinstance(s, st.CheckpointStmt):
        setting = res.checkpoint.get(m)
    elif isinstance(s, st.CompileStmt):
        setting = res.compile.get(m)
    else:
        k = res.unit_of_module.get(m)
        if k is None:
            return None
        unit = res.units[k]
        later = [v for v in unit.settings.values() if v.order > i and v.span is not None]
        if unit.span is not None and unit.span != s.span:
            return unit.span
        return min(later, key=lambda v: v.order).span if later else None
    return setting.span if setting is not None and setting.order > i else None
