"""A Pygments lexer for .plan files, registered as the `plan` lexer by an entry point.

`pygmentize -l plan plans/seed.plan`, and ```` ```plan ```` blocks in Sphinx or MkDocs,
use it once planc is installed. Its word lists come from `planc/lang/vocabulary.py`. It
follows grammar/plan.lark token by token but is deliberately forgiving: highlighting must
work on half-written plans, so unknown option names are plain names (the checker, not the highlighter, reports them).
"""

from __future__ import annotations

from pygments.lexer import RegexLexer, bygroups, words
from pygments.token import Comment, Keyword, Name, Number, Operator, Punctuation, String, Text, Whitespace

__all__ = ["PlanLexer"]

from planc.lang.vocabulary import (
    BOOLS,
    CLAUSES,
    DTYPES,
    FSDP1_WORDS,
    PIPELINE_OPTIONS,
    STATEMENTS,
    STEP_OPTIONS,
    STYLE_END,
    STYLES,
)
from planc.lang.vocabulary import OPTIONS as _UNIT_OPTIONS

CONSTANTS = BOOLS
# block options that are not also statement keywords (those are highlighted as keywords)
OPTIONS = tuple(o for o in _UNIT_OPTIONS + STEP_OPTIONS + PIPELINE_OPTIONS if o not in STATEMENTS)

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"


class PlanLexer(RegexLexer):
    """Lexer for planc sharding plans (`.plan`)."""

    name = "planc plan"
    aliases = ["plan", "planc"]
    filenames = ["*.plan"]
    mimetypes = ["text/x-planc-plan"]
    url = "https://github.com/planc/planc"
    version_added = ""

    tokens = {
        "root": [
            (r"[ \t\f]+", Whitespace),
            (r"\r?\n", Whitespace),
            (r"\\\r?\n", Text),  # line continuation
            (r"#.*?$", Comment.Single),
            # `model hf:llama-tiny`, `model planc.zoo:gpt` (a string form falls to the string rule)
            (r"\b(model)([ \t]+)([A-Za-z_][\w.]*:[\w./-]+)", bygroups(Keyword.Namespace, Whitespace, Name.Namespace)),
            (r're"(\\.|[^"\\\n])*"', String.Regex),
            (r'"(\\.|[^"\\\n])*"', String.Double),
            # `pipeline 1F1B`: the schedule, torch's class name (it may start with a digit)
            (r"\b(pipeline)([ \t]+)([A-Za-z0-9_]+)", bygroups(Keyword, Whitespace, Name.Class)),
            # `stage 0:`: a pipeline stage's index (not a class guard)
            (r"\b(stage)([ \t]+)([0-9]+)([ \t]*)(:)", bygroups(Keyword, Whitespace, Number.Integer, Whitespace,
                                                           Punctuation)),
            # a statement word, unless it names a mesh axis (`mesh (pipeline = 2)`)
            (words(STATEMENTS, prefix=r"(?<![\w.*])", suffix=r"\b(?![.*])(?![ \t]*=(?!=))"), Keyword),
            (words(CLAUSES, prefix=r"(?<![\w.*])", suffix=r"\b(?![.*])"), Keyword),
            (words(CONSTANTS, prefix=r"(?<![\w.*])", suffix=r"\b(?![.*])"), Keyword.Constant),
            (words(DTYPES, prefix=r"(?<![\w.*])", suffix=r"\b(?![.*])"), Keyword.Type),
            (words(OPTIONS, prefix=r"(?<![\w.*])", suffix=r"\b(?![.*=])"), Name.Builtin),
            (words(FSDP1_WORDS, prefix=r"(?<![\w.*])", suffix=r"\b"), Name.Constant),
            # a `parallel` statement's style word, last on its line: `parallel layers.*.attention context`
            (words(STYLES, prefix=r"(?<![\w.*])", suffix=r"\b" + STYLE_END), Keyword.Pseudo),
            # class guards: `: LlamaDecoderLayer | MixtralDecoderLayer`
            (r"(:)([ \t]*)(" + _NAME + r")(?![.*\w])", bygroups(Punctuation, Whitespace, Name.Class)),
            (r"(\|)([ \t]*)(" + _NAME + r")", bygroups(Operator, Whitespace, Name.Class)),
            # placements such as `Shard(1)`
            (_NAME + r"(?=\()", Name.Function),
            # `key = value` inside blocks and meshes (not `==`)
            (r"(" + _NAME + r")([ \t]*)(=)(?!=)", bygroups(Name.Attribute, Whitespace, Operator)),
            (r"[0-9]+(\.[0-9]+)?(KiB|MiB|GiB|TiB|KB|MB|GB|TB|K|M|B|T)\b", Number),
            # an input shape, batch x sequence: `input = 8x4096`
            (r"(?<![\w.*])[0-9]+([xX][0-9]+)+\b(?![.*])", Number),
            (r"-?[0-9]+\.[0-9]+", Number.Float),
            (r"-?[0-9]+(?![A-Za-z_*])", Number.Integer),
            (r"==|!=|<=|>=|<|>|=", Operator),
            # selector segments: names, numbers and globs (`layers`, `*`, `**`, `w*`, `0`)
            (r"[A-Za-z0-9_*]+", Name.Variable),
            (r"[{}()\[\],;.:]", Punctuation),
        ],
    }
