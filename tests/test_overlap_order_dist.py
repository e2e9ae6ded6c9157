"""The step-time model's overlap schedule against the order a real step runs (issue 19 item 7).

For every shipped 1-D plan whose model has a tiny zoo variant (tests/test_memory.py's
`_zoo_plans()` without `parallel` lines), one launch of 2 gloo ranks applies the plan to the
tiny model and records one training step (`planc.analysis.order.record_order`): FSDP2's
all-gathers (own and prefetched), each unit's forward and backward compute start, its
reduce-scatter and all-reduce, in the order they were issued. The simulator's order is
`estimate_step_time(...).order` for the same plan, model, world and input. Five variants of
seed.plan and gpt.plan ride in the same launch (`VARIANTS`). About 20 s under the gloo lock.

The canonical comparison: the two lists of `(kind, unit, phase)` events are equal,
element by element, after one event is dropped from both (`_canonical`). The events:
`all_gather` (forward and backward, own and prefetched), `compute` (a unit's forward or
backward start), `reduce_scatter` and `all_reduce` (HSDP). Ties inside one hook are ordered
as FSDP2 issues them, on both sides: at a unit's pre-forward (pre-backward) its own
all-gather, then the all-gathers it prefetches in its prefetch list's order, then its
compute start; in its post-backward, the reduce-scatter before the all-reduce.

Left out: the root's backward compute start. FSDP2 registers the root's pre-backward hook
on the model's output, the same tensor as the last unit's (gpt's `[wte, ln_f, lm_head]`:
`lm_head` returns the logits), and tensor hooks run in registration order, so the real root
"starts" just after that unit, while its own backward ops (a position embedding) run last;
the simulator plays the root's pre-backward first and starts no root compute there. Which
comes first issues nothing either way: the root is not resharded after forward (FSDP2's
default for the root, and every shipped plan's `root { reshard after_forward = false }`), so
it gathers nothing in backward, and its default prefetch (the first unit of backward) is
gathered at that unit's own pre-backward, at the same point of the order.
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
        one_d = not any(line.lstrip().startswith(("parallel ", "pipeline ")) for line in path.read_text().splitlines())
        if one_d and ref.startswith("planc.zoo:") and f"{ref.split(':')[1]}_tiny" in zoo.ZOO:
            out.append((path.name, f"{ref.split(':')[1]}_tiny"))
    return out


PLANS = _one_d_zoo_plans()
SEED = (ROOT / "plans" / "seed.plan").read_text()
# Beyond the shipped plans, in the same launch: the schedule's other paths (recompute in
# backward, a unit nested in another, no reshard, explicit prefetch lists, 2 microbatches
# reducing on the last only).
VARIANTS = {
    "seed+checkpoint": (SEED + "checkpoint transformer_layers.* full\n", "seed_transformer_tiny"),
    "seed+nested": (SEED + "unit transformer_layers.*.mlp\n", "seed_transformer_tiny"),
    "seed+no_reshard": (SEED + "unit transformer_layers.* { reshard after_forward = false }\n", "seed_transformer_tiny"),
    "seed+prefetch_lists": (SEED + "defaults { prefetch forward = 1, backward = 2 }\n", "seed_transformer_tiny"),
    "gpt+accumulate_last": ((ROOT / "plans" / "gpt.plan").read_text() + "step { accumulate 2, sync = last }\n",
                            "gpt_tiny"),
}
CASES = {**{name: ((ROOT / "plans" / name).read_text(), builder) for name, builder in PLANS}, **VARIANTS}


def _tokens(model: torch.nn.Module) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, model.config.vocab_size, SHAPE)


def record_plans(rank: int, world: int, cases: dict[str, tuple[str, str]]) -> dict:
    """Rank body: each plan applied to its seeded tiny model, one step recorded."""
    from planc.analysis.order import record_order

    out = {}
    for name, (text, builder) in cases.items():
        torch.manual_seed(0)
        model = zoo.ZOO[builder]()
        applied = planc.apply(model, planc.loads(text, filename=name))
        out[name] = record_order(applied, (_tokens(model),))
    return out


@pytest.fixture(scope="module")
def recorded() -> list[dict]:
    return run(record_plans, WORLD, CASES)


@functools.lru_cache(maxsize=None)
def _simulated(name: str) -> list[tuple[str, str, str]]:
    text, builder = CASES[name]
    with torch.device("meta"):
        model = zoo.ZOO[builder]()
    compiled = planc.compile(planc.loads(text, filename=name), model, WORLD)
    return estimate_step_time(compiled, world=WORLD, input_shape=SHAPE).order


def _canonical(events: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The events compared (see the module docstring): all but the root's backward compute start."""
    return [e for e in events if e != ("compute", "<root>", "backward")]


def _diff(predicted, real) -> str:
    return "\n".join(difflib.unified_diff([" ".join(e) for e in predicted], [" ".join(e) for e in real],
                                          "simulated", "recorded", lineterm=""))


def test_every_one_d_zoo_plan_is_compared():
    names = [n for n, _ in PLANS]
    assert {"seed.plan", "gpt.plan", "moe.plan", "routed-moe.plan", "seed_hsdp.plan", "torchtitan.plan"} <= set(names)
    assert "seed-tp.plan" not in names


@pytest.mark.parametrize("name", [n for n, _ in PLANS] + list(VARIANTS))
def test_recorded_order_equals_simulated(recorded, name):
    assert recorded[0][name] == recorded[1][name]  # both ranks ran the same schedule
    predicted, real = _canonical(_simulated(name)), _canonical(recorded[0][name])
    # the recorder saw something of each kind the plan issues (seed_hsdp at 2 ranks: shard size 1,
    # so no all-gather and no reduce-scatter, only the all-reduce across the 2 replicas)
    assert len({e[0] for e in real}) >= 2 and ("compute", "<root>", "forward") in real
    assert predicted == real, _diff(predicted, real)
