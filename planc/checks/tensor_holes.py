"""Tensor-parallel rules for plans whose shapes work but whose numbers do not (the silent-wrong holes).

The shape simulation runs these plans to the end: every shape chains, yet training computes
another function or another gradient. Each rule here is backed by a facts test on real gloo
ranks (tests/test_holes_dist.py, tests/test_checks_tensor_dist.py):

* P418 parameters no style covers next to tensor-parallel ones, with the fix read from the
  layout chain: `rowwise` for a Linear a colwise output feeds, `colwise` for a projection
  missing beside split ones, the gradient-reducing `sequence` form for a module with weights
  on head-sharded activations, `replicate` elsewhere; silent for a module whose own
  `parallel` rule failed to resolve (its error says what to fix);
* P423 `replicate` on a module with weights that runs on head-sharded activations (a per-head
  `q_norm` after a colwise `q_proj`): its weight gradient is not reduced over the tensor axis;
* P424 `colwise` on a fused projection (`gate_up_proj` = [gate | up]) whose rowwise consumer
  takes fewer in-features than it makes: a contiguous split hands rank 0 whole parts.

A head-sharded region is a module with a colwise child left `Shard(-1)` (a producer): its
other children run on what that producer makes, 1/tp of the heads or features per rank.
"""

from __future__ import annotations

import bisect
from typing import Iterator

from torch import nn

from planc.checks.context import Context, by_key, err, listed
from planc.checks.fused import first_uses
from planc.checks.tensor import (
    COVER_SUBTREE,
    SPLIT,
    _parent,
    _sequence_norms,
    _view,
    pattern,
    patterns,
    styled,
    tp_size,
)
from planc.diagnostics import Diagnostic
from planc.lang import syntax as st
from planc.resolve.experts import moe_layers
from planc.resolve.ir import Setting
from planc.resolve.mesh import Role
from planc.resolve.selectors import match_modules
from planc.resolve.styles import STYLES

HOLE_CODES = frozenset({"P418", "P423", "P424"})  # what the checks here report

# the style that sums a replicated weight's gradient over the tensor axis on a (batch, seq, heads
# or features, ...) input sharded on dim 2 (Hugging Face's `replicated_with_grad_allreduce`)
REDUCING = "sequence { sequence_dim 2; local_output true }"
GRADIENT = ("its weight gradient is then the one-process gradient, summed over the tensor axis as Hugging "
            "Face's `replicated_with_grad_allreduce` does")
GATHER = ("or gather the activation before it: give the colwise producer `{ output replicate }` and its rowwise "
          "consumer `{ input replicate }`")


# ===================================================================== regions


def head_regions(ctx: Context) -> dict[str, str]:
    """Module -> its first colwise child left `Shard(-1)` as a local tensor (a Linear): the
    modules whose other children run on head- or feature-sharded activations. Once per context."""
    return ctx.memo("holes.regions", lambda: _find_regions(ctx))


def _find_regions(ctx: Context) -> dict[str, str]:
    view = _view(ctx)
    regions: dict[str, str] = {}
    for path, setting, producer, linear, parent in zip(view.order, view.styles.values(), view.producer,
                                                       view.linear, view.parents):
        if producer and linear and path and setting.value.use_local_output is not False:
            regions.setdefault(parent, path)
    return regions


def in_region(ctx: Context, owner: str) -> str | None:
    """The colwise producer whose output `owner` runs on: a sibling left `Shard(-1)` registered
    before it (a per-head `q_norm` comes after `q_proj`; a root `norm` before the `output`
    projection runs before it), or None."""
    producer = head_regions(ctx).get(_parent(owner)) if owner else None
    return producer if producer is not None and ctx.graph.pre(producer) < ctx.graph.pre(owner) else None


def _covering(ctx: Context, styles: dict[str, Setting], owner: str) -> tuple[str, Setting] | None:
    """(module, style) that places `owner`'s own parameters: its own style, else the nearest
    enclosing `sequence` / `replicate` (which cover a subtree)."""
    if owner in styles:
        return owner, styles[owner]
    for anc in ctx.graph.ancestors(owner):
        if anc in styles and styles[anc].value.kind in COVER_SUBTREE:
            return anc, styles[anc]
    return None


def _trained_owners(ctx: Context) -> dict[str, int]:
    """Module -> how many trained parameters it owns first (frozen and ignored ones left out)."""
    graph, out = ctx.graph, {}
    for name, info in graph.params.items():
        if name in ctx.res.ignored or not info.requires_grad:
            continue
        owner = graph.owners(name)[0]
        out[owner] = out.get(owner, 0) + 1
    return out


def _selector(names: list[str]) -> str:
    """`a.b.{c,d}` for siblings, else the first name: one selector for a fix."""
    parents = {n.rpartition(".")[0] for n in names}
    if len(names) > 1 and len(parents) == 1:
        parent = parents.pop()
        return f"{parent}.{{{','.join(n.rpartition('.')[2] for n in names)}}}"
    return names[0]


# ===================================================================== P423


