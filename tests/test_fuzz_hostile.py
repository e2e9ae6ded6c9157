"""Property tests for hostile input in the checks: backtracking regexes and huge rank counts.

Whatever the pattern or number, compiling ends with units or diagnostics whose codes say what
went wrong (P212 for a regex out of time, P407 for too many ranks), never a hang or a
traceback. Budget: a few seconds (each slow regex costs at most its 1 s budget, and the
match cache makes a repeated pattern free).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz import assert_well_formed
from ui_models import long_names

import planc
from planc.lang.parse import loads_with_diagnostics
from planc.lang.transform import MAX_INT
from planc.limits import MAX_RANKS
from planc.model.graph import ModelGraph

FEW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ATOMS = ["a", "aa", ".", "\\w", "[ab]", "a?", "(a|aa)", "(a|a)", ".*", "a+"]
REPEATS = ["*", "+", "{2,}", "?", ""]


@pytest.fixture(scope="module")
def graph() -> ModelGraph:
    return ModelGraph.from_module(long_names())


@st.composite
def nested_regexes(draw):
    """Repetitions of repetitions, the shape of catastrophic backtracking."""
    body = draw(st.sampled_from(ATOMS))
    for _ in range(draw(st.integers(1, 3))):
        inner = draw(st.sampled_from(ATOMS))
        body = f"({body}{draw(st.sampled_from(REPEATS))}{inner})" + draw(st.sampled_from(REPEATS))
    return body + draw(st.sampled_from(["$", "b", "x", "", "c$"]))


@FEW
@given(nested_regexes(), st.sampled_from(["unit", "ignore", "unit ** except"]))
def test_nested_regexes_end_in_a_verdict(graph, pattern, statement):
    text = f'model tests.ui_models:long_names\n{statement} re"{pattern}"\n'
    compiled = planc.compile(planc.loads(text, filename="<fuzz>"), graph, strict=False)
    assert_well_formed(compiled.diagnostics, dict(compiled.plan.sources), "<fuzz>")
    assert {d.code for d in compiled.errors} <= {"P105", "P201", "P206", "P212"}  # P105: `a**`


BIG = st.one_of(st.integers(1, 64), st.integers(MAX_RANKS - 2, MAX_RANKS + 2), st.integers(10**9, 10**40))


@FEW
@given(BIG, BIG, BIG, BIG, st.sampled_from([None, 8, MAX_RANKS]))
def test_huge_rank_counts_are_refused_not_worked_on(graph, replicate, shard, at_world, reshard, world):
    text = (f"model tests.ui_models:long_names\nmesh (replicate = {replicate}, shard = {shard})\n"
            f"unit ** {{ reshard after_forward = {reshard} }}\n"
            f"expect memory.peak <= 1GiB at world = {at_world}\n")
    plan, diags = loads_with_diagnostics(text, "<fuzz>")
    # rank counts past MAX_RANKS, and any integer literal past MAX_INT (the `reshard` value), are P103
    too_big = [n > MAX_RANKS for n in (replicate, shard, at_world)] + [reshard > MAX_INT]
    if plan is None or any(d.is_error for d in diags):  # a literal past the limit: the parser's P103
        assert_well_formed(diags, {"<fuzz>": text}, "<fuzz>")
        assert any(too_big) and any(d.code == "P103" for d in diags)
        return
    compiled = planc.compile(plan, graph, world_size=world, strict=False)
    assert_well_formed(compiled.diagnostics, dict(compiled.plan.sources), "<fuzz>")
    p407 = sum(d.code == "P407" for d in compiled.diagnostics)
    assert p407 == (replicate * shard > MAX_RANKS)
