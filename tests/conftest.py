"""Shared fixtures: paths and meta-built zoo models."""

from __future__ import annotations

import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def root() -> pathlib.Path:
    return ROOT


@pytest.fixture(scope="session")
def meta_models():
    """Full-size zoo models built on meta, once per session (builders by name)."""
    from planc import zoo
    cache = {}

    def get(name: str):
        if name not in cache:
            with torch.device("meta"):
                cache[name] = zoo.ZOO[name]()
        return cache[name]
    return get
