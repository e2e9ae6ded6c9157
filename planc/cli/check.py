"""`planc check PLAN...`: validate plans; text, JSON or GitHub annotations; exit 1 on errors."""

from __future__ import annotations

import sys

from planc.cli.common import EXIT_ERRORS, EXIT_OK, EXIT_USAGE, ModelCache, compile_for_cli, use_color
from planc.diagnostics import Diagnostic, render


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
