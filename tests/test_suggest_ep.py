"""`planc suggest --expert-parallel RULES|auto`: the expert degree joins the search.

On the zoo's routed MoE tiny (4 experts, top-2) at 8 ranks, expert parallelism keeps each
rank's share of the experts' state the same (experts / expert, FSDP-sharded over shard /
expert ranks) but all-gathers only the rank's own experts per block, so its smallest peak is
below the 1-D search's. At a budget between the two only expert degrees fit and the search
picks one. The written plan checks clean, `planc explain` of it gives the header's figures,
and it trains like one process (`check --verify`, tests marked dist). Expert 8 (4 experts) is
rejected by P482, and a search left with nothing is P960.
"""

from __future__ import annotations

import contextlib
import functools
import io
import pathlib

import pytest
from goldens import check_golden
from suggest_degrees import checks_clean, explained, tight_budget, verified, write

from planc import cli, zoo
from planc.model.graph import ModelGraph
from planc.suggest.degrees import Degrees, auto_rules
from planc.suggest.search import suggest
from planc.suggest.space import parallel_rules

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORLD, SHAPE = 8, (2, 16)
MODEL = "planc.zoo:routed_moe_tiny"
LOOSE = 64 * 2**20
TP_RULES = ("parallel layers.*.attention.qkv colwise", "parallel layers.*.attention.proj rowwise")


@functools.lru_cache(maxsize=None)
def graph() -> ModelGraph:
    return ModelGraph.from_module(zoo.routed_moe_tiny())


@functools.lru_cache(maxsize=None)
def searched(budget: int, experts: tuple[int, ...] | None = None, tensors: tuple[int, ...] | None = None):
    return suggest(graph(), MODEL, WORLD, budget, SHAPE, expert_rules=auto_rules(graph(), "expert"),
                   experts=list(experts) if experts else None, parallel=TP_RULES if tensors else None,
                   tensors=list(tensors) if tensors else None)


@functools.lru_cache(maxsize=None)
def tight() -> int:
    """A budget below every 1-D plan's peak and above expert 2's smallest."""
    return tight_budget(searched)


def test_auto_rules_are_the_shipped_plans():
    path = ROOT / "plans" / "routed-moe-ep.plan"
    shipped, errors = parallel_rules(path.read_text(), str(path), "expert")
    assert not errors and shipped == ("parallel layers.*.moe.experts expert",)
    assert auto_rules(graph(), "expert") == shipped
    assert parallel_rules(path.read_text(), str(path), "tensor")[0] == ()  # the expert statement is not a tensor rule


def test_a_budget_only_expert_fits_picks_an_expert_degree(tmp_path):
    budget = tight()
    r = searched(budget, (1, 2))
    assert r.best is not None and r.combo == Degrees(expert=2)
    assert "expert 1: skipped, nothing fits the budget" in r.text
    assert f"mesh (replicate = {r.best.candidate.replicate}, shard = *, expert = 2)" in r.text
    assert "parallel layers.*.moe.experts expert" in r.text and "balanced routing" in r.text
    assert f"expect memory.peak <= {budget // 1024}KiB at world = 8, input = 2x16" in r.text
    path = write(r.text, tmp_path)
    checks_clean(path, graph(), WORLD)
    peak, seconds = explained(path, WORLD, SHAPE)
    assert peak == r.best.peak <= budget
    assert seconds == pytest.approx(r.best.seconds, rel=1e-6)


def test_combinations_the_checks_reject_show_their_code():
    r = searched(LOOSE, (1, 2, 8), (1, 2))
    by = {d: (o, why) for d, o, why in r.degrees}
    assert by[Degrees()][0] is not None and by[Degrees(expert=2)][0] is not None
    assert "P482" in by[Degrees(expert=8)][1]            # 4 experts do not divide by 8
    # expert x tensor is built (plans/qwen3-moe-ep-tp.plan); these tensor rules leave the embedding and the
    # norms off the tensor axis next to modules on it, which planc's checks reject at any expert degree
    assert "P418" in by[Degrees(tensor=2, expert=2)][1]
    assert "tensor 1, expert 8: skipped, rejected by planc's checks: P482" in r.text
    assert "tensor 2, expert 2: skipped, rejected by planc's checks: P418" in r.text


