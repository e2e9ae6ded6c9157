"""The plan's words, in one torch-free place: keywords, option names, dtypes, booleans, FSDP1 words.

The Pygments lexer (`planc/lang/lexer.py`), the syntax-error help (`planc/lang/errors.py`)
and the TextMate grammar (`editors/plan.tmLanguage.json`) read their word lists from here;
`tests/test_vocabulary.py` checks these lists against `planc/resolve/options.py` (which
needs torch for the dtypes) and the keywords of `grammar/plan.lark`. A new option is named
in `OPTIONS` here and specified in `options.OPTIONS`; then regenerate the editor grammar:

    python -m planc.lang.vocabulary --tmlanguage   # rewrites editors/plan.tmLanguage.json (and VS Code's copy)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Statement keywords of the grammar, in the order the grammar lists them.
STATEMENTS = ("model", "include", "mesh", "defaults", "unit", "root", "checkpoint", "parallel", "compile",
              "ignore", "place", "step", "pipeline", "stage", "expect")
# The same with `optional`, likeliest first: the order syntax-error help lists them in.
STATEMENT_ORDER = ("unit", "checkpoint", "compile", "defaults", "root", "mesh", "model", "include",
                   "ignore", "place", "expect", "parallel", "step", "pipeline", "stage", "optional")
OPTIONAL_STATEMENTS = ("unit", "checkpoint", "parallel", "compile", "ignore", "place")
# Keywords inside statements.
CLAUSES = ("optional", "except", "where", "not", "at", "world", "input", "none", "units", "unit")
# Block option names (`options.OPTIONS`), FSDP1 spellings included.
OPTIONS = ("precision", "reshard", "offload", "prefetch", "reduction", "checkpoint", "compile", "strategy",
           "sharding_strategy", "mixed_precision", "cpu_offload")
# Options of the `step` block (`planc/resolve/step.py`).
STEP_OPTIONS = ("accumulate",)
# Options of the `pipeline` block (`planc/resolve/pipeline.py`).
PIPELINE_OPTIONS = ("microbatches", "stages_per_rank", "split")
# Dtype words (`options.DTYPES`, without `none`, which is a clause word).
DTYPES = ("fp32", "float32", "f32", "bf16", "bfloat16", "fp16", "float16", "half")
# Boolean words (`options.BOOLS`).
BOOLS = ("true", "false", "yes", "no", "on", "off")
# FSDP1 sharding strategies (`options.FSDP1_RESHARD` and `options.FSDP1_MESH`).
FSDP1_WORDS = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")

# The style words of a `parallel` statement: torch's tensor-parallel styles
# (`planc.resolve.tensor.STYLE_KINDS`), `context` (`planc.resolve.context.CONTEXT_STYLE`:
# attention gathers keys and values over the context axis) and `expert`
# (`planc.resolve.experts.EXPERT_STYLE`: whole experts per rank, tokens moved by all-to-all).
STYLES = ("colwise", "rowwise", "sequence", "replicate", "prepare_input", "prepare_output", "prepare", "context",
          "expert")
# What a style word ends at: a block, another statement, a comment or the end of the line.
STYLE_END = r"(?=[ \t]*(\{|;|#|\r?\n|$))"

# Tensor-parallel style words and torch's class for each (the syntax help turns a torch class
# name back into the plan's word); the rows of `planc/resolve/styles.py` name the same classes
# (tests/test_styles.py), which the runtime builds and `planc emit` prints.
TORCH_STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel", "sequence": "SequenceParallel",
                "prepare_input": "PrepareModuleInput", "prepare_output": "PrepareModuleOutput",
                "prepare": "PrepareModuleInputOutput"}
# torch's placements -> the plan's layout words (`shard(N)`, `replicate`, `partial`).
TORCH_LAYOUTS = {"Shard": "shard", "Replicate": "replicate", "Partial": "partial"}
# Sizes other tools set in a config, which a plan writes as mesh axes.
SIZE_WORDS = {"tp_size": "tensor", "tensor_parallel_size": "tensor", "tp_degree": "tensor", "tp": "tensor",
              "tensor_parallel_degree": "tensor", "dp_size": "shard", "dp_shard": "shard",
              "data_parallel_shard_degree": "shard", "dp_replicate": "replicate",
              "data_parallel_replicate_degree": "replicate"}

TMLANGUAGE = "plan.tmLanguage.json"


def _alternation(words) -> str:
    return "|".join(words)


def tmlanguage(template: dict) -> dict:
    """The TextMate grammar `template` with its word lists set from this module."""
    repo = template["repository"]
    keyword, clause = repo["keyword"]["patterns"]
    keyword["match"] = rf"(?<![\w.*])\b({_alternation(STATEMENTS)})\b(?![.*])(?![ \t]*=(?!=))"
    clause["match"] = rf"(?<![\w.*])\b({_alternation(c for c in CLAUSES if c != 'unit')})\b(?![.*])"
    boolean, dtype, fsdp1 = repo["constant"]["patterns"]
    boolean["match"] = rf"(?<![\w.*])\b({_alternation(BOOLS)})\b(?![.*])"
    dtype["match"] = rf"(?<![\w.*])\b({_alternation(DTYPES)})\b(?![.*])"
    fsdp1["match"] = rf"\b({_alternation(FSDP1_WORDS)})\b"
    options = [o for o in OPTIONS + STEP_OPTIONS + PIPELINE_OPTIONS if o not in STATEMENTS]
    repo["option"]["match"] = rf"(?<![\w.*])\b({_alternation(options)})\b(?![.*=])"
    repo["style"]["match"] = rf"(?<![\w.*])\b({_alternation(STYLES)})\b{STYLE_END}"
    return template


def tmlanguage_text(template_text: str) -> str:
    """The checked-in grammar's text, word lists regenerated (same layout: 2-space JSON)."""
    return json.dumps(tmlanguage(json.loads(template_text)), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m planc.lang.vocabulary --tmlanguage [PATH]`: regenerate the editor grammar in place.

    With `--check`, write nothing and exit 1 if the file is stale.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    args = [a for a in args if a != "--check"]
    if not args or args[0] != "--tmlanguage":
        print("usage: python -m planc.lang.vocabulary --tmlanguage [--check] [PATH]", file=sys.stderr)
        return 2
    editors = Path(__file__).resolve().parents[2] / "editors"
    # the VS Code extension ships its own copy (an extension cannot reach outside its folder)
    paths = [Path(args[1])] if len(args) > 1 else [editors / TMLANGUAGE, editors / "vscode" / "syntaxes" / TMLANGUAGE]
    template = paths[0].read_text(encoding="utf-8")
    fresh = tmlanguage_text(template)
    stale = [p for p in paths if not p.exists() or p.read_text(encoding="utf-8") != fresh]
    if check:
        for p in stale:
            print(f"{p}: stale; run python -m planc.lang.vocabulary --tmlanguage", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