def check_replicated_head_params(ctx: Context) -> Iterator[Diagnostic]:
    """P423: no `replicate` on a module with trained weights (not a Linear or an Embedding, which the
    region's layout chain wants split) inside a head-sharded region."""
    styles = styled(ctx)
    if not styles:
        return
    found = []
    for owner in _trained_owners(ctx):
        producer = in_region(ctx, owner)
        if producer is None or isinstance(ctx.graph.module(owner), (nn.Linear, nn.Embedding)):
            continue  # (a Linear there is a forgotten colwise / rowwise: its shapes fail, P416 / P418 say which)
        cover = _covering(ctx, styles, owner)
        if cover is None or STYLES[cover[1].value.kind].reduces_grad:  # `replicate` reduces none
            continue
        found.append(((cover[1].span, pattern(producer)), owner))
    for (span, producer), mods in by_key(found).items():
        names = patterns(mods)
        verb = "runs" if len(names) == 1 else "run"
        yield err("P423", f"`replicate` on {listed(names)}, which {verb} on head-sharded activations (after the "
                  f"colwise `{producer}`): {'its' if len(names) == 1 else 'their'} weight gradient is not reduced "
                  "over the tensor axis", span, "gradient not reduced over the tensor axis", (
                      f"write `parallel {_selector(names)} {REDUCING}`: {GRADIENT}",
                      f"{GATHER}; under `replicate` each rank keeps the gradient of its own heads only, and the "
                      "\"replicated\" copies drift apart"))


# ===================================================================== P424


def _fused_candidates(ctx: Context) -> list[tuple[str, str, int, int]]:
    """(colwise Linear left `Shard(-1)` as a local tensor, its rowwise sibling, out-features,
    in-features) where the rowwise sibling reads fewer features than the colwise layer makes."""
    view = _view(ctx)
    graph = ctx.graph
    out = []
    for i, (path, setting) in enumerate(view.styles.items()):
        if not (view.producer[i] and view.linear[i]) or setting.value.use_local_output is False:
            continue
        made = graph.module(path).out_features
        readers = [q for q, parent, reader in zip(view.order, view.parents, view.rowwise_reader)
                   if reader and parent == view.parents[i]]
        if readers and all(graph.module(q).in_features < made for q in readers):
            out.append((path, readers[0], made, graph.module(readers[0]).in_features))
    return out


def check_fused_colwise(ctx: Context) -> Iterator[Diagnostic]:
    """P424: a colwise projection whose output the model cuts into parts along the features
    (a fused [gate | up] or [q | k | v]) before a rowwise consumer that reads fewer features:
    split contiguously, rank 0 holds whole parts. Judged by `first_uses` (the model's forward
    on fake tensors), only where the widths say the output is fused."""
    if not styled(ctx):
        return
    candidates = _fused_candidates(ctx)
    firsts = {}
    for c in candidates:
        firsts.setdefault(pattern(c[0]), c[0])
    uses = first_uses(getattr(ctx.graph, "model", None), list(firsts.values())) if firsts else None
    if not uses:
        return
    tp = tp_size(ctx)
    found = []
    for path, reader, made, read in candidates:
        use = uses.get(firsts[pattern(path)])
        if use is not None and use.cut:
            found.append(((ctx.res.parallel[path].span, pattern(reader), made, read, use.op), path))
    for (span, reader, made, read, op), mods in by_key(found).items():
        names = patterns(mods)
        over = f"tensor = {tp}" if tp else "the tensor-parallel"
        yield err("P424", f"`colwise` on {listed(names)}, a fused projection: the model cuts its {made} output "
                  f"features into parts (`aten.{op}` on the last dim) before `{reader}` reads {read}, and a "
                  f"contiguous split over {over} ranks gives the first ranks whole parts", span,
                  "fused output split across ranks", (
                      f"gather the output: `parallel {_selector(names)} colwise {{ output replicate }}` and "
                      f"`parallel {reader} rowwise {{ input replicate }}` (Hugging Face's `colwise_rep` / "
                      "`rowwise_rep`)",
                      "or split the fused weight into one Linear per part (as Llama's `gate_proj` / `up_proj`, "
                      "`q_proj` / `k_proj` / `v_proj`), each `colwise`: where the parts' shapes still chain, as in "
                      "an MLP, the plan trains another function and no simulation sees it (the tiny Phi-3's loss is "
                      "off by 8.6e-4 on 2 gloo ranks)"))


# ===================================================================== P418


def _broken_targets(ctx: Context) -> set[str]:
    """Modules a `parallel` rule meant to style but could not (a typo in its style or options)."""
    out: set[str] = set()
    for i in ctx.res.broken:
        if i < len(ctx.plan.statements):
            stmt = ctx.plan.statements[i]
            if isinstance(stmt, st.ParallelStmt):
                out.update(match_modules(ctx.graph, stmt.selector, optional=True).paths)
    return out


