"""Expert parallelism, statically (P434, P482-P488): sizes, the experts' layout, the router.

What would fail late or train wrong is caught here, at the plan line: an expert count that
does not divide by the expert degree or experts that do not shard evenly on dim 1 (P482),
an expert degree that does not divide the ranks
it borrows, shard x context x tensor (P483), the style on a module that is not an experts
container of a known layout (P484), the experts or the router placed another way by the plan
(P485: `ignore`, `place` or a tensor style), a router that keeps more experts than there are
(P486), expert parallelism inside pipeline stages beside a tensor axis or under a split-backward
schedule (P487, not tested yet), an expert axis nothing uses
(P488, warning), a tensor style on an expert-parallel MoE layer beside a tensor axis (P434: planc
splits its tokens over the tensor group itself). `--simulate` runs an expert plan's step with balanced routing
(`planc.backends.experts.balanced_routing`: a fake process group cannot fill the split sizes);
memory `expect`s are checked (one expert rank's step, balanced routing:
planc/estimate/expert_local.py).
"""

from __future__ import annotations

from typing import Iterator

from planc.checks.context import Context, err, listed
from planc.checks.tensor import pattern
from planc.diagnostics import Diagnostic
from planc.lang import syntax as st
from planc.resolve.experts import expert_degrees, is_expert, layout, moe_layers
from planc.resolve.mesh import Mesh, Role
from planc.resolve.pipeline import SPLIT_BACKWARD

# The experts containers the `expert` style is known to fit (P484's help names them): 3-D
# weights [experts, ...], `forward(rows, offsets)` on rows sorted by expert.
KNOWN = ("planc.zoo.routed.RoutedExperts", "transformers' fused 3-D experts (Qwen3-MoE, Mixtral)")


def _statements(ctx: Context) -> list[tuple[int, st.ParallelStmt]]:
    return [(i, s) for i, s in enumerate(ctx.plan.statements) if isinstance(s, st.ParallelStmt) and is_expert(s)]


def _paths(ctx: Context, i: int) -> list[str]:
    return [p for p, setting in ctx.res.experts.items() if setting.order == i]


def _sizes(ctx: Context) -> dict | None:
    return ctx.res.mesh.sizes(ctx.world_size)


def check_expert_mesh(ctx: Context) -> Iterator[Diagnostic]:
    """P483: the expert degree divides shard x context x tensor (the ranks it borrows); P487: a
    pipeline with what is not tested there (`_under_pipeline`). A tensor axis is built: the MoE layer
    splits its tensor group's tokens (`planc.backends.experts.split_over_tensor`); a context axis is
    built: each context rank holds its own sequence shard, so its tokens are distinct and dispatch as
    a shard rank's do (tests/test_expert_context_dist.py)."""
    mesh = ctx.res.mesh
    axis = mesh.axis(Role.EXPERT)
    sizes = _sizes(ctx)
    if axis is None or sizes is None:
        return
    lent = Mesh.borrowed(Role.EXPERT, sizes)
    if expert_degrees(mesh, sizes) is None:
        yield err("P483", f"the expert axis (`{axis}`) does not divide the {lent} ranks it borrows", mesh.span,
                  f"shard x context x tensor = {lent}",
                  ("the expert axis borrows its ranks from shard x context x tensor (experts' FSDP degree = "
                   f"{lent} / expert): make the expert size a divisor of {lent}, e.g. `{axis.name} = "
                   f"{max(d for d in range(1, lent + 1) if lent % d == 0 and d <= max(sizes[Role.EXPERT], 1))}`",))
        return
    if sizes.get(Role.PIPELINE, 1) > 1 and ctx.res.experts:
        yield from _under_pipeline(ctx, sizes)


