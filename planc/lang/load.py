"""Read plan files and splice their includes in place, with bounds on what a plan can ask for.

Only regular files are read (a FIFO, `/dev/stdin` or a device is refused, never waited on);
a file is at most `MAX_PLAN_BYTES`; a UTF-8 byte-order mark is dropped. Includes splice the
included file's statements where the `include` stood, so an included file that two others
include (a diamond) is spliced twice, as written. That can grow exponentially (each file
including the next two, 30 deep, is 2**30 copies), so one plan's expansion is bounded:
at most `MAX_INCLUSIONS` inclusions and `MAX_EXPANDED_BYTES` of included text (P006).
"""

from __future__ import annotations

import errno
import os
import stat

from planc.diagnostics import Diagnostic, PlanError, Span, did_you_mean
from planc.lang import syntax as st
from planc.lang.parse import parse_text

MAX_PLAN_BYTES = 1 << 20
MAX_INCLUSIONS = 1000
MAX_EXPANDED_BYTES = 8 * MAX_PLAN_BYTES
BOM = "\ufeff"

_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


def _sibling_help(path: str, written: str) -> tuple[str, ...]:
    """`did you mean "base.plan"?` for a missing include with a close sibling file."""
    folder = os.path.dirname(path) or "."
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".plan")]
    except OSError:
        names = []
    best = did_you_mean(os.path.basename(path), names)
    if best:
        shown = os.path.join(os.path.dirname(written), best[0])
        return (f'did you mean `include "{shown}"`?', "includes are relative to the including plan")
    return ("check the path; includes are relative to the including plan",)


def read_plan_file(path: str, span: Span | None, written: str | None = None
                   ) -> tuple[str | None, Diagnostic | None]:
    """A plan file's text, or a P002 (P003 for an include at `span`) saying why not.

    `written` is the include's path as the plan wrote it, for the "did you mean" help.
    """
    def fail(message, help_=()):
        code = "P003" if span is not None else "P002"
        return None, Diagnostic(code=code, severity="error", message=message, span=span,
                                label="included here" if span else "", help=help_)
    try:
        # NOTE: O_NONBLOCK so that opening a FIFO returns at once; fstat then refuses it.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return fail(f"no such plan file `{path}`", _sibling_help(path, written) if span is not None
                    else ("check the path",))
    except IsADirectoryError:
        return fail(f"`{path}` is a directory, not a plan file", ("name a `.plan` file",))
    except OSError as err:
        if err.errno == errno.ENXIO:  # a socket
            return fail(f"`{path}` is a socket, not a plan file", ("name a regular `.plan` file",))
        return fail(f"cannot read `{path}`: {err.strerror or err}")
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
            if kind == "a directory":
                return fail(f"`{path}` is a directory, not a plan file", ("name a `.plan` file",))
            return fail(f"`{path}` is {kind}, not a regular file",
                        ("plans are read from regular files only; save the plan to a file",))
        if info.st_size > MAX_PLAN_BYTES:
            return fail(f"`{path}` is {info.st_size} bytes; plans are limited to {MAX_PLAN_BYTES} bytes",
                        ("split the plan into smaller files joined with `include`",))
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_PLAN_BYTES + 1)
    except OSError as err:
        return fail(f"cannot read `{path}`: {err.strerror or err}")
    finally:
        os.close(fd)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        return fail(f"`{path}` is not UTF-8 text (byte 0x{raw[err.start]:02x} at line {line}, column {column})",
                    ("save the plan as UTF-8",))
    if "\x00" in text:
        return fail(f"`{path}` is not a text file (it contains NUL bytes)", ("is this a plan file?",))
    return text.removeprefix(BOM), None


class _Expansion:
    """What one plan's includes have spliced so far, against the bounds."""

    def __init__(self) -> None:
        self.inclusions = 0
        self.bytes = 0
        self.exceeded = False
        self.parsed: dict[str, tuple[tuple, tuple, list[Diagnostic]]] = {}

    def parse(self, text: str, file: str):
        """Parse each file once, however often it is included."""
        if file not in self.parsed:
            self.parsed[file] = parse_text(text, file)
        return self.parsed[file]


