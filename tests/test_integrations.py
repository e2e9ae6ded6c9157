"""planc.integrations without processes: what is refused before anything is sharded."""

from __future__ import annotations

import pytest
from torch import nn

from planc import PlanError
from planc.diagnostics.render import render_text
from planc.integrations.hf import shard_for_trainer


def test_shard_for_trainer_refuses_a_model_the_trainer_would_wrap():
    model = nn.Sequential(nn.Linear(4, 4))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PlanError) as err:
        shard_for_trainer(model, "plans/llama.plan")
    (diag,) = err.value.diagnostics
    assert diag.code == "P605" and "`Sequential`" in diag.message
    assert "help: pass the `PreTrainedModel` itself" in render_text([diag], {})
    # refused before apply: still plain tensors, unchanged
    assert all(type(p) is nn.Parameter and (p == b).all() for p, b in zip(model.parameters(), before))
