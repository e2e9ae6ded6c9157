"""The pre-commit hooks, installed in a scratch git repository, stop bad plans at commit time.

The scratch repository's `.pre-commit-config.yaml` points at this repository at HEAD, as a
user's would point at a release tag; `pre-commit install` puts the git hook in place and
`git commit` runs it, with the `-system` hooks (the planc already installed). The
`language: python` hooks are run too: pre-commit builds its own virtualenv, installs planc
into it with torch pinned through `additional_dependencies` (as docs/ci.md recommends), and
runs the hooks from there. That costs about a minute and 1 GB of disk, removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("pre_commit")
yaml = pytest.importorskip("yaml")

GOOD = "model planc.zoo:seed_transformer_tiny\n\nunit transformer_layers.*\n"
BAD = "model planc.zoo:seed_transformer_tiny\n\nunit transformer_layer.*\n"
UGLY = "model planc.zoo:seed_transformer_tiny\n\nunit   transformer_layers.*\n"


def _git(cwd, *args, check=True, env=None):
    return subprocess.run(["git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def head(root):
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("needs git and a git checkout of planc")
    committed = _git(root, "ls-files", "--error-unmatch", ".pre-commit-hooks.yaml", check=False)
    if committed.returncode != 0:
        pytest.skip(".pre-commit-hooks.yaml is not committed yet")
    return _git(root, "rev-parse", "HEAD").stdout.strip()


def test_manifest_is_valid_for_pre_commit(root):
    from pre_commit.clientlib import load_manifest
    hooks = {h["id"]: h for h in load_manifest(str(root / ".pre-commit-hooks.yaml"))}
    assert set(hooks) == {"planc-check", "planc-fmt", "planc-check-system", "planc-fmt-system"}
    for name in ("planc-check", "planc-fmt"):
        python, system = hooks[name], hooks[f"{name}-system"]
        # pre-commit >= 4.4 reads `system` as its new name `unsupported`; older ones as `system`
        assert python["language"] == "python" and system["language"] in ("system", "unsupported")
        assert (python["entry"], python["files"]) == (system["entry"], system["files"])
    assert hooks["planc-check"]["entry"] == "planc check"
    assert hooks["planc-fmt"]["entry"] == "planc fmt --check"


def test_hooks_block_bad_plans_at_commit(tmp_path, root, head):
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "cache"), "NO_COLOR": "1"}
    _git(repo, "init", "-q")
    (repo / ".pre-commit-config.yaml").write_text(yaml.safe_dump({"repos": [{
        "repo": str(root), "rev": head,
        "hooks": [{"id": "planc-check-system"}, {"id": "planc-fmt-system"}]}]}))
    subprocess.run([sys.executable, "-m", "pre_commit", "install"], cwd=repo, env=env, check=True,
                   capture_output=True)

    (repo / "model.plan").write_text(BAD)
    _git(repo, "add", ".")
    refused = _git(repo, "commit", "-qm", "bad plan", check=False, env=env)
    assert refused.returncode != 0
    out = refused.stdout + refused.stderr
    assert "planc check (installed planc)" in out and "Failed" in out
    assert "error[P201]: selector `transformer_layer.*` matches no module" in out
    assert "did you mean `transformer_layers`?" in out

    (repo / "model.plan").write_text(UGLY)
    _git(repo, "add", ".")
    refused = _git(repo, "commit", "-qm", "unformatted plan", check=False, env=env)
    assert refused.returncode != 0
    assert "would reformat model.plan" in refused.stdout + refused.stderr

    (repo / "model.plan").write_text(GOOD)
    _git(repo, "add", ".")
    accepted = _git(repo, "commit", "-qm", "good plan", check=False, env=env)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert _git(repo, "log", "--oneline").stdout.count("\n") == 1


def test_python_hooks_install_planc_in_their_own_virtualenv(tmp_path, root, head):
    import torch
    if shutil.disk_usage(tmp_path).free < 4 * 2**30:
        pytest.skip("the hook virtualenv needs about 1 GB of disk (torch)")
    repo, cache = tmp_path / "repo", tmp_path / "cache"
    repo.mkdir()
    env = {**os.environ, "PRE_COMMIT_HOME": str(cache), "NO_COLOR": "1"}
    pin = f"torch=={torch.__version__.split('+')[0]}"  # the torch this suite runs on: no download
    _git(repo, "init", "-q")
    (repo / ".pre-commit-config.yaml").write_text(yaml.safe_dump({"repos": [{
        "repo": str(root), "rev": head,
        "hooks": [{"id": "planc-check", "additional_dependencies": [pin]},
                  {"id": "planc-fmt", "additional_dependencies": [pin]}]}]}))
    run = [sys.executable, "-m", "pre_commit", "run", "--all-files"]
    try:
        (repo / "model.plan").write_text(BAD)
        _git(repo, "add", ".")
        failed = subprocess.run(run, cwd=repo, env=env, capture_output=True, text=True, timeout=1200)
        out = failed.stdout + failed.stderr
        assert failed.returncode == 1, out
        assert "planc check" in out and "error[P201]: selector `transformer_layer.*` matches no module" in out
        (planc_exe,) = cache.glob("repo*/py_env-*/bin/planc")  # planc was installed in the hook's venv
        (repo / "model.plan").write_text(GOOD)
        _git(repo, "add", ".")
        passed = subprocess.run(run, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
        assert passed.returncode == 0, passed.stdout + passed.stderr
        assert planc_exe.exists()
    finally:
        shutil.rmtree(cache, ignore_errors=True)
