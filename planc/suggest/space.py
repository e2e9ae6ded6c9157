"""The search space of `planc suggest`: what a candidate plan may choose, and its plan text.

A model is seen as a chain of *blocks* (the children of its largest list of same-class
modules: `layers.*`, `blocks.*`, `model.layers.*`) between fixed *side units*: the modules
before the blocks (token embeddings) each a unit, the modules after them one group unit
kept unsharded after forward (backward needs them at once), every tied parameter's owners
forced into one unit, small side modules left to the root (torchtitan's recipe, which the
shipped plans follow).

A candidate chooses, globally: the unit granularity (`merge`: how many neighbouring blocks
form one unit; the blocks' size against a threshold decides which merges are offered),
the HSDP replicate size, the prefetch depth and whether block units are offloaded to the
host; and per block unit: activation checkpointing (none / selective / full) and reshard
after forward (true, false, or N: keep a 1/N slice, on HSDP-sized shard groups).
`plan_text` prints a candidate as a formatted plan through the syntax nodes and
`planc.lang.printer`, so it is `planc fmt`-clean by construction.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from planc.diagnostics import Span
from planc.lang import printer
from planc.lang import syntax as st
from planc.model.graph import ModelGraph

CHECKPOINT_MODES = ("none", "selective", "full")
_NOWHERE = Span.point("<suggest>")


@dataclass(frozen=True)
class Chain:
    """The model's block chain and fixed side units (module paths)."""

    blocks_path: str                  # the list holding the blocks (`layers`)
    blocks: tuple[str, ...]           # `layers.0`, `layers.1`, ...
    pre: tuple[tuple[str, ...], ...]  # side units before the blocks (each a unit; >1 module: a group)
    post: tuple[str, ...]             # the group after the blocks (empty: none)
    block_params: tuple[int, ...]     # parameter count of each block

    @property
    def n(self) -> int:
        return len(self.blocks)


def find_chain(graph: ModelGraph) -> Chain:
    """The blocks and side units of `graph` (ValueError when the model has no block list)."""
    numel = graph.subtree_numel
    best = None
    for path in graph.modules:
        kids = graph.children(path)
        if len(kids) < 2 or len({graph.cls(k) for k in kids}) != 1:
            continue
        size = numel.get(path, 0)
        if size and (best is None or size > numel[best]):
            best = path
    if best is None:
        raise ValueError("the model has no list of two or more blocks of one class to shard as a chain")
    blocks = tuple(graph.children(best))
    side: list[str] = []
    for anc in [best, *graph.ancestors(best)]:
        parent = next(iter(graph.ancestors(anc)), "") if anc else None
        if parent is None:
            break
        side += [c for c in graph.children(parent) if c != anc and not graph.is_within(best, c)]
        if parent == "":
            break
    side = [s for s in side if numel.get(s, 0)]
    start = graph.pre(best)
    pre = sorted((s for s in side if graph.pre(s) < start), key=graph.pre)
    post = sorted((s for s in side if graph.pre(s) > start), key=graph.pre)
    # tied parameters: their owners' side modules form one unit (with the post group when any is there)
    def side_of(module: str) -> str | None:
        return next((s for s in side if module == s or graph.is_within(module, s)), None)
    pre_groups: list[list[str]] = [[p] for p in pre]
    tied_away = False
    for owners in graph.tied.values():
        sides = {side_of(o) for o in owners} - {None}
        if any(s in post for s in sides):
            for s in sides:
                if s in pre:
                    pre_groups = [g for g in pre_groups if s not in g]
                    tied_away = True
                    post = sorted(set(post) | {s}, key=graph.pre)
    # the token embedding is a unit (unless tied into the head's group); other small modules before
    # the blocks (a position embedding: under half a block) stay with the root
    half_block = numel[blocks[0]] / 2
    largest = max(pre_groups, key=lambda g: sum(numel[m] for m in g), default=None)
    pre_units = tuple(tuple(g) for g in pre_groups
                      if sum(numel[m] for m in g) >= half_block or (g is largest and not tied_away))
    return Chain(best, blocks, pre_units, tuple(post), tuple(numel[b] for b in blocks))


@dataclass(frozen=True)
class Candidate:
    """One point of the search space (see the module docstring).

    `checkpoint` and `reshard` hold one entry per block *unit* (after merging); reshard is
    True, False or an int N (keep a 1/N slice after forward).
    """

    merge: int = 1
    replicate: int = 1
    prefetch: int = 0          # 0: FSDP2's implicit prefetching; N: `prefetch forward = N`
    offload: bool = False
    checkpoint: tuple[str, ...] = ()
    reshard: tuple[bool | int, ...] = ()
    label: str = field(default="", compare=False)

    def describe(self) -> str:
        ck = _runs(self.checkpoint)
        rs = _runs(tuple({True: "true", False: "false"}.get(r, str(r)) if isinstance(r, bool) else str(r)
                         for r in self.reshard))
        return (f"merge {self.merge}, replicate {self.replicate}, prefetch {self.prefetch or 'implicit'}, "
                f"offload {'cpu' if self.offload else 'none'}, checkpoint {ck}, reshard {rs}")


