"""`planc suggest --context-parallel RULES|auto`: the context degree joins the search.

On the zoo Llama tiny at 8 ranks with one sequence of 256 tokens per data-parallel rank, the
1-D search's smallest peak is above what a context group of 2 ranks needs (each holds 128
tokens of the sequence; parameters and state are sharded over shard x context either way).
At a budget between the two only context degrees fit: the default rule tries them because
nothing without a context axis fits, and the search picks the fastest per world x batch
sequences. The written plan checks clean, `planc explain` of it gives the header's figures,
and it trains like one process (`check --verify`, tests marked dist).
"""

from __future__ import annotations

import functools
import pathlib

import pytest
from suggest_degrees import checks_clean, explained, tight_budget, verified, write

from planc import zoo
from planc.model.graph import ModelGraph
from planc.suggest.degrees import Degrees, auto_rules
from planc.suggest.search import suggest
from planc.suggest.space import parallel_rules

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORLD, SHAPE = 8, (1, 256)
MODEL = "planc.zoo:llama_tiny"
LOOSE = 64 * 2**20


@functools.lru_cache(maxsize=None)
def graph() -> ModelGraph:
    return ModelGraph.from_module(zoo.llama_tiny())


@functools.lru_cache(maxsize=None)
def searched(budget: int, contexts: tuple[int, ...] | None = None, shape=SHAPE):
    return suggest(graph(), MODEL, WORLD, budget, shape, context_rules=auto_rules(graph(), "context"),
                   contexts=list(contexts) if contexts else None)


@functools.lru_cache(maxsize=None)
def tight() -> int:
    """A budget below every 1-D plan's peak and above context 2's smallest."""
    return tight_budget(searched)


def test_auto_rules_are_the_shipped_plans():
    path = ROOT / "plans" / "zoo-llama-context.plan"
    shipped, errors = parallel_rules(path.read_text(), str(path), "context")
    assert not errors and shipped == ("parallel layers.*.attention context",)
    assert auto_rules(graph(), "context") == shipped
    assert auto_rules(graph(), "expert") == ()   # no experts in a dense model


def test_a_budget_only_context_fits_picks_a_context_degree(tmp_path):
    budget = tight()
    r = searched(budget)
    assert r.best is not None and r.combo.context > 1 and r.combo.tensor == r.combo.expert == 1
    by = {d: (o, why) for d, o, why in r.degrees}
    assert by[Degrees()][0] is None and "nothing fits the budget" in by[Degrees()][1]
    assert "context 1: skipped, nothing fits the budget" in r.text
    # the fastest per world x batch sequences among the degrees that fit
    fitting = {d: o for d, (o, _) in by.items() if o is not None}
    assert r.combo == min(fitting, key=lambda d: d.per_sequences(fitting[d].seconds))
    c = r.combo.context
    assert f"mesh (replicate = {r.best.candidate.replicate}, shard = *, context = {c})" in r.text
    assert "parallel layers.*.attention context" in r.text
    assert f"input 1x256 per context group of {c} ranks" in r.text and f"1x{256 // c} tokens" in r.text
    assert f"expect memory.peak <= {budget // 1024}KiB at world = 8, input = 1x256" in r.text
    path = write(r.text, tmp_path)
    checks_clean(path, graph(), WORLD)
    peak, seconds = explained(path, WORLD, SHAPE)
    assert peak == r.best.peak <= budget
    assert seconds == pytest.approx(r.best.seconds, rel=1e-6)


def test_context_degrees_are_not_tried_when_a_plan_without_fits():
    r = searched(LOOSE)
    assert r.best is not None and r.combo == Degrees()
    skipped = [(d.context, why) for d, o, why in r.degrees if o is None]
    assert [c for c, _ in skipped] == [2, 4, 8] and all(why.startswith("not tried") for _, why in skipped)
    assert "context 2: skipped, not tried: a plan without a context axis fits" in r.text
    # asked for explicitly, they are searched and lose on time per sequence (the K/V gathers cost, nothing is saved)
    asked = searched(LOOSE, (1, 2))
    assert asked.combo == Degrees() and all(o is not None for _, o, _ in asked.degrees)
    two = next(o for d, o, _ in asked.degrees if d.context == 2)
    assert 2 * two.seconds > asked.best.seconds
    assert "(+" in asked.text and "per 8 sequences" in asked.text


def test_a_sequence_the_context_axis_cannot_cut_is_skipped_with_p495():
    r = searched(LOOSE, (1, 4), (1, 12))   # 12 tokens do not cut into 2 x 4 chunks
    by = {d.context: (o, why) for d, o, why in r.degrees}
    assert by[1][0] is not None and by[4][0] is None and "P495" in by[4][1]
    assert "context 4: skipped, rejected by planc's checks: P495" in r.text


@pytest.mark.dist
def test_the_context_plan_trains_like_one_process(tmp_path):
    verdict = verified(write(searched(tight()).text, tmp_path))
    assert verdict.sizes.get("context", 1) > 1, verdict.sizes
