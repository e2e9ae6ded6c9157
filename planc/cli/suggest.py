"""`planc suggest --model M --world-size N --budget 40GiB --input-shape BxS|--inputs MOD:FN`: the fastest plan that fits."""

from __future__ import annotations

import sys

from planc.cli.common import EXIT_ERRORS, EXIT_OK, EXIT_USAGE, ModelCache, UsageError, use_color
from planc.cli.explain import _call, _step_functions, parse_shape
from planc.diagnostics import Diagnostic, render
from planc.model.build import ModelLoadError, rewrite_model_line


def _budget(text: str) -> int:
    from planc.lang.transform import parse_quantity
    try:
        value, is_bytes = parse_quantity(text.strip())
    except (KeyError, ValueError):
        is_bytes, value = False, 0
    if not is_bytes or value <= 0:
        raise UsageError(f"--budget {text}: expected bytes per rank such as 40GiB or 500MiB")
    return int(value)


class _Progress:
    """A tqdm bar on stderr, shown only once the search has run for a second."""

    def __init__(self, enabled: bool):
        import time
        self.enabled, self.start, self.bar, self.time = enabled, time.perf_counter(), None, time

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None and self.time.perf_counter() - self.start > 1.0:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc="planc suggest", unit="choice", file=sys.stderr, leave=False)
        if self.bar is not None:
            self.bar.n = done
            self.bar.refresh()

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _degrees(text: str | None, axis: str = "tensor") -> list[int] | None:
    if text is None:
        return None
    try:
        out = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        out = []
    if not out or any(t < 1 for t in out):
        raise UsageError(f"--{axis} {text}: expected {axis} degrees such as 1,2,4,8")
    return out


def _rules(source: str, graph, axis: str = "tensor") -> tuple[str, ...]:
    """The `parallel` statements of `--tensor-parallel` (a plan file's, or `hf`: the model's Hugging Face
    plan), `--context-parallel` or `--expert-parallel` (a plan file's statements of that style, or `auto`)."""
    flag = f"--{axis}-parallel"
    if axis != "tensor" and source == "auto":
        from planc.suggest.degrees import auto_rules
        found = auto_rules(graph, axis) if graph.model is not None else ()
        if not found:
            what = "attention the `context` style fits" if axis == "context" else "experts container the `expert` style fits"
            raise UsageError(f"{flag} auto: the model has no {what} (docs/language.md); pass a plan file with "
                             f"`parallel ... {axis}` statements")
        return found
    if source == "hf" and axis == "tensor":
        from planc.importers.hf_tp import tensor_statements
        found = tensor_statements(graph.model) if graph.model is not None else None
        if found is None or not [line for line in found.lines if not line.startswith("#")]:
            raise UsageError("--tensor-parallel hf: the model has no Hugging Face tensor-parallel plan "
                             "(base_model_tp_plan); pass a plan file with `parallel` statements")
        return tuple(line for line in found.lines if not line.startswith("#"))
    from planc.suggest.space import parallel_rules
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise UsageError(f"{flag} {source}: cannot read: {err.strerror}") from err
    rules, errors = parallel_rules(text, source, axis)
    if errors:
        raise UsageError(f"{flag} {source}: the plan does not parse: {errors[0].message} "
                         f"(`planc check {source}` says where)")
    if not rules:
        raise UsageError(f"{flag} {source}: the plan has no `parallel` statements"
                         + (f" of the `{axis}` style" if axis != "tensor" else ""))
    return rules


def _axes(args, graph) -> dict:
    """The degrees and rules per axis the flags ask for (`suggest`'s keywords)."""
    out = {}
    for axis, rules_kw, degrees_kw in (("tensor", "parallel", "tensors"), ("context", "context_rules", "contexts"),
                                       ("expert", "expert_rules", "experts")):
        source, degrees = getattr(args, f"{axis}_parallel"), _degrees(getattr(args, axis), axis)
        if degrees is not None and source is None:
            how = "PLAN|hf" if axis == "tensor" else "PLAN|auto"
            raise UsageError(f"--{axis} needs --{axis}-parallel {how}: the `parallel` rules to apply at each degree")
        out[rules_kw] = _rules(source, graph, axis) if source is not None else None
        out[degrees_kw] = degrees
    return out


