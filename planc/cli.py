"""The `planc` command line: check, tree, explain, emit, fmt, import, codes.

Exit codes (CI relies on them): 0 no errors (warnings allowed), 1 the plan has errors,
2 usage or I/O problems (a missing plan file, a model that cannot be built from `--model`).
No traceback reaches the user: unexpected failures are reported as internal errors.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from planc import render
from planc.compiler import CompiledPlan, sort_diagnostics
from planc.diagnostics import CODES, Diagnostic
from planc.graph import ModelGraph
from planc.models import ModelLoadError, build_model
from planc.parse import load_with_diagnostics

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A problem with how planc was called; printed as `planc: error: ...`, exit 2."""


def use_color(stream) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (no-color.org)."""
    return hasattr(stream, "isatty") and stream.isatty() and not os.environ.get("NO_COLOR")


class ModelCache:
    """Builds each referenced model once per run (on meta) and remembers failures."""

    def __init__(self):
        self._graphs: dict[tuple[str, str | None], ModelGraph | ModelLoadError] = {}

    def graph(self, ref: str, base: str | None = None) -> ModelGraph:
        """`base`: the plan's folder, where a relative `hf:` config path starts."""
        key = (ref, base)
        if key not in self._graphs:
            try:
                self._graphs[key] = ModelGraph.from_module(build_model(ref, base=base))
            except ModelLoadError as err:
                self._graphs[key] = err
        result = self._graphs[key]
        if isinstance(result, ModelLoadError):
            raise result
        return result


def compile_for_cli(path: str, model_ref: str | None, world_sizes: Sequence[int | None], cache: ModelCache
                    ) -> tuple[list[CompiledPlan], list[Diagnostic], dict[str, str], bool]:
    """Compile one plan file for each world size.

    Returns the compiled plans, the diagnostics (deduplicated over world sizes), the
    sources for rendering, and whether an I/O problem occurred (exit 2).
    """
    plan, diags = load_with_diagnostics(path)
    if plan is None:
        return [], diags, {}, True
    sources = dict(plan.sources)
    if any(d.is_error for d in diags):
        return [], diags, sources, False
    ref = model_ref or plan.model_ref
    graph = None
    if ref is not None:
        try:
            graph = cache.graph(ref, None if model_ref else os.path.dirname(os.path.abspath(path)))
        except ModelLoadError as err:
            if model_ref is not None:
                raise UsageError(f"--model {model_ref}: {err}") from err
            stmt = next(s for s in reversed(plan.statements) if getattr(s, "ref", None) == ref)
            diags.append(Diagnostic(code="P106", severity="error", message=str(err), span=stmt.span,
                                    label="this model", help=("check the module path and that its package is "
                                                              "installed; or pass `--model`",)))
    compiled = [CompiledPlan(plan, graph, w) for w in world_sizes]
    seen = set()
    for c in compiled:
        for d in c.diagnostics:
            key = (d.code, d.span, d.message)
            if key not in seen:
                seen.add(key)
                diags.append(d)
    return compiled, sort_diagnostics(diags), sources, False


# ===================================================================== commands


def cmd_check(args) -> int:
    cache = ModelCache()
    all_diags: list[Diagnostic] = []
    sources: dict[str, str] = {}
    io_problem = False
    summaries = []
    for path in args.plans:
        compiled, diags, srcs, io = compile_for_cli(path, args.model, args.world_size or [None], cache)
        io_problem |= io
        all_diags += diags
        sources.update(srcs)
        if compiled:
            # units is null without a model: nothing was resolved, only syntax and values checked
            summaries.append({"file": path, "units": len(compiled[0].units) if compiled[0].graph else None,
                              "errors": sum(d.is_error for d in diags)})
    if args.format == "json":
        print(render.render_json(all_diags, plans=summaries))
    elif args.format == "github":
        out = render.render_github(all_diags)
        if out:
            print(out)
    else:
        text = render.render_text(all_diags, sources, color=use_color(sys.stdout))
        if text:
            print(text)
        if not any(d.is_error for d in all_diags) and not io_problem:
            for s in summaries:
                print(f"{s['file']}: ok ({s['units']} units)" if s["units"] is not None else
                      f"{s['file']}: ok (no model: selectors not resolved; add a `model` line or --model)")
    if io_problem:
        return EXIT_USAGE
    return EXIT_ERRORS if any(d.is_error for d in all_diags) else EXIT_OK


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
            own = ", ".join(local for local, _ in graph.own_params(kids[i]))
            lines.append(f"{prefix}{branch}{label}  {graph.cls(kids[i])}  "
                         f"{_human(graph.subtree_numel[kids[i]])}{each}" + (f"  [{own}]" if own else ""))
            walk(kids[i], prefix + cont, level + 1)
            i = j + 1

    walk("", "", 0)
    return "\n".join(lines)


