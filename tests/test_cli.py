"""The `planc` command line: exit codes, the JSON and GitHub renderers, `tree`, `codes`.

Runs `planc.cli.main([...])` in-process (cheap), plus one real subprocess of the installed
console script to prove the entry point and the exit status reach the shell.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest

from planc import cli
from planc.diagnostics import CODES

ROOT = pathlib.Path(__file__).resolve().parent.parent
UI = "tests/ui"
JSON_KEYS = {"code", "severity", "message", "file", "line", "column", "end_line", "end_column", "help"}


def run(*args: str) -> tuple[int, str, str]:
    """`planc ARGS` in-process from the repo root: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(list(args))
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue()


# ===================================================================== exit codes


def test_clean_plan_exits_0():
    code, out, _ = run("check", f"{UI}/ok_clean.plan", "--world-size", "8", "64")
    assert code == cli.EXIT_OK
    assert out.strip() == f"{UI}/ok_clean.plan: ok (3 units)"


def test_warnings_alone_exit_0():
    code, out, _ = run("check", f"{UI}/p207_no_effect.plan")
    assert code == cli.EXIT_OK
    assert "warning[P207]" in out and "0 errors, 2 warnings" in out


def test_errors_exit_1():
    code, out, _ = run("check", f"{UI}/p201_no_match.plan")
    assert code == cli.EXIT_ERRORS
    assert out.count("error[P201]") == 4


def test_missing_file_exits_2():
    code, out, _ = run("check", "no/such.plan")
    assert code == cli.EXIT_USAGE
    assert "error[P002]: no such plan file `no/such.plan`" in out


def test_bad_model_flag_is_usage_error():
    code, out, err = run("check", "plans/seed.plan", "--model", "planc.zoo:nope")
    assert code == cli.EXIT_USAGE
    assert err.startswith("planc: error: --model planc.zoo:nope:") and "Traceback" not in err


def test_model_flag_overrides_model_line(tmp_path):
    plan = tmp_path / "layers.plan"
    plan.write_text("model planc.zoo:seed_transformer\nunit transformer_layers.*\nexpect units == 3\n")
    # the 2-layer tiny model has the same module names: 2 layers + root
    code, out, _ = run("check", str(plan), "--model", "planc.zoo:seed_transformer_tiny")
    assert (code, out.strip()) == (cli.EXIT_OK, f"{plan}: ok (3 units)")
    code, out, _ = run("check", str(plan), "--model", "planc.zoo:moe_transformer_tiny")
    assert code == cli.EXIT_ERRORS and "error[P201]: selector `transformer_layers.*` matches no module" in out


def test_several_plans_worst_exit_wins():
    code, out, _ = run("check", f"{UI}/ok_clean.plan", f"{UI}/p204_container.plan", "--world-size", "8")
    assert code == cli.EXIT_ERRORS
    assert "error[P204]" in out
    code, out, _ = run("check", f"{UI}/ok_clean.plan", "missing.plan", "--world-size", "8")
    assert code == cli.EXIT_USAGE


def test_usage_error_from_argparse_exits_2():
    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(io.StringIO()):
        cli.main(["check"])
    assert exc.value.code == 2


def test_world_sizes_are_deduplicated():
    # The same P401 would be found once per world size; each distinct finding is shown once.
    code, out, _ = run("check", f"{UI}/p401_mesh_world.plan", "--world-size", "8", "8")
    assert out.count("error[P401]") == 1
    code, out, _ = run("check", f"{UI}/p401_mesh_world.plan", "--world-size", "6", "8")
    assert out.count("error[P401]") == 1 and "the world size is 8" in out


# ===================================================================== JSON


def test_json_renderer():
    code, out, _ = run("check", f"{UI}/p201_no_match.plan", "--format", "json")
    assert code == cli.EXIT_ERRORS
    doc = json.loads(out)
    diags = doc["diagnostics"]
    assert len(diags) == 4
    for d in diags:
        assert JSON_KEYS <= set(d)
        assert d["code"] in CODES and d["severity"] == "error"
        assert d["file"] == f"{UI}/p201_no_match.plan"
    first = diags[0]
    assert (first["line"], first["column"], first["end_line"], first["end_column"]) == (2, 6, 2, 11)
    assert first["message"] == "selector `block.*` matches no module"
    assert "did you mean `blocks`?" in first["help"]
    assert doc["plans"] == [{"file": f"{UI}/p201_no_match.plan", "units": 1, "errors": 4}]


def test_json_clean_plan_has_no_diagnostics():
    code, out, _ = run("check", "plans/seed.plan", "--format", "json")
    assert code == cli.EXIT_OK
    doc = json.loads(out)
    assert doc["diagnostics"] == [] and doc["plans"][0]["units"] == 27


def test_json_without_span():
    code, out, _ = run("check", "nope.plan", "--format", "json")
    (d,) = json.loads(out)["diagnostics"]
    assert d["code"] == "P002" and d["file"] is None and d["line"] is None


