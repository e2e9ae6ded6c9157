"""Syntax errors as P001 diagnostics in the user's terms, with the fix for common habits.

Lark says "unexpected token, expected one of {LBRACE, _NL, ...}". Here that becomes what
was expected in plan spelling (`'{'`, "end of line"), ranked by what the user probably
meant (a statement keyword close to the word written comes first; a statement position
lists every statement keyword, never cut off), plus a `help:` line for habits carried over
from Python, YAML, C and FSDP1 (`torch.bfloat16`, `Shard(dim=1)`, `layers.-1`, `key: value`,
`//`, `unit optional`, `3G`, `1e8`, `auto_wrap_policy`). A character that only looks like
ASCII (Cyrillic `р`, U+2212 minus, a no-break space) is named by code point.
"""

from __future__ import annotations

import difflib
import re
import unicodedata

import lark

from planc.diagnostics import Diagnostic, Span
from planc.lang import vocabulary as vocab

# Friendly names for terminals in "expected ..." messages.
TERMINAL_NAMES = {
    "NAME": "a name", "PATTERN": "a module path", "INT": "an integer", "FLOAT": "a number",
    "QUANTITY": "a size such as `100M` or `8GiB`", "STRING": "a quoted string",
    "MODEL_REF": "a model reference such as `package.module:builder`", "REGEX": 'a regex `re"..."`',
    "CMP": "a comparison (`==`, `<=`, ...)", "_NL": "end of line", "$END": "end of file",
    "STAR": "`*`", "SHAPE": "an input shape such as `2x512` (batch x sequence)",
}

# What a user most likely meant to write, first to last, when several things fit.
_RANK = ["{", "end of line", "=", ":", "except", "where", "at", ",", ")", "]", "}", "`;`", "(", "[",
         ".", "|", "`*`", "a name", "a module path", "an integer", "a number",
         "a size such as `100M` or `8GiB`", "a quoted string", "end of file"]
MAX_EXPECTED = 8

# Look-alike characters: what each is easily taken for.
LOOKALIKES = {
    "\u0430": "a", "\u0435": "e", "\u043e": "o", "\u0440": "p", "\u0441": "c", "\u0443": "y",
    "\u0445": "x", "\u0410": "A", "\u0412": "B", "\u0415": "E", "\u041a": "K", "\u041c": "M",
    "\u041d": "H", "\u041e": "O", "\u0420": "P", "\u0421": "C", "\u0422": "T", "\u0425": "X",
    "\u03bf": "o", "\u039f": "O", "\u0391": "A", "\u0392": "B",
    "\u2212": "-", "\u2010": "-", "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2014": "-",
    "\u00a0": " ", "\u2007": " ", "\u202f": " ", "\u2009": " ", "\u200b": "", "\ufeff": "", "\u3000": " ",
    "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u2018": "'", "\u2019": "'",
    "\uff1d": "=", "\u2217": "*", "\uff0a": "*", "\u00d7": "x", "\uff1a": ":", "\uff0c": ",",
}

_DTYPE_FIX = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
_FSDP1_FIX = {
    "auto_wrap_policy": "FSDP1's wrap policy is written as unit rules: `unit layers.*`, "
                        "`unit **: DecoderLayer`, or `unit ** where size >= 100M`",
    "transformer_auto_wrap_policy": "write `unit **: DecoderLayer` (one unit per module of that class)",
    "size_based_auto_wrap_policy": "write `unit ** where size >= 100M`",
    "backward_prefetch": "prefetching is a block option: `defaults { prefetch backward = 1 }`",
    "forward_prefetch": "prefetching is a block option: `defaults { prefetch forward = 1 }`",
    "activation_checkpointing": "write `checkpoint SELECTOR` (e.g. `checkpoint layers.*`)",
    "limit_all_gathers": "FSDP2 has no such setting (it does not need one): remove the line",
    "use_orig_params": "FSDP2 always uses the original parameters: remove the line",
    "sync_module_states": "not part of a plan (broadcast the weights in the script): remove the line",
    "device_id": "not part of a plan (the script picks the device): remove the line",
    "ignored_modules": "write `ignore SELECTOR` for parameters FSDP leaves alone",
}


