"""Every plan shipped in `plans/` checks clean against the model its `model` line names.

Plans are discovered by glob, so a new plan is tested the moment it lands. Each is compiled
at world sizes 8 and 64 wherever its mesh can fill that world (a `(replicate = 2, shard = *)`
mesh fills both; a fixed 4 x 4 mesh only 16 and is then checked at that size). A plan whose
model needs an optional extra that is not installed is skipped, saying which.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest

from planc.compiler import CompiledPlan
from planc.diagnostics.render import render_text
from planc.lang.parse import load_with_diagnostics
from planc.model.build import ModelLoadError, build_model
from planc.model.graph import ModelGraph

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLANS = sorted((ROOT / "plans").glob("**/*.plan"))
WORLDS = (8, 64)
# model reference prefix -> (module it needs, extra that installs it)
EXTRAS = {"hf:": ("transformers", "hf"), "planc.model.torchtitan:": ("torchtitan", "torchtitan")}
_GRAPHS: dict[tuple[str, str], ModelGraph] = {}


def _graph(ref: str, base: str) -> ModelGraph:
    for prefix, (module, extra) in EXTRAS.items():
        if ref.startswith(prefix) and importlib.util.find_spec(module) is None:
            pytest.skip(f"model `{ref}` needs the `{extra}` extra (`pip install planc[{extra}]`)")
    key = (ref, base)
    if key not in _GRAPHS:
        try:
            _GRAPHS[key] = ModelGraph.from_module(build_model(ref, base=base))
        except ModelLoadError as err:
            pytest.fail(f"cannot build the plan's model: {err}")
    return _GRAPHS[key]


def _worlds(plan_mesh) -> list[int]:
    fixed = plan_mesh.fixed_world
    if fixed is not None:
        return [fixed]
    return [w for w in WORLDS if plan_mesh.sizes(w) is not None]


def test_plans_exist():
    assert PLANS, "plans/ holds no .plan files"


@pytest.mark.parametrize("path", PLANS, ids=[p.relative_to(ROOT / "plans").as_posix() for p in PLANS])
def test_plan_checks_clean(path: pathlib.Path):
    plan, diags = load_with_diagnostics(path)
    assert plan is not None and not any(d.is_error for d in diags), render_text(diags, {})
    assert plan.model_ref, f"{path.name} has no `model` line"
    cwd = os.getcwd()
    os.chdir(ROOT)  # `model` lines name importable modules relative to the repository root
    try:
        graph = _graph(plan.model_ref, str(path.parent))
    finally:
        os.chdir(cwd)
    mesh = CompiledPlan(plan, graph, None).mesh
    worlds = _worlds(mesh)
    assert worlds, f"mesh {mesh} fills neither 8 nor 64 ranks"
    for world in worlds:
        compiled = CompiledPlan(plan, graph, world)
        errors = compiled.errors
        assert not errors, f"{path.name} at world size {world}:\n" + render_text(errors, compiled.sources)
        assert compiled.units, "a clean plan resolves to at least one unit"
        assert sum(len(u.params) for u in compiled.units) + len(compiled.resolution.ignored) == len(graph.params) \
            or compiled.resolution.root_disabled


def test_torchtitan_tp_header_gives_the_debug_models_real_head_counts():
    """The header's `(debugmodel: N heads, M KV heads` is what the model really has."""
    import re
    text = (ROOT / "plans" / "torchtitan_llama3-tp.plan").read_text()
    found = re.search(r"debugmodel: (\d+) heads, (\d+) KV heads", text)
    assert found is not None
    attention = build_model("planc.model.torchtitan:llama3_debugmodel").get_submodule("layers.0.attention")
    assert (int(found.group(1)), int(found.group(2))) == (attention.n_heads, attention.n_kv_heads)
