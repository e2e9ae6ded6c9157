"""Resolve a parsed plan against a model graph: units, settings with provenance, parameters.

Precedence, the one rule users need to know: `defaults` apply first (in file order), then
every other statement in file order, later ones overriding earlier ones option by option.
An included plan's statements stand where its `include` line stands. Each resolved setting
records the statement that set it.

Structural problems found while resolving (selectors that match nothing, a module claimed
by two units, unknown option names) are reported here; checks over the finished result live
in `planc/checks/`.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

from planc.diagnostics import Diagnostic, suggestion
from planc.lang import printer
from planc.lang import syntax as st
from planc.model.graph import ModelGraph
from planc.resolve.context import context_style, is_context
from planc.resolve.experts import expert_style, is_expert
from planc.resolve.ir import DEFAULT_SETTINGS, Resolution, Setting, Unit
from planc.resolve.mesh import Role, resolve_mesh
from planc.resolve.options import CHECKPOINT_MODES, MODULE_SETTINGS, Assignment, parse_option, replaced, set_twice
from planc.resolve.pipeline import resolve_pipeline
from planc.resolve.selectors import check_regexes, match_modules, match_params
from planc.resolve.step import resolve_step
from planc.resolve.tensor import TensorStyle, tensor_style

DEFAULTS_ORDER = -(10**9)  # defaults sort below every rule, whatever their position


@dataclass
class _Rule:
    """One statement's option assignments, ready to apply to the units it matches."""

    index: int
    text: str
    assignments: list[Assignment] = field(default_factory=list)


rule_text = printer.rule_name  # how a statement is named in explanations: `unit layers.*`


def _block(block: st.Block | None, context, diags: list[Diagnostic]) -> list[Assignment]:
    out: list[Assignment] = []
    for opt in block.options if block else ():
        assignments, errs = parse_option(opt, context)
        out.extend(assignments)
        diags.extend(errs)
    diags.extend(set_twice(out))
    return out