def _runs(values: tuple) -> str:
    parts = []
    for v, g in itertools.groupby(values):
        k = len(list(g))
        parts.append(f"{v} x{k}" if k > 1 else str(v))
    return ", ".join(parts) or "-"


def unit_blocks(chain: Chain, merge: int) -> list[tuple[int, ...]]:
    """Block indices of each block unit when `merge` neighbours form one unit."""
    return [tuple(range(i, min(i + merge, chain.n))) for i in range(0, chain.n, merge)]


# ===================================================================== plan text, through syntax nodes


def _selector(path: str) -> st.Selector:
    """A path selector for one module path (`layers.3` prints as `layers[3]` where it is an index)."""
    segs = []
    for part in path.split("."):
        if part.isdigit() and segs:
            prev = segs.pop()
            segs.append(st.Segment(span=_NOWHERE, pattern=prev.pattern, index=int(part)))
        else:
            segs.append(st.Segment(span=_NOWHERE, pattern=part))
    return st.Selector(span=_NOWHERE, base=st.Path(span=_NOWHERE, segments=tuple(segs)))


def _slice(list_path: str, start: int, stop: int, n: int) -> st.Selector:
    """`layers[a:b]` (`layers.*` for the whole list, `layers[a]` for one)."""
    segs = [st.Segment(span=_NOWHERE, pattern=p) for p in list_path.split(".")] if list_path else []
    if start == 0 and stop == n:
        segs.append(st.Segment(span=_NOWHERE, pattern="*"))
    elif stop == start + 1:
        last = segs.pop()
        segs.append(st.Segment(span=_NOWHERE, pattern=last.pattern, index=start))
    else:
        last = segs.pop()
        segs.append(st.Segment(span=_NOWHERE, pattern=last.pattern, start=start or None,
                               stop=None if stop == n else stop, is_slice=True))
    return st.Selector(span=_NOWHERE, base=st.Path(span=_NOWHERE, segments=tuple(segs)))


def _value(v) -> st.Value:
    if isinstance(v, bool):
        return st.Name(span=_NOWHERE, value="true" if v else "false")
    if isinstance(v, int):
        return st.Number(span=_NOWHERE, value=v, text=str(v))
    return st.Name(span=_NOWHERE, value=v)


def _option(name: str, *positional, **keywords) -> st.Option:
    args = [st.Arg(span=_NOWHERE, key=None, key_span=None, value=_value(v)) for v in positional]
    args += [st.Arg(span=_NOWHERE, key=k, key_span=_NOWHERE, value=_value(v)) for k, v in keywords.items()]
    return st.Option(span=_NOWHERE, name=name, name_span=_NOWHERE, args=tuple(args))


def _block(*options: st.Option) -> st.Block | None:
    return st.Block(span=_NOWHERE, options=tuple(options)) if options else None


def _target(modules: tuple[str, ...]) -> st.Selector | st.Group:
    if len(modules) == 1:
        return _selector(modules[0])
    return st.Group(span=_NOWHERE, selectors=tuple(_selector(m) for m in modules))


def _reshard_value(r: bool | int):
    return r