def _under_pipeline(ctx: Context, sizes: dict) -> Iterator[Diagnostic]:
    """P487: expert parallelism inside pipeline stages is built and tested (tests/test_pipeline_expert_dist.py)
    with whole-backward schedules and no tensor axis; a tensor axis beside them, or a schedule that
    splits the backward into input and weight halves, is not tested yet."""
    mesh, pp = ctx.res.mesh, ctx.res.pipeline
    if sizes.get(Role.TENSOR, 1) > 1:
        yield err("P487", "expert parallelism inside pipeline stages with a tensor axis is not supported yet",
                  mesh.span, f"pipeline, tensor = {sizes[Role.TENSOR]} and expert axes",
                  ("pipeline x expert is tested with the expert axis borrowing shard ranks only: remove the tensor "
                   "axis (or the pipeline axis, or the `expert` style)",))
    elif pp is not None and pp.schedule in SPLIT_BACKWARD:
        yield err("P487", f"expert parallelism inside pipeline stages under `{pp.schedule}` is not supported yet",
                  pp.span, "a split-backward schedule", related=((mesh.span, "the expert axis"),),
                  help_=(f"`{pp.schedule}` splits each backward into input and weight halves, which is not tested with "
                         "the experts' all-to-all dispatch: use a schedule with whole backwards (GPipe, 1F1B, "
                         "Interleaved1F1B, LoopedBFS)",))


def check_expert_unused(ctx: Context) -> Iterator[Diagnostic]:
    """P488 (warning): an expert axis, but no module gets the `expert` style."""
    axis = ctx.res.mesh.axis(Role.EXPERT)
    if axis is None or ctx.res.experts or any(i in ctx.res.broken for i, _ in _statements(ctx)):
        return
    yield err("P488", f"the mesh has an expert axis (`{axis}`) but no module is expert-parallel", ctx.res.mesh.span,
              "the expert axis is unused",
              ("mark the experts containers: `parallel layers.*.moe.experts expert`, or remove the axis",),
              severity="warning")


def known_layout(module) -> str | None:
    """None when `module` is an experts container the dispatch fits (`resolve.experts.layout`), else what is wrong."""
    try:
        layout(module)
    except ValueError as err:
        return str(err)
    return None


def _container(ctx: Context, path: str):
    parent = path.rpartition(".")[0]
    return ctx.graph.model.get_submodule(parent) if parent else None


def check_expert_modules(ctx: Context) -> Iterator[Diagnostic]:
    """P484: each `expert` statement's modules have a known layout; P482: their expert count divides
    by the expert degree; P486: the MoE layer's top-k is at most its expert count (one finding per statement)."""
    model = ctx.graph.model
    sizes = _sizes(ctx)
    degrees = None if sizes is None else expert_degrees(ctx.res.mesh, sizes)
    for i, s in _statements(ctx):
        paths = _paths(ctx, i)
        if not paths:
            continue
        bad = [(p, why) for p in paths if (why := known_layout(model.get_submodule(p))) is not None]
        if bad:
            p, why = bad[0]
            yield err("P484", f"`{p}` ({type(model.get_submodule(p)).__name__}) is not an experts container the "
                      f"`expert` style fits: {why}", s.span, f"{len(bad)} module(s) of another layout",
                      ("select the module holding the experts as 3-D weights whose forward takes the rows sorted by "
                       "expert and each expert's cumulative end, or the hidden states with each token's top-k expert "
                       "ids and weights; known layouts: " + listed(list(KNOWN)),))
            continue
        counts = {p: ctx.graph.params[ctx.graph.own_params(p)[0][1]].shape[0] for p in paths}
        if degrees is not None:
            uneven = [p for p in paths if counts[p] % degrees[0]]
            if uneven:
                yield err("P482", f"`{uneven[0]}` has {counts[uneven[0]]} experts, which do not divide by the expert "
                          f"degree {degrees[0]}", s.span, f"{len(uneven)} MoE layer(s)",
                          (f"every expert rank keeps experts / expert whole experts: make the expert size a divisor of "
                           f"{counts[uneven[0]]}",))
                continue
            ep, efsdp = degrees
            if ep * efsdp > min(counts.values()):  # the experts' FSDP shards dim 1: torch needs it even
                odd = [(c, shape[1]) for p in paths for _, c in ctx.graph.own_params(p)
                       if (shape := ctx.graph.params[c].shape)[1] % efsdp]
                if odd:
                    yield err("P482", f"`{odd[0][0]}` does not shard evenly over the experts' {efsdp} FSDP ranks: "
                              f"dim 1 is {odd[0][1]}", s.span, f"{len(odd)} parameter(s)",
                              (f"with efsdp x expert = {efsdp * ep} over {min(counts.values())} experts FSDP shards "
                               f"the experts on dim 1 (torchtitan's rule), which torch needs even: make efsdp (shard x "
                               f"context x tensor / expert) divide {odd[0][1]}, or raise the expert size",))
                    continue
        for p in paths:
            parent = _container(ctx, p)
            top_k = getattr(parent, "top_k", None) or getattr(getattr(parent, "router", None), "top_k", None)
            if isinstance(top_k, int) and top_k > counts[p]:
                yield err("P486", f"the router of `{p}` keeps {top_k} experts per token but there are {counts[p]}",
                          s.span, f"top-k {top_k} > {counts[p]} experts",
                          (f"the model's top_k must be at most its expert count ({counts[p]})",))
                break


