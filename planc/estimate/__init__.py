"""Estimates of one training step before anything runs: the traced step and the per-rank memory model."""
