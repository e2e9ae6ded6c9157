"""`planc suggest`: the search space, the one-trace evaluator, the solver, and the plans it writes.

On every shipped plan's model (the zoo's and Hugging Face tiny configs, T5 with its input
factory, torchtitan's Llama 3; 8 ranks) at a tight, a medium and a loose budget
the suggested plan checks clean (its `expect memory.peak` line included, by the memory
model's own trace), fits, and is never estimated slower than the shipped hand-written plan
when that one fits the same budget. The MILP equals exhaustive search on the same linear
model (optimality gap 0). A budget nothing fits is a P950 with the smallest peak found.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import pathlib

import pytest
from goldens import check_golden

import planc
from planc import cli, zoo
from planc.compiler import CompiledPlan
from planc.estimate.hardware import hardware
from planc.estimate.memory import estimate
from planc.lang.fmt import format_plan
from planc.model.graph import ModelGraph
from planc.suggest.cost import CostContext, context, cost
from planc.suggest.evaluate import Evaluator, compress
from planc.suggest.search import budget_spelling, exact_peak, suggest
from planc.suggest.solve import build, exhaustive, globals_for, solve
from planc.suggest.space import Candidate, find_chain, unit_blocks

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORLD, SHAPE = 8, (2, 16)
SHIPPED = {"seed_transformer_tiny": "seed.plan", "gpt_tiny": "gpt.plan", "moe_transformer_tiny": "moe.plan"}
# Hugging Face models with a shipped plan, at their tiny configs (transformers is a test extra)
HF = {"hf:llama-tiny": "llama.plan", "hf:mixtral-tiny": "mixtral.plan", "hf:gpt2-tiny": "gpt2.plan", "hf:bert-tiny": "bert.plan",
      "hf:t5-tiny": "t5.plan"}
# other shipped plans' models: torchtitan's own Llama 3 (torchtitan is an extra)
OTHER = {"planc.model.torchtitan:llama3_debugmodel": "torchtitan_llama3.plan"}
# models that do not take one tensor of token ids: the input factory `planc suggest --inputs` is given
FACTORY = {"hf:t5-tiny": "tests.step_inputs:t5_inputs"}
_EV: dict = {}


def evaluator(name: str) -> Evaluator:
    if name not in _EV:
        if name.startswith("hf:") or name in OTHER:
            pytest.importorskip("transformers" if name.startswith("hf:") else "torchtitan")
            from planc.model.build import build_model
            graph = ModelGraph.from_module(build_model(name))
            _EV[name] = Evaluator(graph, name, WORLD, shape_of(name), inputs=example(name, graph.model))
        else:
            graph = ModelGraph.from_module(zoo.ZOO[name]())
            _EV[name] = Evaluator(graph, f"planc.zoo:{name}", WORLD, SHAPE)
    return _EV[name]


def example(name: str, model=None):
    """The step's inputs of `name` from its `FACTORY` (one draw per model: only shapes matter); None: token ids."""
    if name not in FACTORY:
        return None
    key = ("inputs", name)
    if key not in _EV:
        from planc.model.build import load_callable
        _EV[key] = load_callable(FACTORY[name])(model if model is not None else evaluator(name).graph.model)
    return _EV[key]


def shape_of(name: str):
    """`suggest`'s shape argument: token ids of SHAPE, or None where the model takes `example(name)`."""
    return None if name in FACTORY else SHAPE


def ctx(ev: Evaluator) -> CostContext:
    return context(ev.graph, WORLD, None if ev.model_ref in FACTORY else SHAPE, hardware("h100"),
                   inputs=example(ev.model_ref) if ev.model_ref in FACTORY else None)


def shipped(name: str) -> CompiledPlan:
    ev = evaluator(name)
    return CompiledPlan(planc.load(ROOT / "plans" / {**SHIPPED, **HF, **OTHER}[name]), ev.graph, WORLD, check_memory=False)


def peak_of(compiled: CompiledPlan, name: str) -> int:
    """The memory model's peak of `compiled` on `name`'s inputs."""
    inputs = example(name)
    return estimate(compiled, WORLD, input_shape=None if inputs is not None else SHAPE, inputs=inputs).peak.total


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_default_candidate_has_the_shipped_plans_units(name):
    ev = evaluator(name)
    c = Candidate(checkpoint=("none",) * ev.chain.n, reshard=(True,) * ev.chain.n)
    text = ev.text(c)
    assert format_plan(text) == text
    ours = [(u.modules, u.policy.reshard_after_forward) for u in ev.compiled(c).program.units]
    theirs = [(u.modules, u.policy.reshard_after_forward) for u in shipped(name).program.units]
    assert ours == theirs