def _assemble(text: str, file: str, stack: tuple[str, ...], sources: dict[str, str],
              diags: list[Diagnostic], expansion: _Expansion) -> tuple[tuple, tuple]:
    """Parse `text` and splice every include in place, depth first, detecting cycles."""
    first_time = file not in sources
    sources[file] = text
    statements, comments, errs = expansion.parse(text, file)
    if first_time:
        diags.extend(errs)
    out: list = []
    base_dir = os.path.dirname(file) if not file.startswith("<") else "."
    for stmt in statements:
        if not isinstance(stmt, st.IncludeStmt):
            out.append(stmt)
            continue
        if expansion.exceeded:
            continue
        target = os.path.normpath(os.path.join(base_dir, stmt.path))
        key = os.path.abspath(target)
        if key in stack:
            chain = " -> ".join([os.path.basename(s) for s in stack[stack.index(key):]] + [os.path.basename(key)])
            diags.append(Diagnostic(code="P004", severity="error", message=f"include cycle: {chain}",
                                    span=stmt.span, label="this include closes the cycle",
                                    help=("a base plan must not include the plans that include it",)))
            continue
        if target in sources:
            sub, err = sources[target], None
        else:
            sub, err = read_plan_file(target, stmt.span, stmt.path)
        if err is not None:
            diags.append(err)
            continue
        expansion.inclusions += 1
        expansion.bytes += len(sub)
        if expansion.inclusions > MAX_INCLUSIONS or expansion.bytes > MAX_EXPANDED_BYTES:
            expansion.exceeded = True
            what = f"{MAX_INCLUSIONS} inclusions" if expansion.inclusions > MAX_INCLUSIONS else \
                f"{MAX_EXPANDED_BYTES} bytes of included text"
            diags.append(Diagnostic(
                code="P006", severity="error", message=f"includes expand to more than {what}",
                span=stmt.span, label="the expansion passes the limit here",
                notes=("a file included from several places is spliced once per `include`, so files that "
                       "include the same files grow exponentially",),
                help=("include each base plan once, from the top plan, instead of from every plan that uses it",)))
            continue
        inner, _ = _assemble(sub, target, stack + (key,), sources, diags, expansion)
        out.extend(inner)
    return tuple(out), comments


def loads_with_diagnostics(text: str, filename: str = "<string>") -> tuple[st.Plan | None, list[Diagnostic]]:
    """Parse plan text and its includes; never raises for bad input."""
    diags: list[Diagnostic] = []
    if len(text.encode("utf-8", "surrogatepass")) > MAX_PLAN_BYTES:
        diags.append(Diagnostic(code="P002", severity="error", span=Span.point(filename),
                                message=f"plan is larger than {MAX_PLAN_BYTES} bytes",
                                help=("split the plan into smaller files joined with `include`",)))
        return None, diags
    if "\x00" in text:
        diags.append(Diagnostic(code="P002", severity="error", span=Span.point(filename),
                                message="plan is not text (it contains NUL bytes)", help=("is this a plan file?",)))
        return None, diags
    text = text.removeprefix(BOM)
    sources: dict[str, str] = {}
    root = (os.path.abspath(filename),) if not filename.startswith("<") else ()
    statements, comments = _assemble(text, filename, root, sources, diags, _Expansion())
    plan = st.Plan(file=filename, statements=statements, sources=tuple(sources.items()),
                   comments=comments)
    if not statements and not any(d.is_error for d in diags):
        diags.append(Diagnostic(
            code="P209", severity="warning", message="plan does nothing: it has no statements",
            span=Span.point(filename), label="only comments" if comments else "empty plan",
            help=("add statements such as `unit layers.*`; an empty plan shards the model as one root unit",)))
    return plan, diags


def load_with_diagnostics(path: str | os.PathLike) -> tuple[st.Plan | None, list[Diagnostic]]:
    """Read and parse a plan file; a missing or unreadable file is a P002 diagnostic."""
    path = os.fspath(path)
    text, err = read_plan_file(path, None)
    if err is not None:
        return None, [err]
    return loads_with_diagnostics(text, filename=path)


def _raise_on_errors(plan, diags) -> st.Plan:
    if plan is None or any(d.is_error for d in diags):
        sources = dict(plan.sources) if plan is not None else {}
        raise PlanError(diags, sources)
    return plan


def loads(text: str, *, filename: str = "<string>") -> st.Plan:
    """Parse plan text; raises `PlanError` with every syntax and include diagnostic."""
    return _raise_on_errors(*loads_with_diagnostics(text, filename))


def load(path: str | os.PathLike) -> st.Plan:
    """Read and parse a plan file; raises `PlanError` with every diagnostic."""
    return _raise_on_errors(*load_with_diagnostics(path))