def main(args) -> int:
    """`planc suggest` (arguments declared in `planc.cli.main.build_parser`)."""
    from planc.estimate.hardware import HardwareError, hardware
    from planc.estimate.trace import TraceError
    from planc.suggest.search import NoDegree, suggest
    budget = _budget(args.budget)
    factory, _ = _step_functions(args)  # `--inputs`: an input factory, called with the model below
    if factory is not None and args.input_shape is not None:
        raise UsageError("--inputs and --input-shape name the inputs twice; give one")
    if factory is None and args.input_shape is None:
        raise UsageError("give the input per rank: --input-shape BxS (token ids), or --inputs MODULE:FN (an input "
                         "factory, for models that take other inputs)")
    shape = parse_shape(args.input_shape) if factory is None else None
    if factory is None and (shape is None or len(shape) != 2):
        raise UsageError("--input-shape is batch x sequence of token ids per rank, e.g. 2x4096")
    try:
        hw = hardware(args.hardware)  # a built-in profile's name or a TOML/JSON file (docs/time-model.md)
    except HardwareError as err:
        raise UsageError(f"--hardware {args.hardware}: {err}") from err
    try:
        graph = ModelCache().graph(args.model)
    except ModelLoadError as err:
        raise UsageError(f"--model {args.model}: {err}") from err
    axes = _axes(args, graph)
    if factory is not None and any(axes[k] is not None for k in ("parallel", "context_rules", "expert_rules")):
        raise UsageError("--tensor-parallel, --context-parallel and --expert-parallel take --input-shape: each degree "
                         "scales or cuts the batch of token ids (a tensor or context group shares one input); an "
                         "--inputs factory's inputs cannot be")
    if args.pipeline is not None or args.schedules is not None or args.global_batch is not None:
        if factory is not None:
            raise UsageError("--pipeline takes --input-shape: each degree cuts the batch of token ids into microbatches")
        if axes["context_rules"] is not None or axes["expert_rules"] is not None:
            raise UsageError("--pipeline does not combine with --context-parallel or --expert-parallel yet: search "
                             "them apart (docs/suggest.md, what is not searched)")
        return _pipeline(args, graph, budget, shape, hw, axes["parallel"], axes["tensors"])
    example = _call(factory, graph.model, "--inputs") if factory is not None else None
    given = f"--inputs {args.inputs}" if factory is not None else f"--input-shape {args.input_shape}"
    progress = _Progress(not args.quiet and sys.stderr.isatty())  # a bar only where someone watches
    try:
        result = suggest(graph, args.model, args.world_size, budget, shape, hardware=hw,
                         optimizer=args.optimizer, budget_text=args.budget.strip(), progress=progress,
                         inputs=example, inputs_name=args.inputs, **axes)
    except TraceError as err:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        fix = ("check that the factory returns what the model's forward takes (a tuple of positional arguments, "
               "a dict of keywords or an `Example`)" if factory is not None else
               "`--input-shape BxS` feeds token ids of batch B and sequence S; a model that takes other inputs "
               "(an encoder-decoder's decoder ids, images) needs `--inputs MODULE:FN`, a factory that returns "
               "them (docs/suggest.md), and a sequence the model refuses needs a shorter S")
        _report([Diagnostic(code="P953", severity="error", message=f"cannot search plans for `{args.model}` with "
                            f"`{given}`: {why}", span=None, help=(fix,))])
        return EXIT_ERRORS
    except NoDegree as err:
        if err.axes != ("tensor",):
            _report([_no_combination(args.model, err)])
            return EXIT_ERRORS
        _report([Diagnostic(code="P952", severity="error", message=f"cannot search tensor-parallel plans for `{args.model}`: "
                            f"{err}", span=None,
                            help=("pass degrees the rules hold at (`--tensor 1,2`), or fix the `parallel` rules: "
                                  "`planc check --simulate` on a plan with them at this world size says which rule "
                                  "fails and why",
                                  "if that check passes, the search's one-rank model of the rules is at fault, not "
                                  "the plan: write the plan by hand (`planc explain` estimates it) and report it"))])
        return EXIT_ERRORS
    except ValueError as err:  # no block chain in the model
        _report([Diagnostic(code="P951", severity="error", message=f"cannot search plans for `{args.model}`: {err}",
                            span=None, help=("write the plan by hand; `planc tree --model ...` "
                                                           "shows the module tree",))])
        return EXIT_ERRORS
    finally:
        progress.close()
    if result.best is None:
        s = result.smallest
        from planc.quantities import show_bytes
        _report([Diagnostic(
            code="P950", severity="error", message=f"no plan in the search space fits {show_bytes(budget)} per rank "
            f"on {args.world_size} ranks with {f'input {args.input_shape}' if factory is None else given}",
            span=None,
            help=(f"the smallest estimated peak planc found is {show_bytes(s.peak)} "
                  f"({f'{result.combo.describe(result.axes)}, ' if result.degrees else ''}{s.candidate.describe()}); "
                  "raise --budget to at least that, add ranks, or shorten the input",),
            notes=tuple(result.notes))])
        return EXIT_ERRORS
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:  # a relative `hf:` path starts from its folder
                f.write(rewrite_model_line(result.text, args.model, args.output))
        except OSError as err:
            raise UsageError(f"-o {args.output}: cannot write: {err.strerror}") from err
        degrees = f"{result.combo.describe(result.axes)}, " if result.axes else ""
        print(f"{args.output}: {degrees}{result.best.candidate.describe()}", file=sys.stderr)
    else:
        sys.stdout.write(result.text)
    return EXIT_OK