# ===================================================================== GitHub annotations


def test_github_renderer():
    code, out, _ = run("check", f"{UI}/p207_no_effect.plan", f"{UI}/p302_unowned.plan", "--format", "github")
    lines = out.strip().splitlines()
    assert code == cli.EXIT_ERRORS
    assert len(lines) == 3
    pat = re.compile(r"^::(error|warning|notice) file=([^,]+),line=(\d+),col=(\d+),endLine=\d+,endColumn=\d+,"
                     r"title=[^:]+::\[(P\d{3})\] (.*)$")
    parsed = [pat.match(line) for line in lines]
    assert all(parsed), lines
    kinds = [(m.group(1), m.group(2), m.group(3), m.group(4), m.group(5)) for m in parsed]
    assert kinds[0] == ("warning", f"{UI}/p207_no_effect.plan", "2", "1", "P207")
    assert kinds[2] == ("error", f"{UI}/p302_unowned.plan", "2", "1", "P302")
    # multi-line bodies are escaped, never broken across lines
    assert "%0Ahelp: remove `root none`" in lines[2]


def test_github_note_is_notice():
    _, out, _ = run("check", f"{UI}/p901_fsdp1.plan", "--format", "github", "--world-size", "8")
    assert out.startswith("::notice file=tests/ui/p901_fsdp1.plan,line=3,col=6,")


# ===================================================================== tree and codes


def test_tree_shows_tied_and_folds_layers():
    code, out, _ = run("tree", "--model", "planc.zoo:gpt_tiny")
    assert code == cli.EXIT_OK
    lines = out.splitlines()
    assert lines[0].startswith("<root>  GPT  ")
    assert any(re.search(r"0\.\.1  GPTBlock  .* each", line) for line in lines)
    assert any("lm_head  Linear" in line for line in lines)
    # the tied embedding and head name each other (the test's name promised this; now it is checked)
    tied = [line for line in lines if "tied to" in line]
    assert len(tied) == 2 and any("lm_head.weight" in line for line in tied), tied


def test_tree_from_plan_and_depth():
    code, out, _ = run("tree", "--plan", f"{UI}/p303_scalar.plan", "--depth", "1")
    assert code == cli.EXIT_OK
    assert out.splitlines() == ["<root>  ScalarNet  218 params", "├── blocks  ModuleList  146",
                                "└── head  Linear  72  [weight, bias]"]


def test_tree_needs_a_model():
    code, _, err = run("tree")
    assert code == cli.EXIT_USAGE and "tree needs --model" in err


def test_codes_lists_every_code():
    code, out, _ = run("codes")
    assert code == cli.EXIT_OK
    assert [line.split()[0] for line in out.splitlines()] == list(CODES)


def test_codes_explains_one():
    code, out, _ = run("codes", "p301")
    assert code == cli.EXIT_OK
    assert out.startswith("P301 (error): tied parameters split across units")
    code, _, err = run("codes", "P999")
    assert code == cli.EXIT_USAGE and "no diagnostic code P999" in err


# ===================================================================== the real console script


def test_console_script_subprocess():
    exe = shutil.which("planc") or pytest.skip("the `planc` console script is not on PATH")
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.run([exe, "check", f"{UI}/p204_container.plan", "--format", "github"], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith("::error file=tests/ui/p204_container.plan,line=2,col=1,")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("world", ["0", "-2", "eight"])
def test_world_size_must_be_a_positive_number(world):
    err = io.StringIO()
    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(err):
        cli.main(["check", f"{UI}/ok_clean.plan", "--world-size", world])
    assert exc.value.code == 2 and "--world-size" in err.getvalue()


def test_tree_with_a_broken_plan_shows_why():
    code, _, err = run("tree", "--plan", f"{UI}/p001_syntax.plan")
    assert code == cli.EXIT_USAGE
    assert "error[P001]: unexpected `unt`" in err and "cannot read the `model` line" in err


def test_carets_line_up_under_tabs_and_long_lines():
    from planc.diagnostics.render import render_text
    from planc.lang.parse import loads_with_diagnostics
    for text, col in [("\tunit [a,\tb\n", 12), ("unit " + "a." * 300 + "b @\n", 608)]:
        plan, diags = loads_with_diagnostics(text, "x.plan")
        shown = render_text(diags[:1], dict(plan.sources)).splitlines()
        code_line, caret_line = shown[3], shown[4]
        assert f"x.plan:1:{col}" in shown[1]
        caret = caret_line.index("^")
        if text.startswith("\t"):  # end of line: one past the last (tab-expanded) character
            assert caret == len(code_line) and code_line.endswith("    b")
        else:  # a window of the long line, the caret under the offending `@`
            assert code_line.startswith("1 | ... ") and code_line[caret] == "@"
