"""The `planc` command line: argument parsing and dispatch to one module per command.

    check  tree  explain  suggest  emit  fmt  import  lsp  codes

No traceback reaches the user: unexpected failures are reported as internal errors.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from planc.cli import check, codes, emit, explain, fmt, importer, lsp, suggest, tree
from planc.cli.common import EXIT_ERRORS, EXIT_USAGE, UsageError
from planc.limits import MAX_RANKS
from planc.lower.job import Action, UnknownKind

# ===================================================================== argument parsing


def _world_size(text: str) -> int:
    """argparse type for `--world-size`: a positive number of ranks."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"`{text}` is not a number of ranks") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"a world size is at least 1 rank, not {n}")
    if n > MAX_RANKS:
        raise argparse.ArgumentTypeError(f"{n} ranks is more than planc's limit of {MAX_RANKS:,}")
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
    c.add_argument("--simulate", action="store_true", help="also apply the plan on a fake process group and run one "
                   "training step on fake tensors (the shape-level check of tensor parallelism)")
    c.add_argument("--input-shape", metavar="BxS", help="with --simulate: batch x sequence of token ids "
                   "(default 2x16, the sequence rounded up to a multiple of the tensor size)")
    c.add_argument("--verify", action="store_true", help="also train the plan on a small twin of the model on local "
                   "gloo processes and compare losses, gradients and weights with one unsharded process (P425)")
    c.add_argument("--verify-model", metavar="REF", help="with --verify: the small model to run (a `planc.zoo:`/"
                   "`hf:` reference or MODULE:CALLABLE; default: the plan model's shipped tiny twin)")
    c.add_argument("--routing", metavar="FILE", help="a routing histogram recorded from a real step "
                   "(planc.analysis.routing.record_routing): memory `expect`s of expert-parallel plans use it instead "
                   "of balanced routing; checked against the plan (P436)")
    c.set_defaults(func=check.cmd_check)

    t = sub.add_parser("tree", help="print a model's module tree, to write selectors")
    t.add_argument("--model", metavar="MODULE:CALLABLE")
    t.add_argument("--plan", help="use this plan's `model` line")
    t.add_argument("--depth", type=int)
    t.set_defaults(func=tree.cmd_tree)

    e = sub.add_parser("explain", help="the resolved plan: units, settings, memory per rank")
    e.add_argument("plan")
    e.add_argument("--model", metavar="MODULE:CALLABLE")
    e.add_argument("--world-size", type=_world_size, required=True, metavar="N")
    e.add_argument("--optimizer", choices=("adamw", "adamw_fused", "adam", "adam_fused", "sgd", "none"),
                   default="adamw")  # planc.estimate.memory.OPTIMIZERS (not imported: torch is slow to load)
    e.add_argument("--format", choices=("text", "json"), default="text")
    e.add_argument("--simulate", action="store_true", help="also measure one step in a fake process group")
    e.add_argument("--rank", type=int, default=0, help="rank to simulate (default 0)")
    e.add_argument("--input-shape", metavar="BxS", help="input batch x sequence for activations")
    e.add_argument("--inputs", metavar="MODULE:FN", help="input factory: fn(model) -> args tuple, kwargs dict "
                   "or planc.estimate.trace.Example (encoder-decoder, vision, flex-attention masks)")
    e.add_argument("--loss", metavar="MODULE:FN", help="the step's loss: fn(output, example) -> scalar "
                   "(default: cross-entropy over fp32 logits for language models, else output.sum())")
    e.add_argument("--plot", metavar="FILE", help="write memory over one step (PNG or SVG)")
    e.add_argument("--html", metavar="FILE", help="write the report as one self-contained HTML page")
    e.add_argument("--hardware", metavar="NAME|FILE", default="h100",
                   help="hardware profile for the step-time estimate: h100, h200, a100, b200 or a TOML/JSON file "
                   "(docs/time-model.md)")
    e.add_argument("--efficiency", type=float, metavar="F",
                   help="achievable fraction of peak FLOP/s (default: the profile's, 0.6 built in)")
    e.add_argument("--routing", metavar="FILE", help="a routing histogram recorded from a real step "
                   "(planc.analysis.routing.record_routing): the expert-parallel estimates use, per MoE layer, the "
                   "rows its busiest expert rank receives instead of balanced routing")
    e.set_defaults(func=explain.main)

    _add_suggest(sub)

    m = sub.add_parser("emit", help="print the equivalent hand-written fully_shard code")
    m.add_argument("plan")
    m.add_argument("--model", metavar="MODULE:CALLABLE")
    m.set_defaults(func=emit.main)

    f = sub.add_parser("fmt", help="format plans canonically")
    f.add_argument("plans", nargs="+", metavar="PLAN")
    f.add_argument("--check", action="store_true", help="exit 1 if a plan is not formatted")
    f.set_defaults(func=fmt.main)

    i = sub.add_parser("import", help="translate an accelerate FSDP config and/or a Hugging Face TP plan into a plan")
    i.add_argument("config", nargs="?", help="an accelerate config (YAML)")
    i.add_argument("--model", metavar="MODULE:CALLABLE")
    i.add_argument("--hf-tp-plan", action="store_true",
                   help="add the tensor-parallel plan transformers ships with --model (base_model_tp_plan)")
    i.add_argument("--tensor", type=int, default=2, metavar="N", help="ranks on the tensor axis (default 2)")
    i.add_argument("--hf-ep-plan", action="store_true",
                   help="add the expert-parallel plan transformers ships with --model (base_model_ep_plan)")
    i.add_argument("--expert", type=int, default=2, metavar="N", help="ranks on the expert axis (default 2)")
    i.add_argument("-o", "--output", help="write the plan here (default: stdout)")
    i.set_defaults(func=importer.main)

    s = sub.add_parser("lsp", help="serve the language server over stdio, for editors (needs the lsp extra)")
    s.add_argument("--stdio", action="store_true", help="talk over stdin/stdout (the default, and the only transport)")
    s.set_defaults(func=lsp.main)

    k = sub.add_parser("codes", help="list diagnostic codes, or explain one")
    k.add_argument("code", nargs="?")
    k.set_defaults(func=codes.cmd_codes)
    return p