def test_chain_of_hf_llama_and_a_tied_model():
    gpt = find_chain(evaluator("gpt_tiny").graph)
    assert gpt.pre == () and gpt.post == ("wte", "ln_f", "lm_head")  # the tie is kept in one unit
    seed = find_chain(evaluator("seed_transformer_tiny").graph)
    assert seed.blocks_path == "transformer_layers" and seed.pre == (("embedding",),)


@pytest.mark.parametrize("c", [
    Candidate(checkpoint=("none", "none"), reshard=(True, True)),
    Candidate(checkpoint=("none", "none"), reshard=(False, 2), prefetch=1),
    Candidate(merge=2, checkpoint=("none",), reshard=(True,)),
    Candidate(replicate=2, offload=True, checkpoint=("none", "none"), reshard=(2, False)),
], ids=["default", "reshard", "merged", "hsdp_offload"])
def test_one_trace_replays_to_the_memory_models_peak(c):
    """Remapped and compressed, the one trace gives `estimate`'s peak exactly (no checkpointing)."""
    ev = evaluator("seed_transformer_tiny")
    assert ev.fast_peak(c) == estimate(ev.compiled(c), WORLD, input_shape=SHAPE).peak.total


def test_compress_keeps_the_peak_with_checkpointing():
    ev = evaluator("gpt_tiny")
    c = Candidate(checkpoint=("full", "selective"), reshard=(True, False))
    assert exact_peak(ev, c)[0] == estimate(ev.compiled(c), WORLD, input_shape=SHAPE).peak.total
    assert len(compress(ev.atom_trace).events) == len(ev.atom_trace.events)  # idempotent


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_linear_model_against_the_memory_model_on_uniform_choices(name):
    """Every unit the same choice: the base choice (no checkpointing, reshard true) is the memory
    model exactly; the others within 10% (block profiles, kept parameters; the winner is
    always re-estimated by the memory model before it is written)."""
    ev = evaluator(name)
    g = globals_for(ev, hardware("h100"))[0]
    sp = build(ev, g, ctx(ev))
    for ci in range(len(sp.combos)):
        choice = [ci] * sp.n_units
        model, exact = sp.peak(choice), exact_peak(ev, sp.candidate(choice))[0]
        if sp.combos[ci] == ("none", True):
            assert model == exact, sp.combos[ci]
        else:
            assert abs(model - exact) <= 0.10 * exact, sp.combos[ci]


