"""Rank bodies for tests/test_checks_dist.py (module level, so spawned ranks can import them)."""

from __future__ import annotations

import torch
from ui_models import shared_net

import planc
from planc.diagnostics import PlanError

STEPS = 3


def batches(steps: int = STEPS) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 16, (2, 4), generator=gen) for _ in range(steps)]


def train(model, steps: int = STEPS) -> list[float]:
    """Losses of `steps` SGD steps on the same token batches on every rank."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for tokens in batches(steps):
        loss = model(tokens).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def shared_module_plans(rank: int, world: int, plans: dict[str, str]) -> dict:
    """Apply each plan to a fresh shared_net: the codes it was refused with, or its losses."""
    out = {}
    for name, text in plans.items():
        torch.manual_seed(0)
        model = shared_net()
        try:
            planc.apply(model, planc.loads("model tests.ui_models:shared_net\n" + text, filename=f"{name}.plan"))
        except PlanError as err:
            out[name] = {"refused": [d.code for d in err.diagnostics if d.is_error]}
            continue
        out[name] = {"losses": train(model)}
    return out