def describe_char(ch: str) -> str:
    """`U+0440 CYRILLIC SMALL LETTER ER` for one character."""
    return f"U+{ord(ch):04X} {unicodedata.name(ch, 'UNNAMED CHARACTER')}"


def _shown(ch: str) -> str:
    if ch.isascii() and ch.isprintable():
        return f"`{ch}`"
    return describe_char(ch)


def _expected_names(expected, parser: lark.Lark) -> list[str]:
    names = set()
    for term in expected:
        if term in TERMINAL_NAMES:
            names.add(TERMINAL_NAMES[term])
            continue
        try:
            pattern = parser.get_terminal(term).pattern
        except KeyError:
            names.add(term.lower())
            continue
        names.add(f"`{pattern.value}`" if isinstance(pattern, lark.lexer.PatternStr) else term.lower())
    return list(names)


def describe_expected(expected, parser: lark.Lark, meant: str = "") -> str:
    """What fits here, likeliest first: statement keywords (all of them) or a short ranked list.

    `meant` is the word the user wrote, to put the keyword closest to it first.
    """
    names = _expected_names(expected, parser)
    keywords = [w for w in vocab.STATEMENT_ORDER if f"`{w}`" in names]
    if len(keywords) >= 5:  # a statement starts here
        close = difflib.get_close_matches(meant, keywords, n=len(keywords), cutoff=0.6) if meant else []
        ordered = close + [w for w in keywords if w not in close]
        return "a statement: " + ", ".join(f"`{w}`" for w in ordered)

    def rank(name: str) -> tuple:
        bare = name.strip("`")
        if meant and difflib.get_close_matches(meant, [bare], n=1, cutoff=0.75):
            return (0, 0, name)
        key = name if name in _RANK else bare
        return (1, _RANK.index(key), name) if key in _RANK else (2, 0, name)
    names.sort(key=rank)
    if len(names) > MAX_EXPECTED:
        names = names[:MAX_EXPECTED] + [f"or {len(names) - MAX_EXPECTED} more"]
    return ", ".join(names)


# ===================================================================== habits


def _line(work: str, line: int) -> str:
    rows = work.split("\n")
    return rows[line - 1] if 1 <= line <= len(rows) else ""


