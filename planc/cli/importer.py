"""`planc import`: an accelerate FSDP config and/or Hugging Face tensor- and expert-parallel plans translated into a plan."""

from __future__ import annotations

import re
import sys
import textwrap

import planc
from planc.cli.common import EXIT_ERRORS, EXIT_OK, EXIT_USAGE, use_color
from planc.diagnostics import Diagnostic, Span, sort_diagnostics
from planc.diagnostics.render import render_text
from planc.model.build import ModelLoadError, build_model, rewrite_model_line
from planc.model.graph import ModelGraph


def main(args) -> int:
    """`planc import [CONFIG] [--model M] [--hf-tp-plan [--tensor N]] [--hf-ep-plan [--expert N]] [-o OUT]`: print or
    write the plan; exit 1 on errors."""
    hf_ep = getattr(args, "hf_ep_plan", False)
    if not args.config and not args.hf_tp_plan and not hf_ep:
        print("planc: error: give an accelerate config, `--hf-tp-plan`, `--hf-ep-plan`, or some of them", file=sys.stderr)
        return EXIT_USAGE
    if hf_ep and not args.model:
        print("planc: error: `--hf-ep-plan` reads the plan of the model `--model` names", file=sys.stderr)
        return EXIT_USAGE
    if args.hf_tp_plan and not args.model:
        print("planc: error: `--hf-tp-plan` reads the plan of the model `--model` names (e.g. --model hf:llama-tiny)",
              file=sys.stderr)
        return EXIT_USAGE
    if args.tensor < 1:
        print(f"planc: error: --tensor must be a positive number of ranks, got {args.tensor}", file=sys.stderr)
        return EXIT_USAGE
    source = None
    if args.config:
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
    name = args.output or "<imported plan>"
    sources: dict[str, str] = {}
    diags: list[Diagnostic] = []
    text: str | None = None
    if source is not None:
        from planc.importers.accelerate import translate

        text, diags = translate(source, args.config, graph=graph, model_ref=args.model)
        sources[args.config] = source
    if args.hf_tp_plan and (text is not None or source is None):
        text, more = with_tensor_plan(text, graph, args.model, args.tensor, name)
        diags = diags + more
    if hf_ep and not any(d.is_error for d in diags):
        text = with_expert_plan(text, graph, args.model, getattr(args, "expert", 2), name)
        if text is None:
            print(f"planc: error: `{args.model}` has no Hugging Face expert-parallel plan (config.base_model_ep_plan)",
                  file=sys.stderr)
            return EXIT_ERRORS
    if graph is not None and text is not None and not any(d.is_error for d in diags):
        # Check the written plan against the model now: an FSDP1 wrapping can be invalid
        # under FSDP2 (a tied weight split across units, P301), and the user should hear it
        # at import time rather than at the first forward.
        compiled = planc.compile(planc.loads(text, filename=name), graph, strict=False)
        diags = diags + list(compiled.diagnostics)
    if text is not None:
        sources[name] = text
    if diags:
        print(render_text(sort_diagnostics(diags), sources, color=use_color(sys.stderr)), file=sys.stderr)
    if text is not None:
        if args.output:
            if args.model:  # a relative `hf:` path starts from the written plan's folder
                text = rewrite_model_line(text, args.model, args.output)
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
    return EXIT_ERRORS if text is None or any(d.is_error for d in diags) else EXIT_OK


def _line_span(text: str, name: str, line: str) -> Span | None:
    for number, written in enumerate(text.splitlines(), 1):
        if written.strip() == line.strip():
            return Span(name, number, 1, number, len(written) + 1)
    return None