def check_expert_placements(ctx: Context) -> Iterator[Diagnostic]:
    """P485: the experts' parameters `ignore`d or `place`d (expert parallelism places them), or a
    tensor style on the experts or their router (the router stays replicated: every rank routes
    its own tokens with the same weights)."""
    res = ctx.res
    for i, s in _statements(ctx):
        paths = _paths(ctx, i)
        params = [c for p in paths for _, c in ctx.graph.own_params(p)]
        placed = [n for n in params if n in res.ignored or n in res.placements]
        styled = [m for m in res.parallel for p in paths
                  if m == p or m.startswith(p + ".") or m.rpartition(".")[0] == p.rpartition(".")[0]]
        if placed:
            spans = [res.ignored.get(placed[0]) or res.placements[placed[0]][1]]
            yield err("P485", f"the plan also places the experts' parameter `{placed[0]}`", s.span,
                      "expert parallelism places these", related=[(spans[0], "placed here")],
                      help_=("remove the `ignore`/`place` line for the experts: expert parallelism keeps each rank's "
                             "experts and FSDP shards them on the expert mesh",))
        elif styled:
            yield err("P485", f"`{styled[0]}` gets a tensor-parallel style beside expert-parallel `{paths[0]}`", s.span,
                      "the router must stay replicated", related=[(res.parallel[styled[0]].span, "styled here")],
                      help_=("remove the `parallel` tensor style from the experts and their router",))


def check_expert_layer_styles(ctx: Context) -> Iterator[Diagnostic]:
    """P434: with a tensor axis over 1, no tensor style on an expert-parallel MoE layer itself (planc
    reads its input's layout to split its tokens over the tensor group: `split_over_tensor`)."""
    sizes = _sizes(ctx)
    if sizes is None or sizes.get(Role.TENSOR, 1) < 2:
        return
    layers = moe_layers(ctx.res.experts)
    for path, setting in ctx.res.parallel.items():
        if path in layers:
            axis = ctx.res.mesh.axis(Role.TENSOR)
            yield err("P434", f"`{pattern(path)}` holds expert-parallel experts and gets the tensor style "
                      f"`{setting.value.kind}`", setting.span, "planc splits this layer's tokens itself",
                      related=[(ctx.res.experts[layers[path]].span, "its experts are expert-parallel here")],
                      help_=(f"remove this `parallel` line: with the tensor axis (`{axis}`) each rank runs the MoE "
                             "layer on its part of the tensor group's tokens (its sequence shard under sequence "
                             "parallelism, else an equal cut of the replicated tokens, gathered back after)",))
            return

