"""The editor integrations in `editors/` are consistent: the VS Code extension's files exist,
its grammar is the repository's TextMate grammar, and it starts `planc lsp`."""

from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
VSCODE = ROOT / "editors" / "vscode"


def test_vscode_extension_is_consistent():
    manifest = json.loads((VSCODE / "package.json").read_text())
    [lang] = manifest["contributes"]["languages"]
    [grammar] = manifest["contributes"]["grammars"]
    assert lang["extensions"] == [".plan"] and grammar["language"] == lang["id"]
    assert (VSCODE / manifest["main"]).is_file() and (VSCODE / lang["configuration"]).is_file()
    shipped = json.loads((VSCODE / grammar["path"]).read_text())
    assert shipped == json.loads((ROOT / "editors" / "plan.tmLanguage.json").read_text())
    assert shipped["scopeName"] == grammar["scopeName"]
    assert manifest["contributes"]["configuration"]["properties"]["planc.server.command"]["default"] == ["planc", "lsp"]
    assert "vscode-languageclient" in manifest["dependencies"]
    json.loads((VSCODE / "language-configuration.json").read_text())