def test_nothing_searchable_is_p960():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(["suggest", "-q", "--model", MODEL, "--world-size", "8", "--budget", "1MiB", "--input-shape",
                         "2x16", "--expert-parallel", "auto", "--expert", "8"])
    text = out.getvalue()
    assert code == 1 and "Traceback" not in text
    check_golden(ROOT / "tests" / "golden" / "suggest" / "p960.stderr", text)


@pytest.mark.dist
def test_the_expert_plan_trains_like_one_process(tmp_path):
    verdict = verified(write(searched(tight(), (1, 2)).text, tmp_path))
    assert verdict.sizes.get("expert", 1) > 1, verdict.sizes


# Hugging Face's MoE layouts (token choice: `forward(hidden, top_k_index, top_k_weights)`, fused 3-D
# experts) are estimated too: an expert rank's local experts and the runtime's token-choice dispatch
# (planc/model/dispatch.py), the routing read from the model (`top_k`, `gate.top_k`, `hidden_dim`).
HF_WORLD = 4


@functools.lru_cache(maxsize=None)
def hf_graph(ref: str) -> ModelGraph:
    from planc.model.build import build_model

    return ModelGraph.from_module(build_model(ref, device="meta"))


@functools.lru_cache(maxsize=None)
def hf_searched(ref: str, budget: int, experts: tuple[int, ...]):
    return suggest(hf_graph(ref), ref, HF_WORLD, budget, SHAPE, expert_rules=auto_rules(hf_graph(ref), "expert"),
                   experts=list(experts))


@pytest.mark.parametrize("ref", ["hf:mixtral-tiny", "hf:qwen3-moe-tiny"])
def test_hugging_face_moe_expert_degrees_are_estimated(ref):
    assert auto_rules(hf_graph(ref), "expert") == ("parallel model.layers.*.mlp.experts expert",)
    r = hf_searched(ref, LOOSE, (1, 2, 4))
    by = {d: (o, why) for d, o, why in r.degrees}
    assert by[Degrees(expert=2)][0] is not None and by[Degrees(expert=4)][0] is not None, r.degrees
    # each expert rank gathers only its experts per block: its peak is below the 1-D plan's
    assert by[Degrees(expert=2)][0].peak < by[Degrees()][0].peak


@functools.lru_cache(maxsize=None)
def hf_tight() -> int:
    return tight_budget(lambda budget, experts: hf_searched("hf:mixtral-tiny", budget, experts))


def test_a_budget_only_expert_fits_picks_an_expert_degree_for_mixtral(tmp_path):
    budget = hf_tight()
    r = hf_searched("hf:mixtral-tiny", budget, (1, 2))
    assert r.best is not None and r.combo == Degrees(expert=2), r.degrees
    assert "expert 1: skipped, nothing fits the budget" in r.text
    assert "parallel model.layers.*.mlp.experts expert" in r.text and "balanced routing" in r.text
    path = write(r.text, tmp_path)
    checks_clean(path, hf_graph("hf:mixtral-tiny"), HF_WORLD)
    peak, seconds = explained(path, HF_WORLD, SHAPE)
    assert peak == r.best.peak <= budget
    assert seconds == pytest.approx(r.best.seconds, rel=1e-6)


def test_routing_the_time_model_cannot_read_is_p961():
    """An experts container the style fits (the sorted layout) whose router names its top-k `k`: the
    expert degrees are skipped with P961 and the layer's path, not silently."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(["suggest", "-q", "--model", "tests.moe_models:unnamed_top_k", "--world-size", "8", "--budget",
                         "1MiB", "--input-shape", "2x16", "--expert-parallel", "auto", "--expert", "2"])
    text = out.getvalue()
    assert code == 1 and "Traceback" not in text and "P961 layers.0.moe.experts" in text
    check_golden(ROOT / "tests" / "golden" / "suggest" / "p961.stderr", text)


@pytest.mark.dist
def test_the_mixtral_expert_plan_trains_like_one_process(tmp_path):
    verdict = verified(write(hf_searched("hf:mixtral-tiny", hf_tight(), (1, 2)).text, tmp_path))
    assert verdict.sizes.get("expert", 1) > 1, verdict.sizes
