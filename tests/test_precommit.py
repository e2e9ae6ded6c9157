"""The pre-commit hooks, installed in a scratch git repository, stop bad plans at commit time.

The scratch repository's `.pre-commit-config.yaml` points at this repository at HEAD, as a
user's would point at a release tag; `pre-commit install` puts the git hook in place and
`git commit` runs it. The `-system` hooks are used (the `language: python` ones would
build a virtualenv with torch, which takes minutes and the network; docs/ci.md explains).
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
