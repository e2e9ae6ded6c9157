"""`planc fmt PLAN...`: rewrite plans in canonical form, or `--check` them (planc/lang/fmt.py)."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

from planc.cli.common import use_color
from planc.diagnostics import PlanError, render
from planc.lang.fmt import FormatError, format_plan
from planc.lang.load import read_plan_file


def _diff(path: str, old: str, new: str, limit: int = 40) -> str:
    lines = list(difflib.unified_diff(old.splitlines(), new.splitlines(), f"{path} (now)",
                                      f"{path} (formatted)", lineterm="", n=1))
    if len(lines) > limit:
        lines = lines[:limit] + [f"... ({len(lines) - limit} more diff lines)"]
    return "\n".join(lines)


def main(args) -> int:
    """`planc fmt PLAN... [--check]`: rewrite plans in place (`-`: stdin to stdout).

    Returns 0 when all is formatted (or was rewritten), 1 when `--check` finds a plan to
    reformat or a plan has syntax errors (it is left alone), 2 when a plan is unreadable.
    """
    check = getattr(args, "check", False)
    code = 0
    changed: list[str] = []
    unchanged = 0
    for path in args.plans:
        if path == "-":  # editors: plan on stdin, formatted plan on stdout
            text, err = sys.stdin.read(), None
        else:
            text, err = read_plan_file(path, None)
        if err is not None:
            print(render.render_text([err], {}, color=use_color(sys.stderr)), file=sys.stderr)
            code = max(code, 2)
            continue
        try:
            new = format_plan(text, path)
        except PlanError as perr:
            print(render.render_text(perr.diagnostics, {path: text}, color=use_color(sys.stderr)), file=sys.stderr)
            print(f"planc fmt: not formatting `{path}`: it has syntax errors", file=sys.stderr)
            code = max(code, 1)
            continue
        except FormatError as ferr:
            print(f"planc: internal error: {ferr}\nthis is a bug in planc; `{path}` was left as it was",
                  file=sys.stderr)
            code = max(code, 2)
            continue
        if path == "-" and not check:
            sys.stdout.write(new)
            continue
        if new == text:
            unchanged += 1
            continue
        changed.append(path)
        if check:
            print(f"would reformat {path}")
            print(_diff(path, text, new))
            code = max(code, 1)
        else:
            Path(path).write_text(new, encoding="utf-8")
            print(f"reformatted {path}")
    verb = "would be reformatted" if check else "reformatted"
    if any(p != "-" for p in args.plans) or check:
        print(f"{len(changed)} file{'s' * (len(changed) != 1)} {verb}, {unchanged} already formatted",
              file=sys.stderr)
    return code

