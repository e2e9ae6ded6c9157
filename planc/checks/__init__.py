"""Validation: checks over a resolved plan, each a plain function returning diagnostics."""