def _no_combination(model: str, err) -> Diagnostic:
    """P960: every combination of degrees asked for was skipped (the message says why, per combination)."""
    routing = ("P961: name the MoE layer's (or its router's) top-k `top_k` and the experts' row width `hidden_dim`, "
               "which planc reads to price the all-to-alls, or write the plan by hand",) if "P961" in str(err) else ()
    return Diagnostic(code="P960", severity="error", message=f"cannot search plans with {' x '.join(err.axes)} degrees "
                      f"for `{model}`: {err}", span=None,
                      help=routing + ("pass degrees the rules hold at, with 1 among them (`--context 1,2`, `--expert 1,2`: the "
                            "plan without that axis), or fix the `parallel` rules: `planc check` on a plan with them at "
                            "this world size says which rule fails and why",
                            "a combination the model does not run at as one rank (its local shapes, sequence shard or "
                            "experts) is the search's one-rank model at fault, not the plan: write the plan by hand "
                            "(`planc explain` estimates it) and report it"))


def _pipeline(args, graph, budget: int, shape, hw, rules, tensors) -> int:
    """`planc suggest --pipeline`: planc/suggest/pipeline.py."""
    from planc.estimate.trace import TraceError
    from planc.suggest.pipeline import DEFAULT_SCHEDULES, SCHEDULES, NoPipeline, suggest_all
    pipelines = _degrees(args.pipeline, "pipeline") if args.pipeline else None
    names = tuple(x for x in (args.schedules or ",".join(DEFAULT_SCHEDULES)).replace(" ", "").split(",") if x)
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown or not names:
        raise UsageError(f"--schedules {args.schedules}: torch's schedules are {', '.join(SCHEDULES)}")
    if args.global_batch is not None and args.global_batch < 1:
        raise UsageError(f"--global-batch {args.global_batch}: expected sequences per step, at least 1")
    try:
        result = suggest_all(graph, args.model, args.world_size, budget, shape, hardware=hw, optimizer=args.optimizer,
                             budget_text=args.budget.strip(), parallel=rules, tensors=tensors, pipelines=pipelines,
                             schedules=names, global_batch=args.global_batch)
    except NoPipeline as err:
        _report([Diagnostic(code="P954", severity="error", message=f"cannot search pipeline plans for `{args.model}` "
                            f"on {args.world_size} ranks: {err}", span=None,
                            help=("pass pipeline degrees that divide the world with the tensor degrees, a "
                                  "`--global-batch` that divides among the data-parallel ranks with at least one "
                                  "sequence per stage, or fewer stages than the model has blocks",))])
        return EXIT_ERRORS
    except TraceError as err:
        _report([Diagnostic(code="P953", severity="error", message=f"cannot search plans for `{args.model}` with "
                            f"`--input-shape {args.input_shape}`: {str(err).splitlines()[0]}", span=None,
                            help=("a sequence the model refuses needs a shorter S",))])
        return EXIT_ERRORS
    except ValueError as err:
        _report([Diagnostic(code="P951", severity="error", message=f"cannot search plans for `{args.model}`: {err}",
                            span=None, help=("write the plan by hand; `planc tree --model ...` shows the module tree",))])
        return EXIT_ERRORS
    if result.best is None:
        from planc.quantities import show_bytes
        s = result.smallest
        what = s.choice.describe() if hasattr(s, "choice") else s.candidate.describe()
        _report([Diagnostic(
            code="P950", severity="error", message=f"no plan in the search space fits {show_bytes(budget)} per rank "
            f"on {args.world_size} ranks with input {args.input_shape}", span=None,
            help=(f"the smallest estimated peak planc found is {show_bytes(s.peak)} ({what}); raise --budget to at "
                  "least that, add ranks, or a smaller --global-batch",), notes=tuple(result.notes))])
        return EXIT_ERRORS
    best = result.best
    what = best.choice.describe() if hasattr(best, "choice") else best.candidate.describe()
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(rewrite_model_line(result.text, args.model, args.output))
        except OSError as err:
            raise UsageError(f"-o {args.output}: cannot write: {err.strerror}") from err
        print(f"{args.output}: {what}", file=sys.stderr)
    else:
        sys.stdout.write(result.text)
    return EXIT_OK


def _report(diags) -> None:
    print(render.render_text(diags, {}, color=use_color(sys.stderr)), file=sys.stderr)


_ = EXIT_USAGE