def test_variant_programs_cost_what_compiled_candidates_cost():
    """The solver prices uniform candidates on programs changed in place (no compile): the same seconds."""
    from planc.suggest.solve import variant
    ev = evaluator("seed_transformer_tiny")
    w = ev.windows(1, 0)
    names = {w.program.units[i].name for i in w.block_unit_index}
    for rep, off, mode, rs in [(1, False, "full", True), (2, True, "selective", False), (2, False, "none", 2)]:
        c = Candidate(replicate=rep, offload=off, checkpoint=(mode,) * 2, reshard=(rs,) * 2)
        v = variant(w.program, names, list(ev.chain.blocks), replicate=rep, offload=off, mode=mode, reshard=rs)
        assert cost(v, ctx(ev)) == pytest.approx(cost(ev.compiled(c).program, ctx(ev)), rel=1e-12)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_milp_equals_exhaustive_search(name):
    """Optimality gap 0: on every global choice and at budgets across the range, HiGHS finds
    the step time exhaustive enumeration of the same model finds (or both find nothing)."""
    ev = evaluator(name)
    for g in globals_for(ev, hardware("h100")):
        sp = build(ev, g, ctx(ev))
        peaks = sorted({sp.peak(list(ch)) for ch in itertools.product(range(len(sp.combos)), repeat=sp.n_units)})
        for budget in (peaks[0] - 1, peaks[0], peaks[len(peaks) // 3], peaks[len(peaks) // 2], peaks[-1]):
            want = exhaustive(sp, budget)
            got = solve(sp, budget)
            if want is None:
                assert got is None, (g, budget)
                continue
            assert got is not None and sp.peak(got) <= budget
            assert sp.seconds(got) == pytest.approx(want[0], rel=1e-12, abs=0), (g, budget)


@functools.cache
def _budgets(name: str) -> dict[str, int]:
    """Tight (just above the smallest peak found), medium (the shipped plan's peak), loose (twice that);
    once per model (the three-budget and the simulation tests share them)."""
    ship = peak_of(shipped(name), name)
    nothing = suggest(evaluator(name).graph, evaluator(name).model_ref, WORLD, 1, shape_of(name), inputs=example(name))
    smallest = nothing.smallest.peak
    return {"tight": int(smallest * 1.05), "medium": max(ship, int(smallest * 1.1)), "loose": 2 * ship}


@pytest.mark.parametrize("name,level", [(n, lv) for n in [*sorted(SHIPPED), *sorted(HF), *sorted(OTHER)]
                                        for lv in ("tight", "medium", "loose")])
def test_suggested_plan_checks_clean_fits_and_is_not_slower_than_shipped(name, level, tmp_path):
    ev = evaluator(name)
    budget = _budgets(name)[level]
    budget = budget // 1024 * 1024
    result = suggest(ev.graph, ev.model_ref, WORLD, budget, shape_of(name), inputs=example(name), inputs_name=FACTORY.get(name))
    assert result.best is not None, result.smallest
    text = result.text
    assert format_plan(text) == text
    path = tmp_path / "suggested.plan"
    path.write_text(text)
    compiled = CompiledPlan(planc.load(path), ev.graph, WORLD)  # memory expects checked
    assert not compiled.errors, [d.message for d in compiled.errors]
    assert not [d for d in compiled.diagnostics if d.severity == "warning"], [d.message for d in compiled.diagnostics]
    if name in FACTORY:  # the `expect` line has no `input =` (token ids only): the header says how to check it
        assert f"--inputs {FACTORY[name]}" in text
        assert f"expect memory.peak <= {budget_spelling(budget)[1]} at world = 8\n" in text
    peak = peak_of(compiled, name)
    assert peak <= budget == result.budget
    assert peak == result.best.peak
    ship = shipped(name)
    if peak_of(ship, name) <= budget:
        assert cost(compiled.program, ctx(ev)) <= cost(ship.program, ctx(ev)) * (1 + 1e-9)


SIMULATED = [*sorted(SHIPPED), *sorted(HF), *sorted(OTHER)]


@pytest.mark.parametrize("name,level", [(n, lv) for n in SIMULATED for lv in ("tight", "medium", "loose")])
def test_suggested_plan_fits_per_simulation(name, level):
    """Each suggestion (the zoo's, the Hugging Face models' with T5's input factory, torchtitan's
    Llama 3), measured in a fake 8-rank process group (FSDPMemTracker), fits too."""
    from planc.analysis.simulate import simulate, zoo_inputs
    from planc.estimate.memory import unit_memory
    from planc.model.build import build_model
    ev = evaluator(name)
    budget = _budgets(name)[level] // 1024 * 1024
    result = suggest(ev.graph, ev.model_ref, WORLD, budget, shape_of(name), inputs=example(name))
    build = getattr(zoo, name) if name in SHIPPED else (lambda: build_model(name, device="meta"))
    inputs = example(name) if name in FACTORY else zoo_inputs(SHAPE)
    sim = simulate(planc.loads(result.text), build, WORLD, inputs=inputs)
    # a CPU-only simulation counts offloaded state (sharded parameters, gradients and optimizer
    # state on the host) as device memory: take it out, as a GPU would hold it elsewhere
    program = ev.compiled(result.best.candidate).program
    host = sum(m.sharded + m.grads + m.optimizer for m in unit_memory(program, ev.graph, WORLD, "adamw") if m.offload)
    assert bool(host) == result.best.candidate.offload
    assert sim.peak - host <= budget, (sim.peak, host, sim.moment, result.best.peak)
    # the memory model is byte-exact or above the measurement (2 KiB on the loose MoE: an all-gather at the tail)
    assert sim.peak - host <= result.best.peak, (sim.peak, host, sim.moment, result.best.peak)


def test_budget_nothing_fits_is_p950_with_the_smallest_peak():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(["suggest", "-q", "--model", "planc.zoo:seed_transformer_tiny", "--world-size", "8",
                         "--budget", "10KiB", "--input-shape", "2x16"])
    text = out.getvalue()
    assert code == 1 and "Traceback" not in text
    check_golden(ROOT / "tests" / "golden" / "suggest" / "p950.stderr", text)
    smallest = suggest(evaluator("seed_transformer_tiny").graph, "planc.zoo:seed_transformer_tiny", WORLD, 1, SHAPE)
    assert f"{smallest.smallest.peak / 2**10:.2f} KiB" in text


def test_model_without_blocks_is_p951():
    """A model that builds and runs but has no chain of blocks: P951, located on the model, with the fix."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(["suggest", "-q", "--model", "tests.ui_models:no_blocks_net", "--world-size", "8",
                         "--budget", "1GiB", "--input-shape", "2x16"])
    text = out.getvalue()
    assert code == 1 and "Traceback" not in text
    assert "error[P951]" in text and "no list of two or more blocks" in text and "write the plan by hand" in text


def test_model_that_cannot_be_built_is_a_usage_error():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(["suggest", "-q", "--model", "torch.nn:Linear", "--world-size", "8",
                         "--budget", "1GiB", "--input-shape", "2x16"])
    assert code == 2 and "Traceback" not in out.getvalue() and "missing 2 required positional" in out.getvalue()


def test_encoder_decoder_on_token_ids_is_p953_naming_inputs():
    """T5 takes decoder ids too: on `--input-shape` alone the search cannot run the model, and says
    so (P953, suggesting `--inputs`), not a raw transformers message under P951."""
    pytest.importorskip("transformers")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(["suggest", "-q", "--model", "hf:t5-tiny", "--world-size", "8", "--budget", "1GiB",
                         "--input-shape", "2x16"])
    text = out.getvalue()
    assert code == 1 and "Traceback" not in text and "P951" not in text
    assert "error[P953]" in text and "--input-shape 2x16" in text and "--inputs MODULE:FN" in text


def test_cli_inputs_factory(tmp_path):
    """`--inputs` (T5's encoder and decoder ids): the plan's header names the factory and its
    shapes; `--inputs` with `--input-shape` is a usage error, as for `planc explain`."""
    pytest.importorskip("transformers")
    out, buf = tmp_path / "t5.plan", io.StringIO()
    args = ["suggest", "-q", "--model", "hf:t5-tiny", "--world-size", "8", "--budget", "4MiB",
            "--inputs", "tests.step_inputs:t5_inputs"]
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = cli.main([*args, "-o", str(out)])
        twice = cli.main([*args, "--input-shape", "2x16"])
    assert code == 0, buf.getvalue()
    text = out.read_text()
    assert "inputs `tests.step_inputs:t5_inputs` (input_ids 2x32, decoder_input_ids 2x16) per rank" in text
    assert "expect memory.peak <= 4MiB at world = 8\n" in text
    assert twice == 2 and "--inputs and --input-shape name the inputs twice; give one" in buf.getvalue()


def test_cli_writes_the_plan(tmp_path):
    out = tmp_path / "s.plan"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = cli.main(["suggest", "-q", "--model", "planc.zoo:gpt_tiny", "--world-size", "8", "--budget", "1MiB",
                         "--input-shape", "2x16", "-o", str(out)])
    assert code == 0, buf.getvalue()
    text = out.read_text()
    assert text.startswith("# Suggested by `planc suggest`") and "expect memory.peak <= 1MiB at world = 8, input = 2x16" in text
    assert unit_blocks(find_chain(evaluator("gpt_tiny").graph), 1) == [(0,), (1,)]


def test_cli_written_plan_names_a_relative_config_from_its_own_folder(tmp_path, monkeypatch):
    """A plan resolves `model hf:path` from its own folder: `-o out/s.plan` with `--model
    hf:cfg/config.json` (relative to the working directory) writes `hf:../cfg/config.json`."""
    pytest.importorskip("transformers")
    from planc.model.hf import shipped_configs
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(shipped_configs()["llama-tiny"].read_text())
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = cli.main(["suggest", "-q", "--model", "hf:cfg/config.json", "--world-size", "4", "--budget", "64MiB",
                         "--input-shape", "2x16", "-o", "out/s.plan"])
        assert code == 0, buf.getvalue()
        assert "\nmodel hf:../cfg/config.json\n" in (tmp_path / "out" / "s.plan").read_text()
        assert cli.main(["check", "out/s.plan", "--world-size", "4"]) == 0, buf.getvalue()
