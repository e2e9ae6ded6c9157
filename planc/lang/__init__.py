"""The language: syntax tree, parsing (grammar in the top-level `grammar/`), formatting, highlighting."""
