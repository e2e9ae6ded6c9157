"""Estimates of one training step before anything runs: the traced step and the per-rank memory model,
the step's FLOPs (flops.py), hardware profiles (hardware.py) and the step-time model (time.py)."""
