// The planc VS Code extension: .plan files are served by `planc lsp` over stdio.
// Highlighting comes from syntaxes/plan.tmLanguage.json (a copy of editors/plan.tmLanguage.json).
"use strict";

const vscode = require("vscode");
const { LanguageClient, TransportKind } = require("vscode-languageclient/node");

let client;

function activate(context) {
  const config = vscode.workspace.getConfiguration("planc");
  const [command, ...args] = config.get("server.command", ["planc", "lsp"]);
  // TransportKind.stdio appends `--stdio`, which `planc lsp` accepts
  const serverOptions = { command, args, transport: TransportKind.stdio };
  const clientOptions = {
    documentSelector: [
      { scheme: "file", language: "plan" },
      { scheme: "untitled", language: "plan" },
    ],
    initializationOptions: {
      debounce: config.get("debounce", 0.3),
      worldSize: config.get("worldSize", null),
    },
  };
  client = new LanguageClient("planc", "planc lsp", serverOptions, clientOptions);
  context.subscriptions.push(client);
  return client.start();
}

function deactivate() {
  return client ? client.stop() : undefined;
}

module.exports = { activate, deactivate };