def plan_statements(chain: Chain, model_ref: str | None, c: Candidate, tensor: int = 1,
                    parallel: tuple[str, ...] = (), context: int = 1, expert: int = 1) -> list[list[str]]:
    """The plan's statements as groups of lines (a blank line between groups), no header, no expects.

    Each of `context`, `expert` and `tensor` > 1 adds a mesh axis of that size (in that order,
    after replicate and shard, as the shipped plans write them); the `parallel` statements
    (plan text, one statement each: the rules of those axes) follow the units."""
    groups: list[list[str]] = []
    if model_ref:
        groups.append([printer.head(st.ModelStmt(span=_NOWHERE, ref=model_ref))])
    extra = [st.MeshAxis(span=_NOWHERE, name=name, size=size)
             for name, size in (("context", context), ("expert", expert), ("tensor", tensor)) if size > 1]
    mesh = st.MeshStmt(span=_NOWHERE, axes=(st.MeshAxis(span=_NOWHERE, name="replicate", size=c.replicate),
                                            st.MeshAxis(span=_NOWHERE, name="shard", size=None), *extra))
    groups.append([printer.head(mesh)])
    defaults = [_option("precision", param="bf16", reduce="fp32", cast_inputs=False), _option("reshard", after_forward=True)]
    if c.prefetch:  # every unit gathers the next N as it starts (the root the first block units)
        defaults.append(_option("prefetch", forward=c.prefetch))
    groups.append(["defaults {", *(f"  {printer.text(o)}" for o in defaults), "}"])
    units: list[st.UnitStmt] = [st.UnitStmt(span=_NOWHERE, target=_target(g), block=None) for g in chain.pre]
    extra = []
    if c.offload:
        extra.append(_option("offload", "cpu"))
    ub = unit_blocks(chain, c.merge)
    overrides = []
    if c.merge == 1:
        # the most common reshard value on the rule that makes the block units, runs of the
        # others as options for units made above (an override of every unit would leave the
        # first rule with no effect, P207)
        common = max(dict.fromkeys(c.reshard), key=list(c.reshard).count) if c.reshard else True
        own = extra + ([_option("reshard", after_forward=_reshard_value(common))] if common is not True else [])
        units.append(st.UnitStmt(span=_NOWHERE, target=_slice(chain.blocks_path, 0, chain.n, chain.n), block=_block(*own)))
        k = 0
        for r, run in itertools.groupby(c.reshard):
            n_run = len(list(run))
            if r != common or isinstance(r, bool) != isinstance(common, bool):
                target = _slice(chain.blocks_path, ub[k][0], ub[k + n_run - 1][-1] + 1, chain.n)
                overrides.append(st.UnitStmt(span=_NOWHERE, target=target,
                                             block=_block(_option("reshard", after_forward=_reshard_value(r)))))
            k += n_run
    else:
        for blocks, r in zip(ub, c.reshard):
            sel = _slice(chain.blocks_path, blocks[0], blocks[-1] + 1, chain.n)
            own = extra + ([_option("reshard", after_forward=_reshard_value(r))] if r is not True else [])
            units.append(st.UnitStmt(span=_NOWHERE, target=st.Group(span=_NOWHERE, selectors=(sel,)), block=_block(*own)))
    if chain.post:
        units.append(st.UnitStmt(span=_NOWHERE, target=_target(chain.post),
                                 block=_block(_option("reshard", after_forward=False))))
    units.append(st.RootStmt(span=_NOWHERE, block=_block(_option("reshard", after_forward=False))))
    groups.append([printer.statement(u) for u in units])
    if overrides:
        groups.append([printer.statement(u) for u in overrides])
    checkpoints = []
    per_block = [c.checkpoint[i] for i, blocks in enumerate(ub) for _ in blocks]
    b = 0
    for mode, run in itertools.groupby(per_block):
        n_run = len(list(run))
        if mode != "none":
            checkpoints.append(st.CheckpointStmt(span=_NOWHERE, selector=_slice(chain.blocks_path, b, b + n_run, chain.n),
                                                 mode=st.Name(span=_NOWHERE, value=mode)))
        b += n_run
    if checkpoints:
        groups.append([printer.statement(s) for s in checkpoints])
    if parallel:
        groups.append(list(parallel))
    return groups


AXIS_STYLES = {"context": "context", "expert": "expert"}  # the axes whose rules are one style word each


def parallel_rules(text: str, file: str, axis: str = "tensor") -> tuple[tuple[str, ...], list]:
    """The `parallel` statements of a plan's text for `axis`, each printed as one statement, and the
    parse errors: `context` / `expert` the statements of that style, `tensor` all the others."""
    from planc.lang.parse import parse_text
    stmts, _, diags = parse_text(text, file)
    errors = [d for d in diags if d.severity == "error"]

    def mine(s) -> bool:
        style = s.style.value
        return style == AXIS_STYLES[axis] if axis in AXIS_STYLES else style not in AXIS_STYLES.values()
    return tuple(printer.statement(s) for s in stmts if isinstance(s, st.ParallelStmt) and mine(s)), errors


def expect_line(budget_text: str, budget: float, world: int, shape: tuple[int, ...] | None) -> str:
    """`expect memory.peak <= BUDGET at world = N, input = BxS` (no `input =` when `shape` is None)."""
    return printer.head(st.ExpectMetric(span=_NOWHERE, metric="memory.peak", metric_span=_NOWHERE, op="<=",
                                        value=st.Number(span=_NOWHERE, value=budget, text=budget_text, is_bytes=True),
                                        world=world, input_shape=None if shape is None else tuple(shape)))


def plan_text(chain: Chain, model_ref: str | None, c: Candidate, header: list[str] = (),
              expects: list[str] = (), tensor: int = 1, parallel: tuple[str, ...] = (), context: int = 1,
              expert: int = 1) -> str:
    """The candidate as plan text in `planc fmt`'s layout (header lines are comments)."""
    groups = plan_statements(chain, model_ref, c, tensor, parallel, context, expert)
    if header:
        groups[0] = [f"# {h}" if h else "#" for h in header] + groups[0]
    if expects:
        groups.append(list(expects))
    from planc.lang.fmt import format_plan  # the canonical layout (blocks that outgrow a line)
    return format_plan("\n\n".join("\n".join(g) for g in groups) + "\n", "<suggest>")