def chain_fix(ctx: Context, owner: str) -> str:
    """The style a module left out of the tensor-parallel plan needs, read from the layout chain."""
    regions = head_regions(ctx)
    parent = _parent(owner)
    if not owner or parent not in regions:
        return "replicate"
    if not isinstance(ctx.graph.module(owner), nn.Linear):
        return REDUCING if in_region(ctx, owner) else "replicate"  # weights on head-sharded activations
    view = _view(ctx)
    fed = any(p == parent and reader for p, reader in zip(view.parents, view.rowwise_reader))
    return "colwise" if fed else "rowwise"  # a projection beside split ones / the colwise output's consumer


WHY = {"rowwise": "a colwise output feeds it", "colwise": "a projection beside split ones",
       REDUCING: "weights on head-sharded activations: `replicate` would not reduce their gradient"}


def _nearest_style(ctx: Context, styles: dict[str, Setting], pres: list[int], order: list[str],
                   path: str) -> Setting:
    """The style of the tensor-parallel module nearest `path` in the tree (for a location)."""
    for anc in [path, *ctx.graph.ancestors(path)]:
        lo = ctx.graph.pre(anc)
        k = bisect.bisect_left(pres, lo)
        if k < len(order) and pres[k] < lo + ctx.graph.subtree_size(anc):
            return styles[order[k]]
    return styles[order[0]]


def _on_tensor_axis(ctx: Context, styles: dict[str, Setting]) -> set[str]:
    """Canonical parameters a style puts on the tensor axis (split or replicated)."""
    covered: set[str] = set()
    for path, setting in styles.items():
        kind = setting.value.kind
        if kind in COVER_SUBTREE:
            covered |= ctx.graph.subtree_params(path)
        elif kind in SPLIT:
            covered.update(c for _, c in ctx.graph.own_params(path))
    return covered


def check_same_meshes(ctx: Context) -> Iterator[Diagnostic]:
    """P418: with any module on the tensor axis, every trained parameter is (the style each
    left-out module needs read from the layout chain). Frozen parameters are left out (the
    optimizer and gradient clipping never see them), and so are ignored ones (FSDP does not
    manage them), and the modules a broken `parallel` rule meant to style, and expert-parallel MoE
    layers (their experts on the expert mesh, their router's gradient summed over the tensor group)."""
    styles = styled(ctx)
    if not styles:
        return
    graph = ctx.graph
    covered = _on_tensor_axis(ctx, styles)
    skip = {norm for norm, _ in _sequence_norms(ctx, styles)}  # P417 asks for `sequence` there
    skip |= _broken_targets(ctx)
    if ctx.res.mesh.axis(Role.EXPERT) is not None:  # expert-parallel MoE layers split their tokens instead
        skip |= set(moe_layers(ctx.res.experts))
    unsplittable = [p for p, s in styles.items()  # P420 already says these are wrong
                    if s.value.kind in SPLIT and not isinstance(graph.module(p), (nn.Linear, nn.Embedding))]
    order = list(styles)
    pres = [graph.pre(p) for p in order]
    left: dict[str, int] = {}
    for name, info in graph.params.items():
        if name in covered or name in ctx.res.ignored or not info.requires_grad:
            continue
        owner = graph.owners(name)[0]
        if not any(graph.is_within(owner, p) for p in (*unsplittable, *skip)):
            left[owner] = left.get(owner, 0) + 1
    found = [((_nearest_style(ctx, styles, pres, order, owner).span,), owner) for owner in left]
    for (span,), mods in by_key(found).items():
        yield _left_out(ctx, span, mods, left, covered)


def _left_out(ctx: Context, span, mods: list[str], left: dict[str, int], covered: set[str]) -> Diagnostic:
    graph = ctx.graph
    names = [n or "<root>" for n in patterns(mods)]
    count = sum(left[m] for m in mods)
    by_fix: dict[str, list[str]] = {}
    for mod in mods:
        if mod:
            by_fix.setdefault(chain_fix(ctx, mod), []).append(pattern(mod))
    fixes = []
    for fix, styleable in by_fix.items():
        siblings: dict[str, list[str]] = {}
        for name in dict.fromkeys(styleable):
            siblings.setdefault(name.rpartition(".")[0] if fix != "replicate" else name, []).append(name)
        selectors = [_selector(group) for group in siblings.values()]
        text = "add " + ", ".join(f"`parallel {n} {fix}`" for n in selectors[:3]) + (
            " (and the others)" if len(selectors) > 3 else "")
        fixes.append(text + (f" ({WHY[fix]})" if fix in WHY else ""))
    if "<root>" in names:  # a selector never matches the root: its own parameters need another way
        own = [c for _, c in graph.own_params("") if c in graph.params and c not in covered]
        fixes.append(f"the root's own parameters ({listed(own)}) cannot take a style (a selector never "
                     "matches the root): move them into a submodule and give it `replicate`")
    fixes[-1] += (": `clip_grad_norm_` fails when some parameters are 2-D DTensors and others 1-D "
                  "(`All operands in aten.stack.default must have the same mesh`)")
    return err("P418", f"{listed(names)} {'is' if len(names) == 1 else 'are'} left out of the tensor-parallel "
               f"plan ({count} parameter{'' if count == 1 else 's'}) next to modules on the tensor axis", span,
               "puts the modules next to it on the tensor axis", fixes)
