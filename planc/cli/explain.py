"""`planc explain PLAN`: the report of planc/analysis/explain.py, with `--simulate` and `--plot`."""

from __future__ import annotations

import json
import os
import sys

from planc.analysis.explain import render_text, report
from planc.cli.common import EXIT_ERRORS, EXIT_OK, EXIT_USAGE, ModelCache, UsageError, compile_for_cli, use_color
from planc.diagnostics import render
from planc.estimate.memory import estimate
from planc.estimate.trace import TraceError, known_cause
from planc.model.build import build_model
from planc.resolve.mesh import Role

# Failed `expect` lines (units, memory, the input of a memory bound): the plan itself is
# sound, so `explain` still reports it, after the diagnostics, and exits 1.
EXPECT_FAILURES = ("P501", "P502", "P504")


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    """`2x512` -> (2, 512)."""
    if not text:
        return None
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise UsageError(f"--input-shape {text}: expected sizes like 2x512")
    return shape



def main(args) -> int:
    """`planc explain` (arguments declared in `planc.cli.build_parser`)."""
    if args.world_size < 1:
        raise UsageError("--world-size must be at least 1")
    if not 0 <= args.rank < args.world_size:
        raise UsageError(f"--rank {args.rank} is not a rank of {args.world_size}")
    shape = parse_shape(args.input_shape)
    compiled, diags, sources, io = compile_for_cli(args.plan, args.model, [args.world_size], ModelCache(),
                                                   getattr(args, "routing", None))
    # NOTE: a failed `expect` does not stop the report: P502 sends people here for the breakdown
    blocking = [d for d in diags if d.is_error and d.code not in EXPECT_FAILURES]
    if io or not compiled or compiled[0].graph is None or blocking:
        text = render.render_text(diags, sources, color=use_color(sys.stderr))
        if text:
            print(text, file=sys.stderr)
        if compiled and compiled[0].graph is None and not any(d.is_error for d in diags):
            raise UsageError("explain needs a model: add a `model` line to the plan or pass --model")
        return EXIT_USAGE if io else EXIT_ERRORS
    c = compiled[0]
    if c.resolution.pipeline is not None:
        return _explain_pipeline(c, diags, sources, args)
    ref = args.model or c.plan.model_ref
    is_zoo = bool(ref and ref.startswith("planc.zoo:"))
    if args.simulate and shape is None and is_zoo:
        shape = (2, 16)  # the zoo's `example_input` default, so estimate and measurement agree
    factory, loss = _step_functions(args)
    example = None
    if factory is not None:
        if shape is not None:
            raise UsageError("--inputs and --input-shape name the inputs twice; give one")
        example = _call(factory, c.graph.model, "--inputs")
    try:
        est = estimate(c, args.world_size, optimizer=args.optimizer, input_shape=shape, inputs=example, loss=loss)
    except TraceError as err:
        # a 2-D plan traces one tensor-parallel rank's local shapes: a model that cannot run
        # them is the plan's (or the model's) problem, located as `planc check --simulate` does
        located = _locate_failure(c, ref, args, shape, factory, loss) if c.mesh.axis(Role.TENSOR) else []
        if located:
            print(render.render_text(located, sources, color=use_color(sys.stderr)), file=sys.stderr)
            return EXIT_ERRORS
        what = "--inputs" if factory is not None else "--input-shape"
        cause = known_cause(str(err))
        if cause is not None:
            raise UsageError(f"the model cannot be traced: {str(err).splitlines()[0]}; {cause}") from err
        raise UsageError(f"{what}: {err}" + ("" if factory is not None else "; the shape is batch x sequence of "
                         "token ids (leave it out to estimate without activations)")) from err
    step_time = _step_time(c, args, shape, example, loss)
    measured = None
    if args.simulate:
        try:
            measured = _simulate(c, ref, args, shape, factory, loss)
        except UsageError as err:
            located = _locate_failure(c, ref, args, shape, factory, loss) if err.__cause__ is not None else []
            if not located:
                raise
            # the step failed in the plan's own terms: the rule behind it, as `planc check --simulate` says
            print(render.render_text(located, sources, color=use_color(sys.stderr)), file=sys.stderr)
            return EXIT_ERRORS
    data = report(c, est, measured, ref, step_time)
    if args.plot:
        from planc.analysis.plot import PlotError, plot_step
        try:
            plot_step(est, args.plot, measured=measured)
        except PlotError as err:
            raise UsageError(str(err)) from err
    if args.html and "pipeline" in data:
        raise UsageError("--html does not show a pipeline job yet: use the text or --format json report")
    if args.html:
        from planc.analysis.plot import PlotError
        from planc.analysis.report_html import write_html
        try:
            write_html(args.html, data, c, est, measured)
        except PlotError as err:  # matplotlib missing: the page needs the plot
            raise UsageError(str(err).replace("--plot", "--html")) from err
        except OSError as err:
            raise UsageError(f"--html {args.html}: cannot write: {err.strerror}") from err
    warnings = [d for d in diags if not d.is_error]
    failed = [d for d in diags if d.is_error]  # expectations only (others stopped above)
    if failed or (warnings and args.format == "text"):
        shown = diags if args.format == "text" else failed
        print(render.render_text(shown, sources, color=use_color(sys.stderr)), file=sys.stderr)
    if args.format == "json":
        print(json.dumps(data, indent=2, default=str))
    else:
        print(render_text(data, c, color=use_color(sys.stdout)))
    return EXIT_ERRORS if failed else EXIT_OK