def with_tensor_plan(text: str | None, graph: ModelGraph, model_ref: str, tensor: int,
                     name: str) -> tuple[str | None, list[Diagnostic]]:
    """`text` (an imported plan, or None for a new one) with the model's Hugging Face TP plan and a tensor axis.

    A new plan gets one unit per class in the model's `_no_split_modules` (as accelerate wraps
    by default). Diagnostics point at the written plan's lines (file `name`).
    """
    from planc.importers.hf_tp import tensor_statements
    from planc.lang.fmt import format_plan

    found = tensor_statements(graph.model)
    if found is None:
        return None, [Diagnostic(code="P458", severity="error",
                                 message=f"`{model_ref}` has no Hugging Face tensor-parallel plan",
                                 help=("transformers ships `base_model_tp_plan` in the configs of the models it "
                                       "can split; write `parallel` statements by hand for this one "
                                       "(docs/language.md, `parallel`)",))]
    header = textwrap.wrap(f"Tensor parallelism: the Hugging Face plan of `{model_ref}` (`base_model_tp_plan` and "
                           "the head's `_tp_plan`), imported by `planc import --hf-tp-plan`.", 96,
                           initial_indent="# ", subsequent_indent="# ")
    for note in found.notes:
        header += textwrap.wrap(note, 96, initial_indent="# ", subsequent_indent="# ")
    if text is None:
        no_split = sorted(getattr(graph.model, "_no_split_modules", None) or [])
        lines = [f"# Imported by `planc import --hf-tp-plan --model {model_ref}`.", f"model {model_ref}", "",
                 f"mesh (shard = *, tensor = {tensor})", ""]
        if no_split:
            lines += ["# One unit per `_no_split_modules` class, as accelerate wraps by default.",
                      "unit ** : " + " | ".join(no_split), ""]
        text = "\n".join(lines) + "\n"
    else:
        text, count = re.subn(r"(?m)^(mesh \(.*)\)$", rf"\1, tensor = {tensor})", text, count=1)
        if not count:
            text = text + f"\nmesh (shard = *, tensor = {tensor})\n"
    text = text.rstrip("\n") + "\n\n" + "\n".join(header + found.lines) + "\n"
    text = format_plan(text, name)
    diags = []
    for s in found.skipped:
        diags.append(Diagnostic(code="P457", severity="warning", message=f"`{s.key}: {s.style}` not imported",
                                span=_line_span(text, name, s.comment.splitlines()[0]), label=s.reason,
                                help=("its parameters are replicated on the tensor axis instead",)))
    for shared in found.tied:
        diags.append(Diagnostic(code="P459", severity="warning",
                                message=" and ".join(f"`{p}`" for p in shared) + " are tied: tensor parallelism gives each "
                                "owner its own copy",
                                help=("planc ties them again after `parallelize_module` when the owners place them "
                                      "alike; `planc check` reports owners placed differently (P421)",)))
    return text, diags


def with_expert_plan(text: str | None, graph: ModelGraph, model_ref: str, expert: int, name: str) -> str | None:
    """`text` (an imported plan, or None for a new one) with the model's Hugging Face expert-parallel
    plan (`planc/importers/hf_ep.py`) and an expert axis; None when the model has no such plan."""
    from planc.importers.hf_ep import expert_statements
    from planc.lang.fmt import format_plan

    found = expert_statements(graph.model)
    if found is None:
        return None
    lines, skipped = found
    header = ["# Expert parallelism: the Hugging Face plan of `" + model_ref + "` (`base_model_ep_plan`), imported by",
              "# `planc import --hf-ep-plan`."]
    if text is None:
        no_split = sorted(getattr(graph.model, "_no_split_modules", None) or [])
        text = "\n".join([f"# Imported by `planc import --hf-ep-plan --model {model_ref}`.", f"model {model_ref}", "",
                          f"mesh (shard = *, expert = {expert})", ""]
                         + (["unit ** : " + " | ".join(no_split), ""] if no_split else [])) + "\n"
    else:
        text, count = re.subn(r"(?m)^(mesh \(.*)\)$", rf"\1, expert = {expert})", text, count=1)
        if not count:
            text = text + f"\nmesh (shard = *, expert = {expert})\n"
    text = text.rstrip("\n") + "\n\n" + "\n".join(header + skipped + lines) + "\n"
    return format_plan(text, name)
