"""Match selectors against the model graph: module paths, parameter names, guards, sizes.

A path selector walks the module tree segment by segment (`*` one level, `**` any depth,
`name[a:b]` a slice of a container's children, `{a,b}` alternatives, globs within a name).
When nothing matches, the walk knows how far it got, so the diagnostic can point at the
segment that failed and suggest the children that exist there.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import time
import weakref
from dataclasses import dataclass, field

import regex

from planc.diagnostics import Diagnostic, Span, suggestion
from planc.lang import syntax as st
from planc.limits import REGEX_BUDGET_S
from planc.model.graph import ModelGraph

SIZE_FIELDS = ("size",)


@dataclass
class Match:
    """The result of matching one selector: paths in model order, plus diagnostics."""

    paths: list[str] = field(default_factory=list)
    diagnostics: list[Diagnostic] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(d.is_error for d in self.diagnostics)


def _name_matches(pattern: str, name: str) -> bool:
    return name == pattern or ("*" in pattern and fnmatch.fnmatchcase(name, pattern))


def _slice_children(children: list[str], seg: st.Segment) -> list[str]:
    if seg.is_slice:
        return children[seg.start:seg.stop]
    if seg.index is not None and -len(children) <= seg.index < len(children):
        return [children[seg.index]]
    return []


class _Walk:
    """The tree walk for one path: frontier per segment, for matching and for suggestions."""

    def __init__(self, graph: ModelGraph, segments: tuple[st.Segment, ...], params: bool):
        self.graph = graph
        self.segments = segments
        self.params = params
        self.reached: list[set[str]] = []  # nodes reached before segment i

    def _step(self, node: str, seg: st.Segment) -> list[str]:
        g = self.graph
        names, children = g.child_names(node), g.children(node)
        if seg.alternatives:
            if not any("*" in a for a in seg.alternatives):  # plain names: a set lookup per child
                wanted = set(seg.alternatives)
                return [p for n, p in zip(names, children) if n in wanted]
            return [p for n, p in zip(names, children) if any(_name_matches(a, n) for a in seg.alternatives)]
        if seg.pattern == "*":
            hits = list(children)
        elif "*" not in seg.pattern:  # a plain name: at most one child has it
            hits = [children[names.index(seg.pattern)]] if seg.pattern in names else []
        else:
            hits = [p for n, p in zip(names, children) if _name_matches(seg.pattern, n)]
        if seg.index is not None or seg.is_slice:
            return [c for h in hits for c in _slice_children(g.children(h), seg)]
        return hits

    def modules(self) -> set[str]:
        """Module paths matched by all segments (`**` may match zero segments)."""
        frontier = {""}
        for i, seg in enumerate(self.segments):
            self.reached.append(set(frontier))
            if seg.is_deep:
                # zero or more levels: everything at or below the frontier, then go on
                below: set[str] = set()
                for node in sorted(frontier, key=self.graph.pre):  # ancestors first
                    if node not in below:  # a subtree already added holds this one's
                        below.update(self.graph.subtree(node))
                last = i == len(self.segments) - 1
                frontier = (below - {""}) if last else below
                continue
            frontier = {c for node in frontier for c in self._step(node, seg)}
            if not frontier:
                return set()
        return frontier - {""}

    def parameters(self) -> set[str]:
        """Parameter names (as registered, aliases included) matched by the path."""
        *mods, last = self.segments
        self.segments = tuple(mods)
        nodes = self.modules_including_root()
        self.segments = (*mods, last)
        self.reached.append(set(nodes))
        out: set[str] = set()
        g = self.graph
        for node in nodes:
            if last.is_deep:
                for m in g.subtree(node):
                    out.update(_full(m, local) for local, _ in g.own_params(m))
                continue
            for local, _ in g.own_params(node):
                names = last.alternatives or (last.pattern,)
                if any(n == "*" or _name_matches(n, local) for n in names):
                    out.add(_full(node, local))
        return out

    def modules_including_root(self) -> set[str]:
        if not self.segments:
            return {""}
        frontier = {""}
        for seg in self.segments:
            self.reached.append(set(frontier))
            if seg.is_deep:
                deep: set[str] = set()
                for node in sorted(frontier, key=self.graph.pre):
                    if node not in deep:
                        deep.update(self.graph.subtree(node))
                frontier = deep
            else:
                frontier = {c for node in frontier for c in self._step(node, seg)}
        return frontier


def _full(module: str, local: str) -> str:
    return f"{module}.{local}" if module else local


def _no_match(graph: ModelGraph, sel: st.Selector, walk: _Walk, what: str) -> Diagnostic:
    """P201: say which segment failed and what exists at that point."""
    path = sel.base
    failing = len(walk.reached) - 1
    seg = path.segments[failing] if 0 <= failing < len(path.segments) else path.segments[-1]
    parents = sorted(walk.reached[failing]) if 0 <= failing < len(walk.reached) else []
    names: set[str] = set()
    for p in parents:
        names.update(graph.child_names(p))
        if what == "parameter":
            names.update(local for local, _ in graph.own_params(p))
    help_: list[str] = []
    word = seg.pattern or (seg.alternatives[0] if seg.alternatives else "")
    modules_there = [f"{p}.{word}" if p else word for p in parents if word in graph.child_names(p)]
    first_failed = len(walk.reached) < 2 or not walk.reached[1]  # nothing at the root has that name
    prefixed = _with_prefix(graph, sel, what) if first_failed else None
    if what == "parameter" and failing == len(path.segments) - 1 and modules_there:
        # `place blocks.0.norm ...`: a module where a parameter was meant
        module = modules_there[0]
        own = [f"{module}.{local}" for local, _ in graph.own_params(module)]
        if own:
            help_.append(f"`{module}` is a module; name its parameter{'s' * (len(own) > 1)}: "
                         + ", ".join(f"`{n}`" for n in own[:4]) + (", ..." if len(own) > 4 else "")
                         + (f" (or `{module}.*` for all of them)" if len(own) > 1 else ""))
        else:
            help_.append(f"`{module}` is a module with no parameters of its own; `{module}.**` names "
                         "every parameter below it")
    elif prefixed:
        help_.append(f"did you mean `{prefixed}`?")
    elif failing == 0 and len(path.segments) == 1 and word == "root" and what == "module":
        help_.append("the root module is always a unit; set its options with a `root { ... }` statement, "
                     "e.g. `root { reshard after_forward = false }`")
    elif (seg.index is not None or seg.is_slice) and word in names:
        sizes = {len(graph.children(f"{p}.{word}" if p else word)) for p in parents
                 if (f"{p}.{word}" if p else word) in graph}
        help_.append(f"`{word}` has {', '.join(map(str, sorted(sizes)))} children; "
                     f"indices run from 0 (or -N from the end)")
    else:
        help_.extend(suggestion(word, names))
        if not help_ and names:
            shown = sorted(names)[:8]
            where = f"`{parents[0]}`" if parents and parents[0] else "the model"
            help_.append(f"{'names' if what == 'parameter' else 'children'} under {where}: "
                         + ", ".join(f"`{n}`" for n in shown)
                         + (", ..." if len(names) > 8 else ""))
    help_.append("run `planc tree --model ...` to see module paths")
    return Diagnostic(code="P201", severity="error", message=f"selector `{sel}` matches no {what}",
                      span=seg.span, label=f"no {what} here", help=tuple(help_))


def _with_prefix(graph: ModelGraph, sel: st.Selector, what: str) -> str | None:
    """`model.embed_tokens` for `embed_tokens`: the selector, under the one module prefix
    that makes it match (Hugging Face models nest their layers under `model.`, `transformer.`),
    if exactly one of at most 32 candidate prefixes does."""
    first = sel.base.segments[0]
    if first.is_deep:
        return None
    words = first.alternatives or (first.pattern,)
    prefixes = sorted({m.rpartition(".")[0] for m in graph.modules
                       if "." in m and any(_name_matches(w, m.rpartition(".")[2]) or w == "*" for w in words)},
                      key=graph.pre)
    hits = []
    for prefix in prefixes[:32]:
        walk = _Walk(graph, (*(st.Segment(span=first.span, pattern=p) for p in prefix.split(".")),
                             *sel.base.segments), params=what == "parameter")
        if walk.parameters() if what == "parameter" else walk.modules():
            hits.append(prefix)
    return f"{hits[0]}.{sel.base}" if len(hits) == 1 else None


def _regex(pattern: str, span: Span) -> tuple[regex.Pattern | None, Diagnostic | None]:
    """The compiled pattern, or P105. Python's `re` judges the syntax (the language promises
    Python regexes); the `regex` package, a superset of `re`'s syntax, matches, because its
    matches take a timeout (`_regex_hits`)."""
    try:
        re.compile(pattern)
        return regex.compile(pattern), None
    except (re.error, regex.error) as err:
        msg = getattr(err, "msg", None) or str(err)
        return None, Diagnostic(code="P105", severity="error", message=f"invalid regular expression: {msg}",
                                span=span, label="does not compile", help=("regexes use Python's `re` syntax",))


# graph -> (kind, pattern) -> the names a regex fully matches, or None when it ran out of
# time; a selector is matched again by later checks (P207, expect) and pays only once
_hits: "weakref.WeakKeyDictionary[ModelGraph, dict]" = weakref.WeakKeyDictionary()


# What can see past a line's ends, or changes what `^`/`$` mean: with any of these in a
# pattern, matching the names joined by newlines could differ from matching each name
_NOT_LINEWISE = regex.compile(r"\\[AZzG]|\(\?[aiLmsux\-]|\(\?<?[=!]")


def _joined_fullmatches(pattern: str, names: list[str], deadline: float) -> set[str] | None:
    """The names `pattern` fully matches, found in one timed search over the names joined by
    newlines (a match call with a timeout costs ~4 us, ten times the match itself, so one
    call per name would make a 100k-module model pay 0.4 s per regex).

    None when that could differ from matching each name alone: a name holds a newline, the
    pattern looks around or sets flags, or a match runs across a newline (its pattern can
    match one, and the scan may then have skipped names).
    """
    if _NOT_LINEWISE.search(pattern) or any("\n" in n for n in names):
        return None
    try:
        lines = regex.compile(f"^(?:{pattern})$", regex.MULTILINE)
    except regex.error:
        return None
    found: set[str] = set()
    for m in lines.finditer("\n".join(names), timeout=max(deadline - time.monotonic(), 1e-3)):
        text = m.group()
        if "\n" in text:
            return None
        found.add(text)
        if time.monotonic() > deadline:
            raise TimeoutError
    return found


def _regex_hits(graph: ModelGraph, base: st.Regex, kind: str) -> tuple[set[str], list[Diagnostic]]:
    """Module paths (`kind="modules"`, never the root) or parameter names (`"params"`, aliases
    included) that `base` fully matches, within `REGEX_BUDGET_S` for all of them (P212)."""
    rx, error = _regex(base.pattern, base.span)
    if error:
        return set(), [error]
    cache = _hits.setdefault(graph, {})
    key = (kind, base.pattern)
    if key not in cache:
        names = [p for p in graph.modules if p] if kind == "modules" else list(graph.aliases)
        deadline = time.monotonic() + REGEX_BUDGET_S
        try:
            found = _joined_fullmatches(base.pattern, names, deadline)
            if found is None:
                found = set()
                for name in names:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    if rx.fullmatch(name, timeout=left):
                        found.add(name)
        except TimeoutError:
            found = None
        cache[key] = found
    if cache[key] is None:
        what = "module paths" if kind == "modules" else "parameter names"
        return set(), [Diagnostic(
            code="P212", severity="error", span=base.span, label="too slow to match",
            message=f"regular expression `{base}` did not finish matching the model's {what} "
                    f"within {REGEX_BUDGET_S:g} s",
            help=("a repeated group whose body can match the same text several ways (`(a+)+`, `(.*)*`, "
                  "`(a|aa)+`) backtracks exponentially; repeat the body once (`a+`, `.*`), or use a path "
                  "selector such as `blocks.*.attn`",))]
    return set(cache[key]), []


def check_regexes(sel: st.Selector) -> list[Diagnostic]:
    """Regex and predicate problems that need no model (for `planc check` without one)."""
    diags = []
    for base in [sel.base, *(e.base for e in sel.exclusions)]:
        if isinstance(base, st.Regex):
            diags.extend(d for d in [_regex(base.pattern, base.span)[1]] if d)
    if sel.where and sel.where.field in SIZE_FIELDS and sel.where.value.is_bytes:
        diags.append(Diagnostic(code="P103", severity="error", span=sel.where.value.span,
                                message=f"`size` counts parameters; `{sel.where.value}` is a size in bytes",
                                label="a byte size", help=("write a parameter count such as `100M`",)))
    if sel.where and sel.where.field not in SIZE_FIELDS:
        diags.append(Diagnostic(code="P208", severity="error", message=f"unknown predicate `{sel.where.field}`",
                                span=sel.where.span, label="not a predicate",
                                help=suggestion(sel.where.field, SIZE_FIELDS) or ("write `where size >= 100M`",)))
    return diags


def _base_modules(graph: ModelGraph, base, sel: st.Selector) -> tuple[set[str], _Walk | None, list[Diagnostic]]:
    if isinstance(base, st.Regex):
        paths, errs = _regex_hits(graph, base, "modules")
        return paths, None, errs
    walk = _Walk(graph, base.segments, params=False)
    return walk.modules(), walk, []


def _guard(graph: ModelGraph, guard: st.Guard | None, paths: set[str], optional: bool) -> tuple[set[str], list[Diagnostic]]:
    if guard is None:
        return paths, []
    known = graph.class_names | {graph.qualname(p) for p in graph.modules}
    unknown = [c for c in guard.classes if c not in known]
    diags = []
    if len(unknown) == len(guard.classes):
        bad = guard.classes[0]
        diags.append(Diagnostic(code="P202", severity="warning" if optional else "error",
                                message=f"no module of the model is a `{bad}`"
                                if len(guard.classes) == 1 else
                                "no module of the model has any of the classes " + ", ".join(f"`{c}`" for c in guard.classes),
                                span=guard.span, label="unknown class",
                                help=suggestion(bad, graph.class_names) or ("run `planc tree --model ...` to see class names",)))
    else:
        # A union may list classes of other model families on purpose, so one unknown name
        # among known ones is a warning, not an error; but never silent (a typo looks the same).
        for bad in unknown:
            diags.append(Diagnostic(code="P202", severity="warning", message=f"no module of the model is a `{bad}`",
                                    span=guard.span, label="this class matches nothing",
                                    help=suggestion(bad, graph.class_names) or
                                    ("remove it if the plan is not meant for another model family too",)))
    wanted = set(guard.classes)
    return {p for p in paths if graph.cls(p) in wanted or graph.qualname(p) in wanted}, diags


# FSDP1's size_based_auto_wrap_policy never wraps inside these: their children's weights are
# read directly by the parent's forward (MultiheadAttention uses `out_proj.weight` without
# calling `out_proj`), so a unit there would never be gathered.
FORCE_LEAF_MODULES = ("torch.nn.modules.activation.MultiheadAttention",)


def _inside_force_leaf(graph: ModelGraph, path: str) -> bool:
    return any(graph.qualname(a) in FORCE_LEAF_MODULES for a in graph.ancestors(path))


def _size_filter(graph: ModelGraph, where: st.Where, paths: set[str]) -> set[str]:
    """FSDP1 size-based wrapping: bottom-up, count only parameters not already claimed.

    `>=`/`>` follow `size_based_auto_wrap_policy`: going up the tree, a module is chosen when
    the parameters of its subtree that no chosen descendant has claimed reach the bound.
    Other comparisons test the whole subtree. One post-order pass with a stack of claimed
    counts: linear in the number of candidates.
    """
    limit = where.value.value
    ops = {"==": float.__eq__, "!=": float.__ne__, "<=": float.__le__, ">=": float.__ge__,
           "<": float.__lt__, ">": float.__gt__}
    op = ops[where.op]
    numel = graph.subtree_numel
    paths = {p for p in paths if not _inside_force_leaf(graph, p)}
    if where.op not in (">=", ">"):
        return {p for p in paths if graph.has_forward(p) and op(float(numel[p]), limit)}
    chosen: set[str] = set()
    # (candidate, parameters claimed inside its subtree), disjoint subtrees in post-order:
    # the entries under a module are always a suffix of the stack when the module comes up.
    stack: list[tuple[str, int]] = []
    for p in sorted(paths, key=graph.post):
        claimed = 0
        while stack and graph.is_within(stack[-1][0], p):
            claimed += stack.pop()[1]
        # ModuleList/ModuleDict are never chosen (the FSDP1 policy's EXCLUDE_WRAP_MODULES):
        # their unclaimed parameters count toward the parent instead.
        if graph.cls(p) not in ("ModuleList", "ModuleDict") and op(float(numel[p] - claimed), limit):
            chosen.add(p)
            claimed = numel[p]
        stack.append((p, claimed))
    return chosen


def _excludes_nothing(exc: st.Exclusion, what: str) -> Diagnostic:
    """P211 (warning): an `except` none of whose matches the selector had."""
    return Diagnostic(code="P211", severity="warning", span=exc.span,
                      message=f"`{exc}` excludes nothing: the selector matches no {what} it names",
                      label="excludes nothing",
                      help=("remove it, or check the path with `planc tree --model ...` (a typo here "
                            "silently keeps what it was meant to drop)",))


_dead: "weakref.WeakKeyDictionary[ModelGraph, dict]" = weakref.WeakKeyDictionary()


def _dead_alternatives(graph: ModelGraph, path: st.Path, what: str) -> list[Diagnostic]:
    """P210 (warning): a branch of `{a,b}` that matches nothing while the others do (one walk
    per branch, so cached per graph: later checks match the same selectors again)."""
    if not any(len(seg.alternatives) > 1 for seg in path.segments):
        return []
    cache = _dead.setdefault(graph, {})
    if (path, what) not in cache:
        cache[(path, what)] = _walk_alternatives(graph, path, what)
    return list(cache[(path, what)])


def _walk_alternatives(graph: ModelGraph, path: st.Path, what: str) -> list[Diagnostic]:
    found = []
    for i, seg in enumerate(path.segments):
        if len(seg.alternatives) < 2:
            continue
        for alt in seg.alternatives:
            alone = (*path.segments[:i], dataclasses.replace(seg, alternatives=(alt,)), *path.segments[i + 1:])
            walk = _Walk(graph, alone, params=what == "parameter")
            if not (walk.parameters() if what == "parameter" else walk.modules()):
                here = {n for p in walk.reached[i] for n in graph.child_names(p)} if i < len(walk.reached) else set()
                if what == "parameter":
                    here |= {local for p in walk.reached[i] for local, _ in graph.own_params(p)} \
                        if i < len(walk.reached) else set()
                found.append(Diagnostic(
                    code="P210", severity="warning", span=seg.span,
                    message=f"alternative `{alt}` in `{seg}` matches no {what}; the others do",
                    label=f"`{alt}` matches nothing",
                    help=suggestion(alt, here - set(seg.alternatives)) or
                    ("remove it, or mark the rule `optional` if it is there for another model",)))
    return found


def match_modules(graph: ModelGraph, sel: st.Selector, *, optional: bool = False) -> Match:
    """Module paths matched by `sel` (never the root), in model (pre-)order."""
    out = Match()
    diags = check_regexes(sel)
    if diags:
        out.diagnostics = diags
        return out
    paths, walk, errs = _base_modules(graph, sel.base, sel)
    out.diagnostics.extend(errs)
    if errs:
        return out
    if not paths and walk is not None and not optional:
        out.diagnostics.append(_no_match(graph, sel, walk, "module"))
        return out
    matched = len(paths)
    paths, gdiags = _guard(graph, sel.guard, paths, optional)
    out.diagnostics.extend(gdiags)
    if sel.where is not None:
        paths = _size_filter(graph, sel.where, paths)
    for exc in sel.exclusions:
        removed, _, errs = _base_modules(graph, exc.base, sel)
        out.diagnostics.extend(errs)
        if exc.guard:
            removed, gd = _guard(graph, exc.guard, removed, optional)
            out.diagnostics.extend(gd)
        if not errs and not optional and paths and not (removed & paths):
            out.diagnostics.append(_excludes_nothing(exc, "module"))
        paths -= removed
    if paths and not optional and isinstance(sel.base, st.Path):
        out.diagnostics.extend(_dead_alternatives(graph, sel.base, "module"))
    if not paths and not optional and not any(d.code in ("P202", "P105", "P212") for d in out.diagnostics):
        why = ("of the " + str(matched) + " module(s) its path matches, none passes " +
               ("the class guard" if sel.guard else "the size predicate" if sel.where else "its exclusions"))
        if sel.guard:
            classes = sorted({graph.cls(p) for p in _base_modules(graph, sel.base, sel)[0]})
            help_ = ("the path matches classes " + ", ".join(f"`{c}`" for c in classes[:6]),)
        elif sel.where:
            help_ = ("size counts only parameters no smaller match has claimed; lower the bound "
                     "or mark the rule `optional`",)
        else:
            help_ = ("narrow the `except` so that it keeps some matches, or mark the rule `optional`",)
        out.diagnostics.append(Diagnostic(code="P201", severity="error", message=f"selector `{sel}` matches no module",
                                          span=sel.span, label=why, help=help_))
    out.paths = sorted(paths, key=graph.pre)
    return out


def match_params(graph: ModelGraph, sel: st.Selector, *, optional: bool = False) -> Match:
    """Canonical parameter names matched by `sel` (any alias of a tied parameter counts)."""
    out = Match()
    out.diagnostics = check_regexes(sel)
    if out.diagnostics:
        return out
    if isinstance(sel.base, st.Regex):
        names, errs = _regex_hits(graph, sel.base, "params")
        if errs:
            out.diagnostics = errs
            return out
        walk = None
    else:
        walk = _Walk(graph, sel.base.segments, params=True)
        names = walk.parameters()
    for exc in sel.exclusions:
        if isinstance(exc.base, st.Regex):
            removed, errs = _regex_hits(graph, exc.base, "params")
            out.diagnostics.extend(errs)
        else:
            removed, errs = _Walk(graph, exc.base.segments, params=True).parameters(), []
        if not errs and not optional and names and not (removed & names):
            out.diagnostics.append(_excludes_nothing(exc, "parameter"))
        names -= removed
    if names and not optional and walk is not None:
        out.diagnostics.extend(_dead_alternatives(graph, sel.base, "parameter"))
    canon = {graph.aliases[n] for n in names}
    if not canon and not optional:
        if walk is not None:
            d = _no_match(graph, sel, walk, "parameter")
            out.diagnostics.append(Diagnostic(code="P206", severity="error", message=d.message, span=d.span,
                                              label=d.label, help=d.help))
        else:
            out.diagnostics.append(Diagnostic(code="P206", severity="error", span=sel.span,
                                              message=f"selector `{sel}` matches no parameter",
                                              label="no parameter name matches",
                                              help=("parameter names are dotted paths such as `layers.0.mlp.w_in.weight`; "
                                                    "run `planc tree --model ...` to see them",)))
    out.paths = sorted(canon)
    return out