def cmd_codes(args) -> int:
    if args.code:
        code = args.code.upper()
        if code not in CODES:
            raise UsageError(f"no diagnostic code {args.code}")
        c = CODES[code]
        print(f"{code} ({c.severity}): {c.title}\n\n{c.explanation}")
        return EXIT_OK
    for code, c in CODES.items():
        print(f"{code}  {c.severity:<7}  {c.title}")
    return EXIT_OK


def _delegate(module: str, func: str = "main"):
    def run(args) -> int:
        import importlib
        return getattr(importlib.import_module(module), func)(args)
    return run


# ===================================================================== argument parsing


def _world_size(text: str) -> int:
    """argparse type for `--world-size`: a positive number of ranks."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"`{text}` is not a number of ranks") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"a world size is at least 1 rank, not {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="planc", description="Compile, check and apply FSDP2 sharding plans.")
    p.add_argument("--version", action="version", version="planc 0.1.0")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("check", help="validate plans (exit 1 on errors)")
    c.add_argument("plans", nargs="+", metavar="PLAN")
    c.add_argument("--model", metavar="MODULE:CALLABLE", help="model to check against (default: the plan's `model` line)")
    c.add_argument("--world-size", type=_world_size, nargs="+", metavar="N", help="check for these world sizes")
    c.add_argument("--format", choices=("text", "json", "github"), default="text")
    c.set_defaults(func=cmd_check)

    t = sub.add_parser("tree", help="print a model's module tree, to write selectors")
    t.add_argument("--model", metavar="MODULE:CALLABLE")
    t.add_argument("--plan", help="use this plan's `model` line")
    t.add_argument("--depth", type=int)
    t.set_defaults(func=cmd_tree)

    e = sub.add_parser("explain", help="the resolved plan: units, settings, memory per rank")
    e.add_argument("plan")
    e.add_argument("--model", metavar="MODULE:CALLABLE")
    e.add_argument("--world-size", type=_world_size, required=True, metavar="N")
    e.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw")
    e.add_argument("--format", choices=("text", "json"), default="text")
    e.add_argument("--simulate", action="store_true", help="also measure one step in a fake process group")
    e.add_argument("--rank", type=int, default=0, help="rank to simulate (default 0)")
    e.add_argument("--input-shape", metavar="BxS", help="input batch x sequence for activations")
    e.add_argument("--plot", metavar="FILE", help="write memory over one step (PNG or SVG)")
    e.add_argument("--html", metavar="FILE", help="write the report as one self-contained HTML page")
    e.set_defaults(func=_delegate("planc.explain"))

    m = sub.add_parser("emit", help="print the equivalent hand-written fully_shard code")
    m.add_argument("plan")
    m.add_argument("--model", metavar="MODULE:CALLABLE")
    m.set_defaults(func=_delegate("planc.emit"))

    f = sub.add_parser("fmt", help="format plans canonically")
    f.add_argument("plans", nargs="+", metavar="PLAN")
    f.add_argument("--check", action="store_true", help="exit 1 if a plan is not formatted")
    f.set_defaults(func=_delegate("planc.fmt"))

    i = sub.add_parser("import", help="translate an accelerate FSDP config into a plan")
    i.add_argument("config")
    i.add_argument("--model", metavar="MODULE:CALLABLE")
    i.add_argument("-o", "--output", help="write the plan here (default: stdout)")
    i.set_defaults(func=_delegate("planc.importer"))

    k = sub.add_parser("codes", help="list diagnostic codes, or explain one")
    k.add_argument("code", nargs="?")
    k.set_defaults(func=cmd_codes)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as err:
        print(f"planc: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # never show a traceback to a user; say it is planc's fault
        print(f"planc: internal error: {type(err).__name__}: {err}\n"
              "this is a bug in planc; please report it with the plan and command", file=sys.stderr)
        if os.environ.get("PLANC_DEBUG"):
            raise
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
