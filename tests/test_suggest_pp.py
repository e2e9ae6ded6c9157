"""`planc suggest --pipeline`: the pipeline degree, schedule, stages per rank, microbatches and checkpointing.

On the zoo Llama tiny (2 blocks: at most 4 stages) at 8 ranks: the search's pruning finds the
optimum of its own model (against exhaustive enumeration of the same model over every
schedule); at a budget below the smallest peak the search without a pipeline finds (P950
there), the suggestion is a pipeline plan, which `planc check` accepts and whose header states
what `planc explain` estimates for it; every schedule, the split-backward ones included, gives
a plan planc accepts (no resharding after forward: P465); a suggested plan trains under
examples/train.py (4 gloo ranks).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import pathlib
import re

import pytest
from distributed import train_example

import planc
from planc import cli
from planc.compiler import CompiledPlan
from planc.estimate.hardware import hardware
from planc.suggest import pipeline as pp
from planc.suggest.search import suggest

ROOT = pathlib.Path(__file__).resolve().parent.parent
REF = "planc.zoo:llama_tiny"
WORLD = 8
from goldens import check_golden  # noqa: E402


@functools.cache
def graph():
    from planc.cli.common import ModelCache
    return ModelCache().graph(REF)


@functools.cache
def model(seq: int) -> pp.Model:
    return pp.Model(pp.profile(graph(), REF, WORLD, seq, "adamw", 1, ()), graph(), WORLD, hardware("h100"), "adamw")


def run_cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(list(args))
    return code, out.getvalue()


@pytest.mark.parametrize("budget", [1 << 40, 1_700_000, 1_550_000])
def test_search_finds_the_optimum_of_its_model(budget):
    """Pruning by memory and by the busiest rank's compute loses nothing: the search's best is
    the fastest fitting choice of exhaustive enumeration over every schedule, 2 and 4 stages."""
    m = model(256)
    fitting, smallest, searched, pruned = pp.search({1: m}, WORLD, 16, budget, (2, 4), pp.SCHEDULES)
    every = list(pp.choices(WORLD, 16, 1, (2, 4), pp.SCHEDULES, 4))
    assert {c.schedule for c in every} == set(pp.SCHEDULES) and len(every) > 30
    fits = [c for c in every if m.peak(c)[0] <= budget]
    assert smallest.peak == min(m.peak(c)[0] for c in every)
    if not fits:
        assert not fitting
        return
    best = min(m.seconds(c)[0] for c in fits)
    assert fitting[0].seconds == best
    assert m.peak(fitting[0].choice)[0] <= budget
    assert searched + pruned == len(every)


def test_microbatches_divide_the_batch_and_cover_the_stages():
    for c in pp.choices(WORLD, 16, 1, (2, 4), pp.SCHEDULES, 4):
        assert c.local_batch % c.microbatches == 0 and c.microbatches >= c.pp * c.stages_per_rank
        assert c.local_batch == 16 // (WORLD // c.pp)
        assert c.stages_per_rank == (1 if c.schedule in pp.SINGLE_STAGE else 2 if c.schedule in pp.V_SCHEDULES
                                     else c.stages_per_rank) and c.stages_per_rank <= pp.MAX_STAGES_PER_RANK


@pytest.mark.parametrize("name", pp.SCHEDULES)
def test_every_schedule_writes_a_plan_planc_accepts(name):
    """The split-backward schedules too: the plan never reshards after forward (P465) and does not
    checkpoint under them (P451); full checkpointing under the others."""
    offered = list(pp.choices(WORLD, 16, 1, (2,), (name,), 4))
    c = next(c for c in offered if c.checkpoint == ("none" if name in pp.SPLIT_BACKWARD else "full"))
    assert name not in pp.SPLIT_BACKWARD or {c.checkpoint for c in offered} == {"none"}
    text = pp.plan_text(model(256).prof.chain, REF, c, ())
    assert "reshard" not in text
    compiled = CompiledPlan(planc.loads(text), graph(), WORLD, check_memory=False)
    assert not [d for d in compiled.diagnostics if d.severity == "error"], compiled.diagnostics
    assert compiled.resolution.pipeline.schedule == name


def test_tight_budget_picks_a_pipeline_that_checks_clean_and_explains_as_its_header(tmp_path):
    """Below the smallest peak the 1-D search finds (P950), a pipeline fits; the written plan
    checks clean and `planc explain` of it gives the header's peak and step time."""
    budget = 2000 * 1024
    flat = suggest(graph(), REF, WORLD, budget, (2, 256))
    assert flat.best is None and flat.smallest.peak > budget
    code, text = run_cli("suggest", "-q", "--model", REF, "--world-size", "8", "--budget", "2000KiB",
                         "--input-shape", "2x256")
    assert code == 1 and "P950" in text
    out = tmp_path / "pp.plan"
    code, text = run_cli("suggest", "-q", "--model", REF, "--world-size", "8", "--budget", "2000KiB",
                         "--input-shape", "2x256", "--pipeline", "1,2,4", "-o", str(out))
    assert code == 0, text
    plan = out.read_text()
    assert "mesh (pipeline = " in plan and "# Without a pipeline: nothing fits the budget" in plan
    code, text = run_cli("check", str(out))
    assert code == 0 and ": ok" in text and "error" not in text, text  # the expect line held on every rank
    shape = re.search(r"input = (\d+x\d+)", plan).group(1)
    code, text = run_cli("explain", str(out), "--world-size", "8", "--input-shape", shape, "--format", "json")
    assert code == 0, text
    est = json.loads(text)["estimate"]
    result = pp.suggest_all(graph(), REF, WORLD, budget, (2, 256), budget_text="2000KiB", pipelines=(1, 2, 4))
    assert result.best.exact and result.best.peak == est["memory"]["peak_bytes"] <= budget
    assert result.best.seconds == pytest.approx(est["time"]["totals"]["step_s"], rel=1e-6)
    assert f"peak {planc.quantities.show_bytes(result.best.peak)} on the binding pipeline rank" in plan


def test_no_pipeline_degree_is_p954():
    code, text = run_cli("suggest", "-q", "--model", REF, "--world-size", "8", "--budget", "1MiB",
                         "--input-shape", "2x16", "--pipeline", "8,16")
    assert code == 1 and "Traceback" not in text
    check_golden(ROOT / "tests" / "golden" / "suggest" / "p954.stderr", text)


def test_unknown_schedule_is_a_usage_error():
    code, text = run_cli("suggest", "-q", "--model", REF, "--world-size", "8", "--budget", "1MiB",
                         "--input-shape", "2x16", "--pipeline", "2", "--schedules", "Zigzag")
    assert code != 0 and "Interleaved1F1B" in text and "Traceback" not in text


@pytest.mark.dist
def test_suggested_plan_trains_under_the_example(tmp_path):
    """The suggested pipeline plan at 4 ranks trains 3 steps under examples/train.py: the loss falls."""
    out = tmp_path / "pp4.plan"
    code, text = run_cli("suggest", "-q", "--model", REF, "--world-size", "4", "--budget", "4MiB",
                         "--input-shape", "2x32", "--pipeline", "2", "--schedules", "Interleaved1F1B,ZBVZeroBubble",
                         "-o", str(out))
    assert code == 0, text
    stdout, losses = train_example("--plan", str(out), "--steps", "3", "--batch", "8", "--seq", "32")
    assert len(losses) == 3 and losses[-1] < losses[0], stdout
