"""Lowering: a resolved plan as one typed, ordered program of operations every backend runs."""