# per axis `suggest` searches the degree of: (metavar, help) of its rules flag and of its degrees flag
_SUGGEST_AXES = (
    ("tensor", ("PLAN|hf", "also search tensor-parallel degrees with these `parallel` rules: those of a plan file, or "
                           "`hf` for the model's Hugging Face base_model_tp_plan (docs/suggest.md)"),
     ("T,T,...", "tensor-parallel degrees to search with --tensor-parallel (default: 1, 2, 4, 8 dividing the world, at "
                 "most the GPUs per node)")),
    ("context", ("PLAN|auto", "also search context-parallel degrees with these `parallel ... context` rules: those of a "
                              "plan file, or `auto` for every attention the context style fits (docs/suggest.md)"),
     ("C,C,...", "context degrees to search with --context-parallel (default: 1, 2, 4, 8 dividing the world, the ones "
                 "above 1 tried only when nothing without a context axis fits)")),
    ("expert", ("PLAN|auto", "also search expert-parallel degrees with these `parallel ... expert` rules: those of a "
                             "plan file, or `auto` for every experts container the expert style fits (docs/suggest.md)"),
     ("E,E,...", "expert degrees to search with --expert-parallel (default: 1, 2, 4, 8 dividing the world)")),
)


def _add_suggest(sub) -> None:
    """`planc suggest`'s arguments (planc/cli/suggest.py)."""
    g = sub.add_parser("suggest", help="search for the fastest plan that fits a per-rank memory budget")
    g.add_argument("--model", required=True, metavar="MODULE:CALLABLE")
    g.add_argument("--world-size", type=_world_size, required=True, metavar="N")
    g.add_argument("--budget", required=True, metavar="BYTES", help="per-rank memory budget, e.g. 40GiB")
    g.add_argument("--input-shape", metavar="BxS", help="token ids per rank, batch x sequence")
    g.add_argument("--inputs", metavar="MODULE:FN", help="instead of --input-shape: input factory, fn(model) -> args "
                   "tuple, kwargs dict or Example, the step's inputs per rank (e.g. an encoder-decoder's decoder ids)")
    g.add_argument("--hardware", metavar="NAME|FILE", default="h100",
                   help="hardware profile: h100, h200, a100, b200 or a TOML/JSON file (docs/time-model.md; default h100)")
    g.add_argument("--optimizer", choices=("adamw", "adamw_fused", "adam", "adam_fused", "sgd", "none"), default="adamw")
    for axis, rules, degrees in _SUGGEST_AXES:  # --tensor-parallel/--tensor, --context-parallel/--context, ...
        g.add_argument(f"--{axis}-parallel", metavar=rules[0], help=rules[1])
        g.add_argument(f"--{axis}", metavar=degrees[0], help=degrees[1])
    g.add_argument("--pipeline", metavar="P,P,...", nargs="?", const="",
                   help="also search pipeline plans: degrees P (default 1, 2, 4, 8, 16 dividing the world), the "
                        "schedule, stages per rank, microbatches and the split (docs/suggest.md)")
    g.add_argument("--schedules", metavar="NAME,...",
                   help="torch's schedules the pipeline search tries (default 1F1B,Interleaved1F1B,ZBVZeroBubble)")
    g.add_argument("--global-batch", type=int, metavar="G",
                   help="sequences per step over the whole world (default: world size x B of --input-shape); "
                        "every degree searched trains G sequences a step")
    g.add_argument("-o", "--output", metavar="FILE", help="write the plan here (default: stdout)")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=suggest.main)


def _unhandled(err: UnknownKind) -> str:
    """What a command cannot do yet, in the plan's terms, located at the plan line behind it."""
    origin = getattr(err.what, "origin", None)
    span = getattr(origin, "span", None)
    where = f"{span.file}:{span.line}: " if span is not None else ""
    rule = f" (`{origin.rule}`)" if origin is not None and origin.rule != "default" else ""
    if type(err.what).__name__ in ("AttendOverContext", "ShardBatch"):
        return (f"{where}context parallelism is not handled here{rule}: {err.interpreter} does not run it; "
                "`planc check` (with `--simulate`), `planc explain`, `planc emit` and `planc.apply` handle it")
    if type(err.what).__name__ == "DispatchExperts":
        return (f"{where}expert parallelism is not yet estimated{rule}: {err.interpreter} does not model it; "
                "`planc check`, `planc emit` and `planc.apply` handle it")
    if isinstance(err.what, Action):  # a pipeline schedule's action (its REDUCE_GRAD, split backward, ...)
        return f"{err}: pipeline plans are not yet handled by {err.interpreter} (`planc check` and `planc explain` are)"
    return f"{where}{err}"


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
    except UnknownKind as err:  # a kind this command's interpreter does not handle yet: not a crash
        print(f"planc: error: {_unhandled(err)}", file=sys.stderr)
        return EXIT_ERRORS
    except Exception as err:  # never show a traceback to a user; say it is planc's fault
        print(f"planc: internal error: {type(err).__name__}: {err}\n"
              "this is a bug in planc; please report it with the plan and command", file=sys.stderr)
        if os.environ.get("PLANC_DEBUG"):
            raise
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
