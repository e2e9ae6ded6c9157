"""Shared modules on 2 real gloo ranks: the plan FSDP2 would crash on is refused by planc
(P309) before torch sees it, and both fixes P309 suggests train like the unsharded model."""

from __future__ import annotations

import os

import pytest
import torch
from checks_workers import shared_module_plans, train
from distributed import run
from ui_models import shared_net

PLANS = {
    "split": "unit blocks.*\n",  # torch: "Cannot concatenate overlapping meshes"
    "own_unit": "unit blocks.0.mlp\nunit blocks.*\n",  # P309's first fix
    "group": "unit [blocks.0, blocks.1]\n",  # P309's second fix
}


@pytest.fixture(scope="module")
def results():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run(shared_module_plans, 2, PLANS)


def test_split_shared_module_is_refused_before_torch(results):
    assert results[0]["split"] == {"refused": ["P309"]}


@pytest.mark.parametrize("fix", ["own_unit", "group"])
def test_suggested_fixes_train_like_the_unsharded_model(results, fix):
    torch.manual_seed(0)
    reference = train(shared_net())
    for rank in results:
        assert rank[fix]["losses"] == pytest.approx(reference, rel=1e-5, abs=1e-6)