class Resolver:
    """One resolution of one plan against one model graph (use `resolve`)."""

    def __init__(self, plan: st.Plan, graph: ModelGraph | None):
        self.plan = plan
        self.graph = graph
        self.diags: list[Diagnostic] = []
        self.out = Resolution()
        self._mesh_ok = True  # the last `mesh` line resolved without errors (set by `run`)

    # ----------------------------------------------------------------- driver
    def run(self) -> tuple[Resolution, list[Diagnostic]]:
        stmts = self.plan.statements
        meshes = [s for s in stmts if isinstance(s, st.MeshStmt)]
        errors = sum(d.is_error for d in self.diags)
        self.out.mesh = resolve_mesh(meshes[-1] if meshes else None, self.diags)
        # a mesh with errors resolves to the default 1-D mesh: its missing tensor axis is not
        # news, so `parallel` lines then report no P109 (one error, not one per line)
        self._mesh_ok = sum(d.is_error for d in self.diags) == errors
        for stale in meshes[:-1]:  # only the last mesh counts; an earlier one is dead text
            found: list[Diagnostic] = []
            resolve_mesh(stale, found)
            self.diags.extend(d for d in found if d.is_error)
            self.diags += replaced(stale, meshes[-1], "mesh", self.plan.file)
        models = [s for s in stmts if isinstance(s, st.ModelStmt)]
        for stale in models[:-1]:
            self.diags += replaced(stale, models[-1], "model", self.plan.file)
        self.out.step = resolve_step(stmts, self.plan.file, self.diags)
        if self._mesh_ok:  # a broken mesh has no pipeline axis to speak of
            self.out.pipeline = resolve_pipeline(stmts, self.plan.file, self.out.mesh, self.graph, self.diags)
        roots = [s for s in stmts if isinstance(s, st.RootStmt)]
        self.out.root_disabled = bool(roots) and roots[-1].disabled

        defaults: list[Assignment] = []
        rules: dict[int, _Rule] = {}
        per_defaults: list[tuple[st.DefaultsStmt, list[Assignment]]] = []
        for i, s in enumerate(stmts):
            if isinstance(s, st.DefaultsStmt):
                errors = sum(d.is_error for d in self.diags)
                assigned = _block(s.block, "defaults", self.diags)
                defaults.extend(assigned)
                if sum(d.is_error for d in self.diags) == errors:
                    per_defaults.append((s, assigned))
            elif isinstance(s, (st.UnitStmt, st.RootStmt)):
                ctx = "root" if isinstance(s, st.RootStmt) else "unit"
                errors = sum(d.is_error for d in self.diags)
                rules[i] = _Rule(i, rule_text(s), _block(s.block, ctx, self.diags))
                if sum(d.is_error for d in self.diags) > errors:
                    self.out.broken.add(i)
        self._dead_defaults(per_defaults)
        styles = self._styles(stmts)
        if self.graph is None:
            self._check_without_model()
            return self.out, self.diags

        keys, creators = self._unit_keys(stmts)
        self._build_units(stmts, keys, creators, defaults, rules)
        self._parameters(stmts)
        self._module_transforms(stmts)
        self._tensor_parallel(stmts, styles)
        self._whole_module_style(stmts, is_context, self.out.context)
        self._whole_module_style(stmts, is_expert, self.out.experts)
        self._prefetch()
        return self.out, self.diags

    # ----------------------------------------------------------------- tensor parallelism
    def _styles(self, stmts) -> dict[int, TensorStyle]:
        """Each `parallel` statement's style (statement index -> style); a bad one is diagnosed and dropped."""
        styles: dict[int, TensorStyle] = {}
        for i, s in enumerate(stmts):
            if isinstance(s, st.ParallelStmt) and is_context(s):
                if not context_style(s, self.out.mesh, self._mesh_ok, self.diags):
                    self.out.broken.add(i)
            elif isinstance(s, st.ParallelStmt) and is_expert(s):
                if not expert_style(s, self.out.mesh, self._mesh_ok, self.diags):
                    self.out.broken.add(i)
            elif isinstance(s, st.ParallelStmt):
                style = tensor_style(s, self.diags)
                if style is None:
                    self.out.broken.add(i)
                    continue
                styles[i] = style
                if self.out.mesh.axis(Role.TENSOR) is None and self._mesh_ok:
                    self.diags.append(Diagnostic(
                        code="P109", severity="error", message="a tensor-parallel style, but the mesh has no tensor axis",
                        span=s.span, label=f"`{s.style.value}` needs a tensor axis",
                        help=("add the innermost axis to the mesh: `mesh (shard = *, tensor = 8)`",)))
        return styles

    def _tensor_parallel(self, stmts, styles: dict[int, TensorStyle]) -> None:
        """module -> style: a later `parallel` statement replaces an earlier one on the same module."""
        for i, style in styles.items():
            s = stmts[i]
            m = match_modules(self.graph, s.selector, optional=s.optional)
            self.diags.extend(m.diagnostics)
            text = rule_text(s)  # once per statement, not per matched module
            for path in m.paths:
                self.out.parallel[path] = Setting(style, s.span, text, i)
            if m.paths:
                self.out.rule_effects[i] = self.out.rule_effects.get(i, 0) + len(m.paths)

    def _whole_module_style(self, stmts, is_style, table: dict[str, Setting]) -> None:
        """module -> a style without options (`context`: `planc/resolve/context.py`; `expert`:
        `planc/resolve/experts.py`), for the well-formed statements."""
        for i, s in enumerate(stmts):
            if not isinstance(s, st.ParallelStmt) or not is_style(s) or i in self.out.broken:
                continue
            m = match_modules(self.graph, s.selector, optional=s.optional)
            self.diags.extend(m.diagnostics)
            text = rule_text(s)
            for path in m.paths:
                table[path] = Setting(s.style.value, s.span, text, i)
            if m.paths:
                self.out.rule_effects[i] = self.out.rule_effects.get(i, 0) + len(m.paths)

    def _dead_defaults(self, blocks: list[tuple[st.DefaultsStmt, list[Assignment]]]) -> None:
        """P207 for a `defaults` block whose every setting a later `defaults` sets again."""
        for k, (stmt, assigned) in enumerate(blocks):
            later = {a.key: a for _, more in blocks[k + 1:] for a in more}
            if assigned and stmt.span.file == self.plan.file and all(a.key in later for a in assigned):
                self.diags.append(Diagnostic(
                    code="P207", severity="warning", span=stmt.span,
                    message="this rule has no effect: later rules set everything it sets", label="overridden",
                    related=((later[assigned[0].key].span, "overridden here"),),
                    help=("remove it, or move it after the rules that override it",)))

    def _check_without_model(self) -> None:
        for s in self.plan.statements:
            for sel in _selectors_of(s):
                self.diags.extend(check_regexes(sel))
            if isinstance(s, st.PlaceStmt):
                _placement_dim(s, self.diags)
            if isinstance(s, st.CheckpointStmt):
                _checkpoint_mode(s, self.diags)

    # ----------------------------------------------------------------- units
    def _match_target(self, target, optional: bool) -> list[tuple[str, ...]]:
        g = self.graph
        if isinstance(target, st.Group):
            members: list[str] = []
            for sel in target.selectors:
                m = match_modules(g, sel, optional=optional)
                self.diags.extend(m.diagnostics)
                members.extend(p for p in m.paths if p not in members)
            return [tuple(sorted(members, key=g.pre))] if members else []
        m = match_modules(g, target, optional=optional)
        self.diags.extend(m.diagnostics)
        return [(p,) for p in m.paths]

    def _unit_keys(self, stmts) -> tuple[dict[tuple[str, ...], list[int]], dict]:
        """Unit keys (module tuples) -> indices of the rules matching them, in order."""
        keys: dict[tuple[str, ...], list[int]] = {}
        owner: dict[str, tuple[tuple[str, ...], int]] = {}
        reported: set[tuple[int, int]] = set()
        for i, s in enumerate(stmts):
            if not isinstance(s, st.UnitStmt):
                continue
            for key in self._match_target(s.target, s.optional):
                clash = next((owner[m] for m in key if m in owner and owner[m][0] != key), None)
                if clash is not None:
                    other_key, j = clash
                    self.out.conflicted.add(i)
                    if (j, i) not in reported:
                        reported.add((j, i))
                        module = next(m for m in key if m in owner and owner[m][0] != key)
                        self.diags.append(_conflict(module, key, other_key, s, stmts[j]))
                    continue
                for m in key:
                    owner[m] = (key, i)
                keys.setdefault(key, []).append(i)
        creators = {key: idx[-1] for key, idx in keys.items()}
        return keys, creators

    def _build_units(self, stmts, keys, creators, defaults, rules) -> None:
        effects: dict[int, int] = defaultdict(int)

        def settle(is_root: bool, rule_idx: list[int]) -> dict[str, Setting]:
            settings = dict(DEFAULT_SETTINGS)
            for a in defaults:
                if is_root and a.key in MODULE_SETTINGS:
                    continue
                settings[a.key] = Setting(a.value, a.span, "defaults", DEFAULTS_ORDER)
            for i in rule_idx:
                for a in rules[i].assignments:
                    settings[a.key] = Setting(a.value, a.span, rules[i].text, i)
            for s in settings.values():
                if s.order >= 0:
                    effects[s.order] += 1
            return settings

        units: list[Unit] = []
        for key, idx in keys.items():
            creator = stmts[creators[key]]
            effects[creators[key]] += 1
            units.append(Unit(modules=key, settings=settle(False, idx), span=creator.span,
                              rule=rule_text(creator)))
        units = self._bottom_up(units)
        if not self.out.root_disabled:
            root_rules = [i for i, s in enumerate(stmts) if isinstance(s, st.RootStmt)]
            span = stmts[root_rules[-1]].span if root_rules else None
            units.append(Unit(modules=("",), settings=settle(True, root_rules), is_root=True,
                              span=span, rule="root" if root_rules else "root (implicit)"))
            for i in root_rules:
                effects[i] += 1
        self.out.units = units
        self.out.rule_effects = effects
        self.out.unit_of_module = {m: k for k, u in enumerate(units) for m in u.modules}

    def _bottom_up(self, units: list[Unit]) -> list[Unit]:
        """Units in an order FSDP2 accepts: every unit before any unit holding an ancestor of
        one of its modules (post-order for single modules; a group can hold a module nested in
        another unit, e.g. `[layers.0.norm, norm]`, and must then come first).

        Kahn's algorithm with post-order as the tie-break, so plans without such groups keep
        plain post-order. A cycle (two groups each nested in the other) is P306.
        """
        g = self.graph
        key = [max(g.post(m) for m in u.modules) for u in units]
        if all(len(u.modules) == 1 for u in units):
            return [u for _, u in sorted(zip(key, units), key=lambda p: p[0])]
        owner = {m: k for k, u in enumerate(units) for m in u.modules}
        after: list[set[int]] = [set() for _ in units]   # k -> units that must follow k
        needs = [0] * len(units)
        for k, u in enumerate(units):
            for m in u.modules:
                for a in g.ancestors(m):
                    j = owner.get(a)
                    if j is not None and j != k and j not in after[k]:
                        after[k].add(j)
                        needs[j] += 1
        ready = [(key[k], k) for k in range(len(units)) if needs[k] == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            _, k = heapq.heappop(ready)
            order.append(k)
            for j in after[k]:
                needs[j] -= 1
                if needs[j] == 0:
                    heapq.heappush(ready, (key[j], j))
        if len(order) < len(units):
            stuck = sorted((k for k in range(len(units)) if needs[k]), key=key.__getitem__)
            a, b = units[stuck[0]], units[stuck[1]] if len(stuck) > 1 else units[stuck[0]]
            self.diags.append(Diagnostic(
                code="P306", severity="error", span=b.span,
                message=f"units `{a.name}` and `{b.name}` each hold a module inside the other",
                label="no bottom-up order exists", related=((a.span, "the other unit"),) if a.span else (),
                help=("FSDP2 shards children before parents; split a group so that no two groups "
                      "nest in each other",)))
            order += stuck
        return [units[k] for k in order]

    # ----------------------------------------------------------------- parameters
    def _parameters(self, stmts) -> None:
        g = self.graph
        placed: list[tuple[st.PlaceStmt, list[str]]] = []
        for s in stmts:
            if isinstance(s, st.IgnoreStmt):
                m = match_params(g, s.selector, optional=s.optional)
                self.diags.extend(m.diagnostics)
                for name in m.paths:
                    self.out.ignored[name] = s.span
            elif isinstance(s, st.PlaceStmt):
                dim = _placement_dim(s, self.diags)
                m = match_params(g, s.selector, optional=s.optional)
                self.diags.extend(m.diagnostics)
                if dim is not None:
                    for name in m.paths:
                        self.out.placements[name] = (dim, s.span)
                    placed.append((s, m.paths))
        for s, names in placed:  # P207: every parameter it placed is placed again later
            final = [self.out.placements[n][1] for n in names]
            if names and s.span not in final and s.span.file == self.plan.file:
                self.diags.append(Diagnostic(
                    code="P207", severity="warning", span=s.span,
                    message="this rule has no effect: later rules set everything it sets", label="overridden",
                    related=((final[0], "overridden here"),),
                    help=("remove it, or move it after the rules that override it",)))
        owned: set[str] = set(self.out.ignored)
        for k, unit in enumerate(self.out.units):
            mine: set[str] = set()
            for m in unit.modules:
                mine |= g.subtree_params(m)
            mine -= owned
            owned |= mine
            self.out.units[k] = Unit(modules=unit.modules, settings=unit.settings, is_root=unit.is_root,
                                     span=unit.span, rule=unit.rule,
                                     params=tuple(sorted(mine, key=_param_order(g))))

    # ----------------------------------------------------------------- checkpoint and compile
    def _module_transforms(self, stmts) -> None:
        g = self.graph
        table = {"checkpoint": self.out.checkpoint, "compile": self.out.compile}
        # `checkpoint every = N` (torchtitan's `selective_ac_option = "N"`): of the units one rule
        # checkpoints, in model order, only every Nth (the Nth, 2Nth, ...) is checkpointed
        counted: dict[int, int] = {}
        for unit in sorted((u for u in self.out.units if not u.is_root), key=lambda u: g.pre(u.modules[0])):
            for key, target in table.items():
                setting = unit.settings[key]
                every = unit.settings["checkpoint_every"].value if key == "checkpoint" else None
                if every and setting.value is not None:
                    counted[setting.order] = n = counted.get(setting.order, 0) + 1
                    if n % every:
                        continue
                if setting.value is not None or setting.order >= 0:
                    for m in unit.modules:
                        target[m] = setting
        for i, s in enumerate(stmts):
            if isinstance(s, st.CheckpointStmt):
                mode = _checkpoint_mode(s, self.diags)
                value, target = mode, self.out.checkpoint
            elif isinstance(s, st.CompileStmt):
                value, target = {}, self.out.compile
            else:
                continue
            m = match_modules(g, s.selector, optional=s.optional)
            self.diags.extend(m.diagnostics)
            for path in m.paths:
                if path not in target or target[path].order < i:
                    target[path] = Setting(value, s.span, rule_text(s), i)
        for target in table.values():
            for path in [p for p, s in target.items() if s.value is None]:
                del target[path]
            for s in target.values():
                if s.order >= 0:
                    self.out.rule_effects[s.order] = self.out.rule_effects.get(s.order, 0) + 1

    # ----------------------------------------------------------------- prefetch
    def _prefetch(self) -> None:
        g = self.graph
        units = self.out.units
        inner = sorted((u for u in units if not u.is_root), key=lambda u: g.pre(u.modules[0]))
        forward = ([u for u in units if u.is_root]) + inner
        by_module = {m: u for u in units for m in u.modules}
        for direction, order in (("forward", forward), ("backward", forward[::-1])):
            table = self.out.prefetch_forward if direction == "forward" else self.out.prefetch_backward
            for k, unit in enumerate(order):
                setting = unit.settings[f"prefetch_{direction}"]
                value = setting.value
                if value is None:
                    continue
                if isinstance(value, int):
                    targets = [u.name for u in order[k + 1:k + 1 + value] if not u.is_root]
                    if not targets:
                        # Depth 0, or the end of the chain. FSDP2 reads an empty list as "use
                        # the implicit prefetch", so there is nothing to set.
                        continue
                else:
                    targets = []
                    for sel in value:
                        m = match_modules(g, sel)
                        self.diags.extend(m.diagnostics)
                        for path in m.paths:
                            if path in by_module:
                                if by_module[path].name not in targets:
                                    targets.append(by_module[path].name)
                                if by_module[path].is_group:
                                    self.diags.append(_group_prefetch_note(path, by_module[path], sel))
                            else:
                                self.diags.append(Diagnostic(
                                    code="P305", severity="error", span=sel.span,
                                    message=f"prefetch target `{path}` is not a unit",
                                    label=f"`{path}` is not sharded on its own",
                                    help=(f"add `unit {path}`, or prefetch the unit that holds it",)))
                table[unit.name] = tuple(targets)


def _group_prefetch_note(path: str, group: Unit, sel: st.Selector) -> Diagnostic:
    """P903: a prefetch target that is one module of a group unit prefetches the group."""
    return Diagnostic(code="P903", severity="note", span=sel.span,
                      message=f"prefetch target `{path}` is one module of group unit `{group.name}`: "
                              "the whole group is prefetched",
                      label=f"prefetches `{group.name}`",
                      help=("FSDP2 all-gathers a unit as a whole; to prefetch less, split the group into units",))


def _selectors_of(stmt) -> list[st.Selector]:
    if isinstance(stmt, (st.UnitStmt, st.ExpectUnit)):
        return list(stmt.target.selectors) if isinstance(stmt.target, st.Group) else [stmt.target]
    if isinstance(stmt, (st.CheckpointStmt, st.CompileStmt, st.IgnoreStmt, st.PlaceStmt, st.ParallelStmt)):
        return [stmt.selector]
    return []


def _param_order(g: ModelGraph):
    return g.param_order.__getitem__


def _placement_dim(stmt: st.PlaceStmt, diags: list[Diagnostic]) -> int | None:
    call = stmt.placement
    if call.name != "Shard":
        diags.append(Diagnostic(code="P102", severity="error", message=f"unknown placement `{call.name}`",
                                span=call.span, label="not a placement",
                                help=suggestion(call.name, ["Shard"]) or ("FSDP2 places parameters with `Shard(dim)`",)))
        return None
    if len(call.args) != 1 or not isinstance(call.args[0], st.Number) or not float(call.args[0].value).is_integer() \
            or call.args[0].value < 0:
        diags.append(Diagnostic(code="P103", severity="error", message="`Shard` takes one dimension, a non-negative integer",
                                span=call.span, label="not a dimension",
                                help=("write `Shard(0)` (the default) or `Shard(1)` to shard the second dimension",)))
        return None
    return int(call.args[0].value)


def _checkpoint_mode(stmt: st.CheckpointStmt, diags: list[Diagnostic]) -> str:
    if stmt.mode is None:
        return "full"
    if stmt.mode.value in CHECKPOINT_MODES:
        return stmt.mode.value
    diags.append(Diagnostic(code="P102", severity="error", message=f"unknown checkpoint mode `{stmt.mode.value}`",
                            span=stmt.mode.span, label="not a mode",
                            help=suggestion(stmt.mode.value, CHECKPOINT_MODES) or
                            ("the modes are `full` and `selective`",)))
    return "full"


def _conflict(module: str, key, other_key, stmt, other_stmt) -> Diagnostic:
    def show(k):
        return k[0] if len(k) == 1 else "[" + ", ".join(k) + "]"
    return Diagnostic(
        code="P203", severity="error", span=stmt.span,
        message=f"module `{module}` is put in unit `{show(key)}` here but is already in unit `{show(other_key)}`",
        label="second unit for the same module",
        related=((other_stmt.span, "first unit made here"),),
        help=("a module belongs to exactly one unit: drop it from one rule (e.g. with `except`), "
              "or make both rules describe the same unit",))


def resolve(plan: st.Plan, graph: ModelGraph | None) -> tuple[Resolution, list[Diagnostic]]:
    """Resolve `plan` against `graph` (None: only the checks that need no model)."""
    return Resolver(plan, graph).run()
