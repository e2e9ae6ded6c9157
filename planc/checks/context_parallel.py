"""Context parallelism, statically (P492-P495): the axis, the styled modules, the sequence length.

A context axis cuts every batch along the sequence (`ShardBatch`); what trains wrong without
an error is caught here: a context axis with no module attending over it (P492), the style
on a module that is not an attention planc can route (P493), a Hugging Face model that builds
its rotary positions and causal mask from the whole sequence inside its forward (P494), a
sequence length that does not cut into 2 x context chunks (P495, also for `check --simulate
--input-shape`, before the simulated step). Context with a tensor axis is built (heads over the
tensor axis, with or without sequence parallelism: tests/test_context_dist.py).
"""

from __future__ import annotations

import inspect
from typing import Iterator

from planc.checks.context import Context, err, listed
from planc.diagnostics import Diagnostic
from planc.lang import syntax as st
from planc.resolve.context import is_context
from planc.resolve.mesh import Role

# The attention modules the `context` style is known to fit (P493's help names them).
KNOWN = ("planc.zoo.llama3.Attention",)
HF_PREFIX = "transformers."


def _context_axis(ctx: Context):
    return ctx.res.mesh.axis(Role.CONTEXT)


def _statements(ctx: Context) -> list[tuple[int, st.ParallelStmt]]:
    return [(i, s) for i, s in enumerate(ctx.plan.statements) if isinstance(s, st.ParallelStmt) and is_context(s)]


def check_context_unused(ctx: Context) -> Iterator[Diagnostic]:
    """P492: the mesh has a context axis, so every batch is cut along the sequence, but no
    module gets the `context` style (a broken `context` statement is reported on its own)."""
    axis = _context_axis(ctx)
    if axis is None or ctx.res.context or any(i in ctx.res.broken for i, _ in _statements(ctx)):
        return
    yield err("P492", f"the mesh has a context axis (`{axis}`) but no module attends over it", ctx.res.mesh.span,
              "every batch is cut along the sequence",
              ("mark the attention modules: `parallel layers.*.attention context` (without it each rank's "
               "attention sees only its own shard of the sequence and trains wrong)",))


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def supports_context(cls: type) -> bool:
    """Whether `cls` is an attention the `context` style can route: its `forward` takes `positions`
    (the global positions of its sequence shard) and calls causal SDPA without a mask."""
    try:
        source = inspect.getsource(cls.forward)
    except (TypeError, OSError):
        return False
    return _takes_positions(cls) and "scaled_dot_product_attention" in source and "is_causal=True" in source


def _takes_positions(cls: type) -> bool:
    try:
        return "positions" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


def check_context_modules(ctx: Context) -> Iterator[Diagnostic]:
    """P493 / P494: each `context` statement's modules are attentions planc can route (one
    finding per statement), and the model's forward takes the `positions` the loop passes
    down to them; a Hugging Face model is named (P494)."""
    if not ctx.res.context:
        return
    model = ctx.graph.model
    statements = _statements(ctx)
    if statements and not type(model).__module__.startswith(HF_PREFIX) and not _takes_positions(type(model)):
        yield err("P493", f"`{type(model).__name__}.forward` takes no `positions`: the training loop cannot pass "
                  "each rank's global positions down to its attention", statements[0][1].span,
                  "the model cannot take `positions=`",
                  ("the model's forward must take `positions` and pass them to each styled attention, as "
                   "`planc.zoo:llama` does (`model(tokens, positions=batch.positions)`)",))
        return
    for i, s in _statements(ctx):
        paths = [p for p, setting in ctx.res.context.items() if setting.order == i]
        if not paths:
            continue
        classes = {p: type(model.get_submodule(p)) for p in paths}
        hf = [p for p in paths if classes[p].__module__.startswith(HF_PREFIX)]
        if hf:
            cls = classes[hf[0]].__name__
            yield err("P494", f"`{cls}` is a Hugging Face attention: `{type(model).__name__}` builds its rotary "
                      "positions and causal mask from the whole sequence inside its forward", s.span,
                      f"{len(hf)} Hugging Face module(s)",
                      ("on a sequence shard they would be wrong without an error; use a model whose attention takes "
                       "global `positions=` (`model planc.zoo:llama`), or remove the context axis",))
            continue
        bad = [p for p in paths if not supports_context(classes[p])]
        if bad:
            yield err("P493", f"`{bad[0]}` ({classes[bad[0]].__name__}) is not an attention the `context` style "
                      "supports", s.span, f"{len(bad)} of {len(paths)} module(s): {listed(bad)}",
                      ("the style needs a module whose `forward` takes `positions` and calls "
                       "`F.scaled_dot_product_attention(q, k, v, is_causal=True)` without a mask: planc knows "
                       + ", ".join(f"`{k}`" for k in KNOWN),))


def sequence_problem(ctx_mesh, world: int | None, shape: tuple[int, ...], span, related=()) -> Diagnostic | None:
    """P495 when the sequence of a (batch, seq) `shape` does not cut into 2 x context chunks at `world`."""
    axis = ctx_mesh.axis(Role.CONTEXT)
    if axis is None or len(shape) != 2:
        return None
    sizes = ctx_mesh.sizes(world)
    cp = axis.size if axis.size is not None else (sizes or {}).get(Role.CONTEXT)
    seq = shape[1]
    if not cp or not seq or seq % (2 * cp) == 0:
        return None
    n = 2 * cp
    lower, upper = seq - seq % n, seq - seq % n + n
    return err("P495", f"context = {cp} cuts each sequence into {n} chunks, but `input = "
               f"{'x'.join(map(str, shape))}` has {seq} tokens", span, f"{seq} tokens % {n} != 0",
               (f"use a sequence length that is a multiple of 2 x context = {n}"
                + (f" ({lower} or {upper})" if lower else f" ({upper})"),), related=related)


def check_context_sequence(ctx: Context) -> Iterator[Diagnostic]:
    """P495: each `input = BxS` the plan writes has a sequence that cuts into 2 x context chunks."""
    mesh = ctx.res.mesh
    related = ((mesh.span, "the context axis"),) if mesh.span else ()
    for s in ctx.plan.statements:
        if isinstance(s, st.ExpectMetric) and s.input_shape is not None:
            found = sequence_problem(mesh, s.world or ctx.world_size, s.input_shape, s.input_span or s.span, related)
            if found is not None:
                yield found


def shape_problems(res, worlds: list[int], shape: tuple[int, ...]) -> list[Diagnostic]:
    """`check --simulate --input-shape`: P495 (the first) when the context axis cannot cut the
    shape's sequence at one of `worlds`, located on the first `context` statement."""
    origin = next(iter(res.context.values()), None)
    span = origin.span if origin is not None else res.mesh.span
    found = [sequence_problem(res.mesh, w, shape, span) for w in worlds]
    return [d for d in found if d is not None][:1]