def habit_help(row: str, col: int, tok_text: str, tok_type: str) -> str | None:
    """A `help:` line for a mistake carried over from another language, or None.

    `row` is the line, `col` the 1-based column of the unexpected token or character.
    """
    before, at = row[:col - 1], row[col - 1:]
    word_before = re.search(r"([A-Za-z_][\w]*)\s*$", before)
    prev = word_before.group(1) if word_before else ""
    head = row.split("#", 1)[0].split()
    if at.startswith("//") or at.startswith("/*"):
        return "comments start with `#` (not `//` or `/*`): `# like this`"
    ranged = re.search(r"([\w*]+)\.?\[\s*(\d+)\s*\.\.\s*(\d+)\s*\]", row)
    if ranged and ranged.start() < col <= ranged.end():  # `layers.[0..3]`: a range, inclusive
        name, first, last = ranged.group(1), int(ranged.group(2)), int(ranged.group(3))
        return f"a range of children is a slice, the end excluded: `{name}[{first}:{last + 1}]`"
    if re.match(r"-\d", at) and before.endswith("."):
        seg = re.search(r"([\w*]+)\.$", before)
        name = seg.group(1) if seg else "layers"
        return f"index from the end in brackets: `{name}[{at[:len(re.match(r'-[0-9]+', at).group(0))]}]` " \
               "(a dotted segment is a child's name)"
    m = re.search(r"\btorch\.(\w+)", row)
    if m and (prev == "torch" or "torch." in before + at[:1]):
        fix = _DTYPE_FIX.get(m.group(1))
        if fix:
            return f"dtypes are plan words: write `{fix}` for `torch.{m.group(1)}`"
        return "write the plan's word for it, not a Python expression (dtypes are `fp32`, `bf16`, `fp16`)"
    call = re.search(r"([A-Za-z_]\w*)\(([^()]*)$", before)
    if tok_text == "=" and call:
        args = re.sub(r"[A-Za-z_]\w*\s*=\s*", "", call.group(2) + at.split(")", 1)[0])
        if head and head[0] == "parallel":  # a style's layouts are plan words; `place` takes torch's `Shard(N)`
            name = vocab.TORCH_LAYOUTS.get(call.group(1), call.group(1))
            return f"layout arguments are positional, and layouts are plan words: write `{name}({args.strip()})`"
        return f"placement arguments are positional: write `{call.group(1)}({args.strip()})`"
    option = re.search(r"(?:[{;]|^[ \t]+)\s*([A-Za-z_]\w*)\s*$", before)
    if tok_text == "=" and option:  # `{ microbatches = 8 }`: an option takes its value without `=`
        value = re.match(r"=\s*([^,;}#]*)", at)
        shown = value.group(1).strip() if value and value.group(1).strip() else "VALUE"
        return f"an option takes its value without `=` (its keys take one: `reshard after_forward = false`): " \
               f"write `{option.group(1)} {shown}`"
    if tok_text == "(" and prev in vocab.TORCH_STYLES.values():
        word = next(k for k, v in vocab.TORCH_STYLES.items() if v == prev)
        return f"styles are plan words: write `{word}` for torch's `{prev}`, with its arguments in a block " \
               f"(`{word} {{ input replicate }}`)"
    if before.strip() == "" and tok_text in vocab.SIZE_WORDS:
        axis, given = vocab.SIZE_WORDS[tok_text], re.match(r"\w+\s*[=:]\s*(\d+)", at)
        n = given.group(1) if given else "N"
        return f"sizes are mesh axes: write `mesh (shard = *, {axis} = {n})`" if axis != "shard" else \
            f"sizes are mesh axes: write `mesh (shard = {n})` (or `shard = *` for every rank left)"
    if tok_text == ":" and prev:
        return f"`{prev}: value` is YAML; plan options are `name value` or `name key = value` " \
               "(e.g. `reshard after_forward = false`), with `=` in `mesh (shard = 8)`"
    if len(head) >= 2 and head[0] in vocab.OPTIONAL_STATEMENTS and head[1] == "optional":
        rest = " ".join(head[2:])
        return f"`optional` comes first: `optional {head[0]} {rest}`" if rest else \
            f"`optional` comes first: `optional {head[0]} ...`"
    digits = re.search(r"(\d+(?:\.\d+)?)$", before)
    suffix = re.match(r"[A-Za-z]\w*", at)
    if digits and suffix and _SUFFIX.fullmatch(suffix.group(0)):
        number, suffix = digits.group(1), suffix.group(0)
        exp = re.fullmatch(r"[eE](\d+)", suffix)
        if exp:
            value = float(number) * 10 ** min(int(exp.group(1)), 30)
            return f"no exponent notation: write `{_quantity(value)}` (or the digits)"
        return "sizes take the units K, M, B, T (counts) or KB, MB, GB, TB, KiB, MiB, GiB, TiB (bytes): " \
               f"`{number}{_UNIT_FIX.get(suffix.upper(), 'GiB')}`"
    if tok_type == "STRING":
        inner = tok_text[1:-1]
        if inner.lower() in vocab.BOOLS or re.fullmatch(r"-?\d+(\.\d+)?", inner) or inner.isidentifier():
            return f"write it without quotes: `{inner}`"
    if tok_text in ("True", "False", "None"):
        return f"plan words are lower case: `{tok_text.lower()}`"
    if before.strip() == "" and tok_text in _FSDP1_FIX:
        return _FSDP1_FIX[tok_text]
    if before.strip() == "" and tok_text in vocab.OPTIONS:
        return f"`{tok_text}` is a block option, not a statement: `defaults {{ {tok_text} ... }}` " \
               f"or `unit SELECTOR {{ {tok_text} ... }}`"
    if before.strip() == "" and tok_type in ("NAME", "PATTERN"):
        close = difflib.get_close_matches(tok_text, vocab.STATEMENT_ORDER, n=1, cutoff=0.6)
        if close:
            return f"did you mean `{close[0]}`?"
    return None


