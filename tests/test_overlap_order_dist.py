"""The step-time model's overlap schedule against the order a real step runs (issue 19 item 7).

For every shipped 1-D plan whose model has a tiny zoo variant (tests/test_memory.py's
`_zoo_plans()` without `parallel` lines), one launch of 2 gloo ranks applies the plan to the
tiny model and records one training step (`planc.analysis.order.record_order`): FSDP2's
all-gathers (own and prefetched), each unit's forward and backward compute start, its
reduce-scatter and all-reduce, in the order they were issued. The simulator's order is
`estimate_step_time(...).order` for the same plan, model, world and input.

The canonical comparison: the two lists of `(kind, unit, phase)` events are equal,
element by element. Within one unit's pre-forward (pre-backward), both sides order the
unit's own all-gather first, then the gathers it prefetches (in its prefetch list's order),
then its compute start; a unit's reduce-scatter precedes its all-reduce. Nothing is left out.
"""

from __future__ import annotations

import difflib
import functools
import pathlib

import pytest
import torch
from distributed import run

import planc
from planc import zoo
from planc.estimate.time import estimate_step_time

pytestmark = pytest.mark.dist

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORLD = 2
SHAPE = (2, 16)


def _one_d_zoo_plans() -> list[tuple[str, str]]:
    out = []
    for path in sorted((ROOT / "plans").glob("*.plan")):
        plan = planc.load(path)
        ref = plan.model_ref or ""
        one_d = not any(line.lstrip().startswith("parallel ") for line in path.read_text().splitlines())
        if one_d and ref.startswith("planc.zoo:") and f"{ref.split(':')[1]}_tiny" in zoo.ZOO:
            out.append((path.name, f"{ref.split(':')[1]}_tiny"))
    return out


PLANS = _one_d_zoo_plans()


def _tokens(model: torch.nn.Module) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, model.config.vocab_size, SHAPE)


def record_plans(rank: int, world: int, plans: list[tuple[str, str]]) -> dict:
    """Rank body: each plan applied to its seeded tiny model, one step recorded."""
    from planc.analysis.order import record_order

    out = {}
    for name, builder in plans:
        torch.manual_seed(0)
        model = zoo.ZOO[builder]()
        applied = planc.apply(model, planc.load(ROOT / "plans" / name))
        out[name] = record_order(applied, (_tokens(model),))
    return out


@pytest.fixture(scope="module")
def recorded() -> list[dict]:
    return run(record_plans, WORLD, PLANS)


@functools.lru_cache(maxsize=None)
def _simulated(name: str, builder: str) -> list[tuple[str, str, str]]:
    with torch.device("meta"):
        model = zoo.ZOO[builder]()
    compiled = planc.compile(planc.load(ROOT / "plans" / name), model, WORLD)
    return estimate_step_time(compiled, world=WORLD, input_shape=SHAPE).order


def _diff(predicted, real) -> str:
    return "\n".join(difflib.unified_diff([" ".join(e) for e in predicted], [" ".join(e) for e in real],
                                          "simulated", "recorded", lineterm=""))


def test_every_one_d_zoo_plan_is_compared():
    names = [n for n, _ in PLANS]
    assert {"seed.plan", "gpt.plan", "moe.plan", "routed-moe.plan", "seed_hsdp.plan", "torchtitan.plan"} <= set(names)
    assert "seed-tp.plan" not in names


@pytest.mark.parametrize("name,builder", PLANS, ids=[n for n, _ in PLANS])
def test_recorded_order_equals_simulated(recorded, name, builder):
    assert recorded[0][name] == recorded[1][name]  # both ranks ran the same schedule
    predicted = _simulated(name, builder)
    assert predicted == recorded[0][name], _diff(predicted, recorded[0][name])
