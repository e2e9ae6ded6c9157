"""`planc import CONFIG`: an accelerate FSDP config translated into a plan (planc/importers)."""

from __future__ import annotations

import sys

import planc
from planc.cli.common import EXIT_ERRORS, EXIT_OK, EXIT_USAGE, use_color
from planc.diagnostics.render import render_text
from planc.importers.accelerate import translate
from planc.model.build import ModelLoadError, build_model
from planc.model.graph import ModelGraph


def main(args) -> int:
    """`planc import CONFIG [--model M:F] [-o OUT]`: print or write the plan; exit 1 on errors."""
    try:
        with open(args.config, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as err:
        print(f"planc: error: cannot read {args.config}: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        import yaml  # noqa: F401
    except ImportError:
        print("planc: error: `planc import` needs PyYAML: pip install 'planc[import]'", file=sys.stderr)
        return EXIT_USAGE
    graph = None
    if args.model:
        try:
            graph = ModelGraph.from_module(build_model(args.model))
        except ModelLoadError as err:
            print(f"planc: error: --model {args.model}: {err}", file=sys.stderr)
            return EXIT_USAGE
    text, diags = translate(source, args.config, graph=graph, model_ref=args.model)
    sources = {args.config: source}
    if graph is not None and text is not None and not any(d.is_error for d in diags):
        # Check the written plan against the model now: an FSDP1 wrapping can be invalid
        # under FSDP2 (a tied weight split across units, P301), and the user should hear it
        # at import time rather than at the first forward.
        name = args.output or "<imported plan>"
        compiled = planc.compile(planc.loads(text, filename=name), graph, strict=False)
        diags = diags + compiled.diagnostics
        sources[name] = text
    if diags:
        print(render_text(diags, sources, color=use_color(sys.stderr)), file=sys.stderr)
    if text is not None:
        if args.output:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
    return EXIT_ERRORS if text is None or any(d.is_error for d in diags) else EXIT_OK
