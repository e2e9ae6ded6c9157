"""Backends of the lowered program: apply it to a live model, materialize it, print it as Python."""
