"""Golden diagnostics, rustc UI style: each tests/ui/<name>.plan beside its .stderr.

`<name>.stderr` holds exactly what `planc check` prints for the plan (colour off) followed by
a last line `exit: N`. A plan picks its model with its own `model` line and may set the world
size with a first-line comment `# world-size: 8` (`# world-size: 8, simulate` adds `--simulate`,
`# world-size: 2, routing FILE` adds `--routing FILE`: routing histograms live in tests/ui/routing/).
When a change in output is intended, run

    PLANC_UPDATE_GOLDENS=1 pytest tests/test_ui.py

and review the diff. Every code in `planc.diagnostics.CODES` must appear in some golden.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re

import pytest

from planc import cli
from planc.diagnostics import CODES

ROOT = pathlib.Path(__file__).resolve().parent.parent
UI = ROOT / "tests" / "ui"
CASES = sorted(UI.glob("*.plan"))
from goldens import check_golden  # noqa: E402

WORLD = re.compile(r"#\s*world-size:\s*([0-9 ]+)")

# Codes `planc check` cannot produce: P6xx are raised by `planc.apply` on a live model in a
# process group, P7xx by `planc import` on accelerate configs, P457-P459 by `planc import
# --hf-tp-plan` (tests/test_import_hf_tp.py), P95x and P96x by `planc suggest` (tests/test_suggest.py,
# tests/test_suggest_ep.py, goldens in tests/golden/suggest/); each is covered by that command's own tests.
# P442 / P443 (a style torch refuses, parameters on different meshes in the simulated step)
# are reported by `planc check --simulate` only when the static checks let the plan through,
# and every case of them known is caught first by P420 / P418; tests/test_shapecheck.py
# reaches them with `check_step(..., after_static=True)`. P425 / P426 come from `planc check
# --verify` (real processes, tens of seconds a plan): tests/test_verify.py reaches both.
# P408 (a mesh axis planc does not build) has no plan since every role is built (the expert
# axis last); tests/test_mesh_roles.py reaches it with a row flipped back to unbuilt.
# Every other code needs a golden here.
OTHER_COMMANDS = ("P6", "P7", "P457", "P458", "P459", "P442", "P443", "P95", "P96", "P425", "P426", "P408")


def reachable_from_check(code: str) -> bool:
    return not code.startswith(OTHER_COMMANDS)


def check_args(plan: pathlib.Path) -> list[str]:
    """The `planc check` arguments for a case: its path relative to the repo root, world size."""
    args = ["check", plan.relative_to(ROOT).as_posix()]
    first = plan.read_bytes().split(b"\n", 1)[0].decode("utf-8", "replace")
    m = WORLD.match(first)
    if m:
        args += ["--world-size", *m.group(1).split()]
        if re.search(r"\bsimulate\b", first[m.end():]):  # `# world-size: 4, simulate`: planc check --simulate
            args.append("--simulate")
        routing = re.search(r"\brouting\s+(\S+)", first[m.end():])  # `# world-size: 2, routing FILE`: --routing FILE
        if routing:
            args += ["--routing", routing.group(1)]
    return args


def run_check(args: list[str]) -> tuple[str, int]:
    """Run the CLI in-process from the repo root; returns stdout+stderr and the exit code."""
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = cli.main(args)
    finally:
        os.chdir(cwd)
    return out.getvalue(), code


def render_case(plan: pathlib.Path) -> str:
    text, code = run_check(check_args(plan))
    return text + f"exit: {code}\n"


@pytest.mark.parametrize("plan", CASES, ids=[p.stem for p in CASES])
def test_golden(plan: pathlib.Path, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    actual = render_case(plan)
    check_golden(plan.with_suffix(".stderr"), actual)


# Cases that cannot be a .plan file beside a golden: the plan file itself is missing or is
# not a file. (Each still renders through the same CLI path.)
MISSING = [
    ("tests/ui/includes/does_not_exist.plan", "no such plan file `tests/ui/includes/does_not_exist.plan`"),
    ("tests/ui/includes", "`tests/ui/includes` is a directory, not a plan file"),
]


@pytest.mark.parametrize("path,message", MISSING, ids=["missing", "directory"])
def test_unreadable_plan_is_p002_exit_2(path, message):
    text, code = run_check(["check", path])
    assert code == cli.EXIT_USAGE
    assert f"error[P002]: {message}" in text
    assert "Traceback" not in text


def golden_codes() -> set[str]:
    found: set[str] = set()
    for golden in UI.glob("*.stderr"):
        found.update(re.findall(r"^(?:error|warning|note)\[(P\d{3})\]", golden.read_text(encoding="utf-8"), re.M))
    return found


def test_every_code_has_a_golden():
    covered = golden_codes() | {"P002"}  # P002 also has the cases in MISSING above
    missing = sorted(c for c in set(CODES) - covered if reachable_from_check(c))
    assert not missing, f"codes without a golden case in tests/ui: {missing}"


def test_goldens_have_plans():
    orphans = [g.name for g in UI.glob("*.stderr") if not g.with_suffix(".plan").exists()]
    assert not orphans, f"goldens without a plan: {orphans}"
