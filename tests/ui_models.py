"""Tiny models for the golden diagnostic cases (`model tests.ui_models:...` in tests/ui/*.plan).

Each model exists to provoke one diagnostic the zoo cannot: a 0-dim parameter (P303), or
modules named like plan keywords (a selector must still reach them). Importable from the
repository root, where `planc check` and the tests run.
"""

from __future__ import annotations

import torch
from torch import nn


class Scaled(nn.Module):
    """A linear layer times a learned scalar: `scale` is a 0-dim parameter FSDP2 rejects."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


class ScalarNet(nn.Module):
    """Two `Scaled` blocks in a ModuleList and an output head."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Scaled(dim) for _ in range(2))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def scalar_net() -> ScalarNet:
    return ScalarNet()


class KeywordNet(nn.Module):
    """Children named like plan keywords: `unit`, `model`, `root`, `mesh`, `where`, `except`."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.model = nn.Linear(dim, dim)
        self.unit = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.root = nn.Linear(dim, dim)
        self.mesh = nn.Linear(dim, dim)
        self.where = nn.Linear(dim, dim)
        setattr(self, "except", nn.Linear(dim, dim))
        self.none = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.model(x)
        for u in self.unit:
            x = u(x)
        return getattr(self, "except")(self.where(self.mesh(self.root(x))))


def keyword_net() -> KeywordNet:
    return KeywordNet()
