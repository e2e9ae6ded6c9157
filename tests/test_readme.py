"""The README shows real sessions: replay them and compare, so the front page stays true.

Each fenced block that starts with `$ ` is a terminal session: a `$ cat FILE` line shows a
file (written here into a scratch folder that also holds `plans/`), a `$ planc ...` line is
run in-process with stdout and stderr captured together, and `$ echo $?` shows the previous
exit status. Sessions with other commands (`torchrun`: timings differ from run to run; it is
exercised by test_apply_dist.py's example test) are left out. The opening plan must check
clean and be formatted as `planc fmt` writes it.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import shlex
import shutil

import pytest

from planc import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```[a-z]*\n(.*?)^```", README, flags=re.S | re.M)


def sessions() -> list[str]:
    return [b for b in BLOCKS if b.startswith("$ ") and "$ torchrun" not in b]


def steps(block: str) -> list[tuple[str, str]]:
    """(command, the output shown under it) for each `$ ` line of a session."""
    out: list[tuple[str, str]] = []
    for line in block.splitlines(keepends=True):
        if line.startswith("$ "):
            out.append((line[2:].strip(), ""))
        else:
            out[-1] = (out[-1][0], out[-1][1] + line)
    return out


def run_planc(argv: list[str]) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = cli.main(argv)
    return code, buf.getvalue()


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    shutil.copytree(ROOT / "plans", tmp_path / "plans")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NO_COLOR", "1")
    return tmp_path


def test_readme_has_sessions():
    assert len(sessions()) >= 2


@pytest.mark.parametrize("block", sessions(), ids=lambda b: b.splitlines()[0][2:40])
def test_session_output_is_what_planc_prints(scratch, block):
    status = None
    for command, shown in steps(block):
        words = shlex.split(command)
        if words[0] == "cat":
            (scratch / words[1]).write_text(shown.rstrip("\n") + "\n")
        elif words[0] == "planc":
            status, printed = run_planc(words[1:])
            assert printed.rstrip("\n") == shown.rstrip("\n"), command
        elif words == ["echo", "$?"]:
            assert str(status) == shown.strip()
        else:
            pytest.fail(f"the README runs `{command}`; teach this test to replay it")


def test_opening_plan_checks_clean_and_is_formatted(scratch):
    plan = next(b for b in BLOCKS if b.startswith("model "))
    (scratch / "opening.plan").write_text(plan)
    assert run_planc(["check", "opening.plan", "--world-size", "64"]) == (0, "opening.plan: ok (27 units)\n")
    assert run_planc(["fmt", "--check", "opening.plan"])[0] == 0


def test_first_commands_explain_with_an_input_shape():
    """A newcomer's first `planc explain` must print a step time that includes compute: without
    `--input-shape` it is communication alone ("compute 0.0 us (0 FLOP)")."""
    install = next(b for b in BLOCKS if b.startswith("python -m pip install"))
    explains = [c for c in install.split("&&") if c.strip().startswith("planc explain")]
    assert explains and all("--input-shape" in c for c in explains), explains
