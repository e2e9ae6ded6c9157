"""Completion candidates at a cursor: module paths segment by segment, indices, class names,
option names and values, dtypes, statement keywords and metrics.

It reads the current line as text (a line being typed rarely parses) and the model tree of
the last analysis; the vocabulary comes from `planc.resolve.options` and `planc.checks`.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from planc.checks.validate import METRICS
from planc.lang import vocabulary as vocab
from planc.lsp.hover import values_of
from planc.model.graph import ModelGraph
from planc.quantities import show_count
from planc.resolve.options import DTYPES, FSDP1_MESH, OPTIONS
from planc.resolve.pipeline import PIPELINE_OPTIONS, SCHEDULES
from planc.resolve.step import STEP_OPTIONS

STATEMENTS = (*vocab.STATEMENTS, "optional")
# the options of a block opened on a line that starts with this statement (the others: unit options)
BLOCK_OPTIONS = {"pipeline": PIPELINE_OPTIONS, "step": STEP_OPTIONS}
OPTIONALS = vocab.OPTIONAL_STATEMENTS
MAX_INDICES = 32  # indices offered inside `name[`


@dataclass(frozen=True)
class Item:
    """One candidate: `kind` is module, index, class, option, key, value, keyword or metric."""

    label: str
    kind: str
    detail: str = ""
    insert: str | None = None  # text to insert, when it differs from the label


def complete(lines: list[str], line: int, column: int, graph: ModelGraph | None) -> list[Item]:
    """Candidates at planc position (line, column) (the cursor stands before `column`)."""
    if not 1 <= line <= len(lines):
        return []
    before = lines[line - 1][:max(column - 1, 0)]
    if "#" in before or before.count('"') % 2:
        return []  # in a comment or a string
    if _in_block(lines, line, before):
        first = before.lstrip().split(" ", 1)[0]
        return _in_option(re.split(r"[{;]", before)[-1], graph, BLOCK_OPTIONS.get(first, OPTIONS))
    head = before.lstrip()
    if re.fullmatch(r"pipeline\s+\w*", head):
        return [Item(name, "value", f"torch.distributed.pipelining's Schedule{name}") for name in SCHEDULES]
    if m := re.fullmatch(r"stage\s+\d+\s*:\s*(?:.*,\s*)?(.*)", head):
        return _selector(m.group(1), graph)
    if re.fullmatch(r"\w*", head):
        return [Item(k, "keyword") for k in STATEMENTS]
    if re.fullmatch(r"optional\s+\w*", head):
        return [Item(k, "keyword") for k in OPTIONALS]
    if m := re.fullmatch(r"expect\s+([\w.]*)", head):
        return [Item(k, "keyword") for k in ("unit", "not")] + [Item(x, "metric") for x in METRICS]
    if re.fullmatch(r"expect\s+not\s+\w*", head):
        return [Item("unit", "keyword")]
    if re.fullmatch(r"mesh\s+\w*", head):
        return ([Item("(replicate = 1, shard = *)", "value", "1-D mesh over every rank")]
                + [Item(w, "value", "FSDP1 sharding strategy") for w in sorted(FSDP1_MESH)])
    if re.fullmatch(r"model\s+\S*", head):
        return _models()
    if re.fullmatch(r"root\s+\w*", head):
        return [Item("none", "keyword", "the root is no unit"), Item("{ }", "value", "root options")]
    if re.search(r"\bexpect\s+[\w.]+\s*(==|!=|<=|>=|<|>)\s*\S+\s+\w*$", head):
        return [Item("at", "keyword")]
    if re.search(r"\bat\b.*$", head) and head.startswith("expect"):
        return [Item("world", "keyword"), Item("input", "keyword")]
    if m := re.fullmatch(r"(?:optional\s+)?(?:unit|checkpoint|compile|ignore|place)\s+(.*)"
                         r"|expect\s+(?:not\s+)?unit\s+(.*)", head):
        return _selector(m.group(1) if m.group(1) is not None else m.group(2), graph)
    return []


def _in_block(lines: list[str], line: int, before: str) -> bool:
    """True if the cursor is inside an option block `{ ... }`. Braces in comments and strings
    do not count, nor `{a,b}` alternatives in a path (a `{` right after a `.`)."""
    stack: list[bool] = []  # True: a block brace, False: alternatives
    for text in lines[:line - 1] + [before]:
        text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text).split("#")[0]
        for i, ch in enumerate(text):
            if ch == "{":
                stack.append(not (i > 0 and text[i - 1] == "."))
            elif ch == "}" and stack:
                stack.pop()
    return any(stack)


# ===================================================================== options


def _in_option(seg: str, graph: ModelGraph | None, options: dict = OPTIONS) -> list[Item]:
    if re.fullmatch(r"\s*\w*", seg):
        return [Item(name, "option", spec.summary) for name, spec in options.items()]
    m = re.fullmatch(r"\s*(\w+)\s+(.*)", seg)
    spec = options.get(m.group(1)) if m else None
    if spec is None:
        return []
    args = m.group(2)
    if "[" in args and args.rfind("[") > args.rfind("]"):  # prefetch forward = [blocks.0, bl
        return _selector(args[args.rfind("[") + 1:], graph)
    last = args.split(",")[-1]
    if "=" in last:
        param = spec.param(last.split("=")[0].strip())
        return [] if param is None else [_value(v) for v in values_of(param)]
    used = {a.split("=")[0].strip() for a in args.split(",")[:-1]}
    items = [Item(p.key, "key", f"{m.group(1)} {p.key} = ...", insert=f"{p.key} = ") for p in spec.params
             if p.key not in used]
    if spec.positional and "," not in args:
        items += [_value(v) for v in values_of(spec.param(spec.positional[0]))]
    return items


def _value(word: str) -> Item:
    if word in DTYPES:
        return Item(word, "value", "no cast" if DTYPES[word] is None else str(DTYPES[word]))
    return Item(word, "value")


# ===================================================================== selectors


def _selector(text: str, graph: ModelGraph | None) -> list[Item]:
    """Candidates inside a selector: classes after `:`/`|`, indices after `name[`, else paths."""
    if graph is None:
        return []
    if re.search(r"(?<![\[\d]):\s*[\w|\s]*$", text) and text.rfind("[") <= text.rfind("]"):
        return [Item(c, "class") for c in sorted(graph.class_names)]
    text = re.split(r"\bexcept\s+", text)[-1]
    word = _current_path(text)
    if word is None:
        return []
    segments = word.split(".")
    nodes = {""}
    for seg in segments[:-1]:
        nodes = _step(graph, nodes, seg)
    last = segments[-1]
    if (i := last.find("[")) >= 0 and "]" not in last:  # `blocks[` : indices of that child
        kids = _step(graph, nodes, last[:i])
        n = max((len(graph.children(k)) for k in kids), default=0)
        return ([Item(str(k), "index", f"child {k} of {n}") for k in range(min(n, MAX_INDICES))]
                + ([Item("-1", "index", "the last child"), Item(f"-{min(n, 2)}:", "index", "the last children")]
                   if n else []))
    return _children_items(graph, nodes)


def _current_path(text: str) -> str | None:
    """The selector path being typed at the end of `text`: after a group's `[` or `,`."""
    m = re.search(r"[\w.*{},\[\]:\-]*$", text)
    word = m.group(0) if m else ""
    depth, start = 0, 0
    for i, ch in enumerate(word):
        if ch in "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "[" and (i == 0 or word[i - 1] in ",["):
            start = i + 1  # a group opens
        elif ch == "," and depth == 0:
            start = i + 1
    word = word[start:]
    return word if ":" not in word or "[" in word else None


def _step(graph: ModelGraph, nodes: set[str], seg: str) -> set[str]:
    """The modules one written segment leads to from `nodes` (a light version of the matcher,
    good enough for a half-typed path; the real matcher is `planc.selectors`)."""
    if seg == "**":
        return {d for n in nodes for d in graph.subtree(n)}
    m = re.fullmatch(r"([^\[]*)(?:\[(-?\d*)(:?)(-?\d*)\])?", seg)
    if m is None:
        return set()
    name, a, colon, b = m.groups()
    names = name[1:-1].split(",") if name.startswith("{") and name.endswith("}") else [name]
    out: set[str] = set()
    for n in nodes:
        for child, cname in zip(graph.children(n), graph.child_names(n)):
            if any(cname == p or ("*" in p and fnmatch.fnmatchcase(cname, p)) for p in names):
                out.add(child)
    if a or colon:
        picked = set()
        for n in out:
            kids = graph.children(n)
            try:
                picked |= set(kids[int(a or 0):int(b) if b else None] if colon else [kids[int(a)]])
            except (IndexError, ValueError):
                continue
        return picked
    return out


def _children_items(graph: ModelGraph, nodes: set[str]) -> list[Item]:
    seen: dict[str, Item] = {}
    numbered = 0
    for n in sorted(nodes, key=graph.pre):
        for child, cname in zip(graph.children(n), graph.child_names(n)):
            if cname.isdigit():
                numbered = max(numbered, len(graph.children(n)))
                if int(cname) >= MAX_INDICES:
                    continue
            if cname not in seen:
                seen[cname] = Item(cname, "module", f"{graph.cls(child)}  {show_count(graph.subtree_numel[child])} params")
    items = list(seen.values())
    if items:
        items += [Item("*", "module", f"every child ({numbered} numbered)" if numbered else "every child"),
                  Item("**", "module", "any depth")]
    return items


def _models() -> list[Item]:
    """The built-in models (`planc.zoo:NAME`) and the Hugging Face configs planc ships (`hf:NAME`)."""
    from importlib import resources

    from planc import zoo
    items = [Item(f"planc.zoo:{name}", "module", (fn.__doc__ or "").strip().split("\n")[0]) for name, fn in zoo.ZOO.items()]
    configs = resources.files("planc.model").joinpath("configs")
    items += [Item(f"hf:{f.name[:-5]}", "module", "Hugging Face config shipped with planc (needs the hf extra)")
              for f in sorted(configs.iterdir(), key=lambda f: f.name) if f.name.endswith(".json")]
    return items
