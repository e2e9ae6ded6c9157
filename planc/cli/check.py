"""`planc check PLAN...`: validate plans; text, JSON or GitHub annotations; exit 1 on errors."""

from __future__ import annotations

import sys

from planc.cli.common import EXIT_ERRORS, EXIT_OK, EXIT_USAGE, ModelCache, UsageError, compile_for_cli, use_color
from planc.diagnostics import Diagnostic, render, sort_diagnostics


def cmd_check(args) -> int:
    if getattr(args, "verify_model", None) and not getattr(args, "verify", False):
        raise UsageError("--verify-model names the model --verify runs: add --verify")
    if getattr(args, "input_shape", None) and not getattr(args, "simulate", False):
        raise UsageError("--input-shape is the input of --simulate's step: add --simulate (memory `expect` lines "
                         "take `input = BxS` on the line)")
    cache = ModelCache()
    all_diags: list[Diagnostic] = []
    sources: dict[str, str] = {}
    io_problem = False
    summaries = []
    for path in args.plans:
        compiled, diags, srcs, io = compile_for_cli(path, args.model, args.world_size or [None], cache,
                                                    getattr(args, "routing", None))
        io_problem |= io
        simulated: list[int] = []
        if getattr(args, "simulate", False) and compiled and compiled[0].graph is not None \
                and not any(d.is_error for d in diags):
            found, simulated = simulate_plan(path, args, compiled)
            diags = sort_diagnostics(diags + found)
        verified = None
        if getattr(args, "verify", False) and compiled and compiled[0].graph is not None \
                and not any(d.is_error for d in diags):
            found, verified = verify_plan(path, args, compiled[0])
            diags = sort_diagnostics(diags + found)
        all_diags += diags
        sources.update(srcs)
        if compiled:
            # units is null without a model: nothing was resolved, only syntax and values checked
            summaries.append({"file": path, "units": len(compiled[0].units) if compiled[0].graph else None,
                              "errors": sum(d.is_error for d in diags), **({"simulated": simulated} if simulated else {}),
                              **({"verified": verified} if verified else {})})
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
                sim = (f"; one training step simulated at world {', '.join(map(str, s['simulated']))}"
                       if s.get("simulated") else "") + (f"; {s['verified']}" if s.get("verified") else "")
                print(f"{s['file']}: ok ({s['units']} units{sim})" if s["units"] is not None else
                      f"{s['file']}: ok (no model: selectors not resolved; add a `model` line or --model)")
    if io_problem:
        return EXIT_USAGE
    return EXIT_ERRORS if any(d.is_error for d in all_diags) else EXIT_OK


def simulate_plan(path: str, args, compiled) -> tuple[list[Diagnostic], list[int]]:
    """`--simulate`: one training step of the applied plan on a fake process group, at each world size
    (`--world-size`, else the mesh's fixed axes with 2 ranks for its `*` axis); the failures, located,
    and the world sizes simulated."""
    import os

    from planc.analysis.shapecheck import check_step, simulation_world
    from planc.cli.explain import parse_shape
    from planc.model.build import build_model

    shape = parse_shape(getattr(args, "input_shape", None))
    if shape is not None and len(shape) != 2:
        raise UsageError("--input-shape for --simulate is batch x sequence (token ids), e.g. 2x512")
    c = compiled[0]
    ref = args.model or c.plan.model_ref
    base = None if args.model else os.path.dirname(os.path.abspath(path))
    worlds = [x.world_size for x in compiled if x.world_size is not None] or [simulation_world(c.mesh)]
    pipeline = c.resolution.pipeline
    if pipeline is not None:  # the shape check runs one part: say so, located, and check the batch
        from planc.checks.pipeline import batch_problem, not_estimated

        found = batch_problem(pipeline, shape, pipeline.option_span("microbatches")) if shape else None
        skipped = not_estimated(pipeline, pipeline.span, "`--simulate` did not run a step",
                                "the fake-process-group step does not run a pipeline's schedule",
                                "`planc explain --input-shape BxS` estimates each pipeline rank's memory and the step; "
                                "`planc check --verify` trains the plan's twin on local ranks")
        return [d for d in (found, skipped) if d is not None], []
    if c.resolution.context and shape:  # an `--input-shape` the context axis cannot cut: said statically
        from planc.checks.context_parallel import shape_problems

        found = shape_problems(c.resolution, worlds, shape)
        if found:
            return found, []
    out: list[Diagnostic] = []
    seen = set()
    for world in worlds:
        for d in check_step(c.plan, lambda: build_model(ref, device="meta", base=base), world, input_shape=shape):
            if (d.code, d.span, d.message) not in seen:
                seen.add((d.code, d.span, d.message))
                out.append(d)
    return out, worlds


def verify_plan(path: str, args, compiled) -> tuple[list[Diagnostic], str | None]:
    """`--verify`: the plan trained on local processes against one process (`planc.analysis.verify`);
    the mismatches (P425), or why it could not run (P426), and the verdict's summary when it passed."""
    import os

    from planc.analysis import verify

    base = None if args.model else os.path.dirname(os.path.abspath(path))
    try:
        verdict = verify.verify(compiled, base=base, twin=getattr(args, "verify_model", None), model=args.model)
    except verify.VerifyError as err:
        return [verify.not_verified(compiled, str(err))], None
    return verify.diagnostics(compiled, verdict), (verdict.summary() if verdict.ok else None)