def _explain_pipeline(c, diags, sources, args) -> int:
    """A pipeline plan: the stages table, then memory per pipeline rank and the step (P476, a warning,
    when the memory per role cannot cut the stages)."""
    from planc.analysis.stages import pipeline_summary, render_stages
    from planc.checks.pipeline import batch_problem, not_estimated
    from planc.estimate.role_memory import RoleError

    summary = pipeline_summary(c)
    shown = [d for d in diags if args.format == "text" or d.is_error]
    shape = parse_shape(args.input_shape)
    uneven = batch_problem(c.resolution.pipeline, shape, c.resolution.pipeline.option_span("microbatches")) \
        if shape else None
    if uneven is not None:  # `--input-shape`: each data-parallel rank's batch, cut into the microbatches
        print(render.render_text(shown + [uneven], sources, color=use_color(sys.stderr)), file=sys.stderr)
        return EXIT_ERRORS
    estimated = _pipeline_estimates(c, args, shape)
    if isinstance(estimated, RoleError):
        shown.append(not_estimated(c.resolution.pipeline, c.resolution.pipeline.span,
                                   "`planc explain` did not estimate memory or step time", str(estimated)))
        estimated = None
    if shown:
        print(render.render_text(shown, sources, color=use_color(sys.stderr)), file=sys.stderr)
    if args.format == "json":
        print(json.dumps({"plan": c.plan.file, "world_size": args.world_size, "pipeline": summary,
                          **({"estimate": estimated} if estimated is not None else {})}, indent=2, default=str))
    else:
        print(render_stages(summary))
        if estimated is not None:
            from planc.analysis.role_report import render_text as render_roles
            print("\n" + render_roles(estimated, color=use_color(sys.stdout)))
    return EXIT_ERRORS if any(d.is_error for d in diags) else EXIT_OK


def _pipeline_estimates(c, args, shape):
    """Memory per pipeline rank and the step on the timeline (planc/analysis/role_report.py), or the
    `RoleError` when the memory per role cannot cut this pipeline (P476 says so)."""
    from planc.analysis.role_report import report as role_report
    from planc.estimate.role_memory import RoleError
    try:
        # the default optimizer: the estimate the `expect` lines were checked with (`memory_at`, cached)
        est = c.memory_at(args.world_size, shape) if args.optimizer == "adamw" else estimate(
            c, args.world_size, optimizer=args.optimizer, input_shape=shape)
    except RoleError as err:
        return err
    except TraceError as err:
        raise UsageError(f"--input-shape: {err}") from err
    step_time = _step_time(c, args, shape, None, None)
    return role_report(c, est, args.model or c.plan.model_ref, step_time)


