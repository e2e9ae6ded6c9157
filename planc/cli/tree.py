"""`planc tree`: a model's module tree, to write selectors against."""

from __future__ import annotations

import os
import sys

from planc.cli.common import EXIT_OK, UsageError, use_color
from planc.diagnostics import render
from planc.lang.parse import load_with_diagnostics
from planc.model.build import ModelLoadError, build_model
from planc.model.graph import ModelGraph


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def cmd_tree(args) -> int:
    ref = args.model
    if ref is None and args.plan:
        plan, diags = load_with_diagnostics(args.plan)
        if plan is None or any(d.is_error for d in diags):
            # the plan's own problems, rendered as `check` would, then a usage error
            print(render.render_text(diags, dict(plan.sources) if plan else {}, color=use_color(sys.stderr)),
                  file=sys.stderr)
            raise UsageError(f"cannot read the `model` line of `{args.plan}`")
        ref = plan.model_ref
        if ref is None:
            raise UsageError(f"`{args.plan}` has no `model` line; pass --model MODULE:CALLABLE")
    if ref is None:
        raise UsageError("tree needs --model MODULE:CALLABLE (or --plan with a `model` line)")
    try:
        base = None if args.model else os.path.dirname(os.path.abspath(args.plan))
        graph = ModelGraph.from_module(build_model(ref, base=base))
    except ModelLoadError as err:
        raise UsageError(str(err)) from err
    print(format_tree(graph, args.depth))
    return EXIT_OK


def _param_label(graph: ModelGraph, module: str, local: str, canonical: str) -> str:
    """`weight`, or `weight tied to lm_head.weight` for a parameter other modules hold too."""
    if canonical not in graph.tied:
        return local
    me = f"{module}.{local}" if module else local
    others = sorted(n for n, c in graph.aliases.items() if c == canonical and n != me)
    return f"{local} tied to {', '.join(others)}" if others else local


def format_tree(graph: ModelGraph, depth: int | None = None) -> str:
    """The module tree with class names and parameter counts; runs of identical siblings folded."""
    lines = [f"<root>  {graph.cls('')}  {_human(graph.subtree_numel[''])} params"]

    def walk(path: str, prefix: str, level: int) -> None:
        if depth is not None and level >= depth:
            return
        kids = graph.children(path)
        names = graph.child_names(path)
        i = 0
        while i < len(kids):
            # fold runs of same-class numbered siblings: transformer_layers.0 .. 23
            j = i
            while (j + 1 < len(kids) and names[j + 1].isdigit() and names[i].isdigit()
                   and graph.cls(kids[j + 1]) == graph.cls(kids[i])
                   and graph.subtree_numel[kids[j + 1]] == graph.subtree_numel[kids[i]]):
                j += 1
            last = j == len(kids) - 1
            branch, cont = ("└── ", "    ") if last else ("├── ", "│   ")
            label = names[i] if j == i else f"{names[i]}..{names[j]}"
            each = " each" if j > i else ""
            own = ", ".join(_param_label(graph, kids[i], local, canon) for local, canon in graph.own_params(kids[i]))
            lines.append(f"{prefix}{branch}{label}  {graph.cls(kids[i])}  "
                         f"{_human(graph.subtree_numel[kids[i]])}{each}" + (f"  [{own}]" if own else ""))
            walk(kids[i], prefix + cont, level + 1)
            i = j + 1

    walk("", "", 0)
    return "\n".join(lines)