_SUFFIX = re.compile(r"(?i)[kmgtb]|[kmgt]i|[kmgt]ib?|[kmgt]b|e\d+")
_UNIT_FIX = {"G": "GiB", "GI": "GiB", "MI": "MiB", "KI": "KiB", "TI": "TiB", "GIB": "GiB", "MIB": "MiB"}


def _quantity(value: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            n = value / scale
            return f"{int(n) if n.is_integer() else round(n, 3)}{unit}"
    return str(int(value)) if float(value).is_integer() else str(value)


# ===================================================================== the diagnostic


def syntax_diagnostic(err: lark.exceptions.UnexpectedInput, file: str, text: str, work: str,
                      parser: lark.Lark) -> Diagnostic:
    """One P001 for a lark error; `text` is the file as written, `work` what was parsed."""
    if isinstance(err, lark.exceptions.UnexpectedToken) and err.token.type == "$END":
        # lines as lark counts them: only "\n" ends one (not \u2028, \f, ... as splitlines has it)
        lines = (text[:-1] if text.endswith("\n") else text).split("\n")
        line, col = len(lines), len(lines[-1]) + 1
        span = Span(file, line, col, line, col + 1)
        return Diagnostic(code="P001", severity="error", message="unexpected end of file",
                          span=span, label="the plan ends here",
                          help=(f"expected {describe_expected(err.expected, parser)}",))
    line, col = err.line, err.column
    row = _line(work, line)
    label = "here"
    if isinstance(err, lark.exceptions.UnexpectedToken):
        tok = err.token
        shown = "end of line" if tok.type == "_NL" else f"`{tok}`"
        end_col = col + 1 if tok.type == "_NL" else (tok.end_column or col + len(str(tok)))
        span = Span(file, line, col, line if tok.type == "_NL" else (tok.end_line or line), end_col)
        expected = err.expected
        message = f"unexpected {shown}"
        tok_text, tok_type = ("", "_NL") if tok.type == "_NL" else (str(tok), tok.type)
    else:  # UnexpectedCharacters
        char = work[err.pos_in_stream] if err.pos_in_stream < len(work) else "?"
        span = Span(file, line, col, line, col + 1)
        expected = err.allowed or set()
        message = f"unexpected character {_shown(char)}"
        tok_text, tok_type = char, "char"
        if char in LOOKALIKES:
            meant = LOOKALIKES[char]
            label = f"looks like `{meant}`" if meant.strip() else "looks like a space" if meant else \
                "an invisible character"
            fix = f"replace it with `{meant}`" if meant.strip() else \
                "replace it with a plain space" if meant else "delete it"
            return Diagnostic(code="P001", severity="error", message=message, span=span, label=label,
                              help=(f"{fix} ({describe_char(char)} is not part of the plan language)",))
    hint = habit_help(row, col, tok_text, tok_type)
    meant = tok_text if tok_type in ("NAME", "PATTERN") else ""
    help_ = (f"expected {describe_expected(expected, parser, meant)}",) if expected else ()
    if hint:
        help_ = (hint,) + help_
    return Diagnostic(code="P001", severity="error", message=message, span=span, label=label, help=help_)