def _step_time(compiled, args, shape, example, loss):
    """The step-time estimate for `--hardware` (default h100); FLOPs only with an input."""
    from planc.estimate.hardware import HardwareError, hardware
    from planc.estimate.time import estimate_step_time
    try:
        hw = hardware(getattr(args, "hardware", None) or "h100")
    except HardwareError as err:
        raise UsageError(f"--hardware: {err}") from err
    efficiency = getattr(args, "efficiency", None)
    if efficiency is not None and not 0 < efficiency <= 1:
        raise UsageError(f"--efficiency {efficiency}: expected a fraction in (0, 1]")
    try:
        return estimate_step_time(compiled, world=args.world_size, hardware=hw, input_shape=shape, inputs=example,
                                  loss=loss, optimizer=args.optimizer, efficiency=efficiency)
    except TraceError as err:
        raise UsageError(f"--input-shape: {err}") from err


def _step_functions(args):
    """The `--inputs` factory and the `--loss` function, imported (None when not given)."""
    from planc.model.build import load_callable
    from planc.model.errors import ModelLoadError
    out = []
    for flag, ref in (("--inputs", getattr(args, "inputs", None)), ("--loss", getattr(args, "loss", None))):
        try:
            out.append(None if ref is None else load_callable(ref))
        except ModelLoadError as err:
            raise UsageError(f"{flag}: {err}") from err
    return tuple(out)


def _call(factory, model, flag: str):
    try:
        return factory(model)
    except Exception as err:  # the user's code: report, never a traceback
        raise UsageError(f"{flag}: the input factory failed: {type(err).__name__}: {err}") from err


def _simulate(compiled, ref: str, args, shape, factory=None, loss=None):
    from planc.analysis.simulate import simulate, zoo_inputs
    if factory is not None:
        base = None if args.model else os.path.dirname(os.path.abspath(args.plan))
        try:
            return simulate(compiled.plan, lambda: build_model(ref, device="meta", base=base), args.world_size,
                            rank=args.rank, inputs=factory, optimizer=args.optimizer, loss=loss)
        except Exception as err:  # the model's own code, under fake tensors
            raise UsageError(f"--simulate: the step failed: {type(err).__name__}: {err}") from err
    if shape is None:
        raise UsageError("--simulate needs --input-shape BxS for a model outside planc.zoo")
    if len(shape) != 2:
        raise UsageError("--input-shape for --simulate is batch x sequence (token ids), e.g. 2x512")
    # a relative `hf:` path in the plan's `model` line starts from the plan's folder
    base = None if args.model else os.path.dirname(os.path.abspath(args.plan))
    try:
        return simulate(compiled.plan, lambda: build_model(ref, device="meta", base=base), args.world_size, rank=args.rank,
                        inputs=zoo_inputs(shape), optimizer=args.optimizer, loss=loss)
    except Exception as err:  # the model's own code, under fake tensors: report, never a traceback
        raise UsageError(f"--simulate: the step failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                         ) from err


def _locate_failure(compiled, ref: str, args, shape, factory=None, loss=None) -> list:
    """The failed `--simulate` step again, under `planc check --simulate`'s tracking: the
    diagnostic on the plan line behind the failure (P440-P444), or [] when it does not fail there."""
    from planc.analysis.shapecheck import check_step
    base = None if args.model else os.path.dirname(os.path.abspath(args.plan))
    try:
        return check_step(compiled.plan, lambda: build_model(ref, device="meta", base=base), args.world_size,
                          input_shape=shape if factory is None else None, inputs=factory, loss=loss,
                          optimizer=args.optimizer if args.optimizer in ("adamw", "adam", "sgd") else "none")
    except Exception:  # the plain usage error stands
        return []
