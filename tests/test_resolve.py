"""Resolver fixtures (sqlglot `tests/fixtures/optimizer` style) and size-filter properties.

Each `tests/fixtures/resolve/<name>.plan` names its model with its `model` line and sits
beside `<name>.units`: the resolved plan written out, one unit per line in application order
with every setting that differs from planc's default and the rule (file:line) that set it,
then ignored parameters, placements, checkpoint/compile targets, explicit prefetch, and the
diagnostics. When a change is intended, rewrite them with

    PLANC_UPDATE_GOLDENS=1 pytest tests/test_resolve.py

and read the diff: these files are the specification of precedence and selector meaning.
"""

from __future__ import annotations

import os
import pathlib
import random

import pytest
import torch
from torch import nn

import planc
from planc.compiler import CompiledPlan
from planc.lang.parse import loads
from planc.model.build import build_model
from planc.model.graph import ModelGraph
from planc.resolve.ir import DEFAULT_SETTINGS
from planc.resolve.options import show_value
from planc.resolve.selectors import _size_filter

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "resolve"
CASES = sorted(FIXTURES.glob("*.plan"))
from goldens import check_golden  # noqa: E402

_GRAPHS: dict[str, ModelGraph] = {}


def _graph(ref: str) -> ModelGraph:
    if ref not in _GRAPHS:
        cwd = os.getcwd()
        os.chdir(ROOT)  # `tests.ui_models:...` imports from the repo root
        try:
            _GRAPHS[ref] = ModelGraph.from_module(build_model(ref))
        finally:
            os.chdir(cwd)
    return _GRAPHS[ref]


def _where(setting) -> str:
    return f"{setting.rule} @{pathlib.Path(setting.span.file).name}:{setting.span.line}" if setting.span else "default"


def describe(compiled: CompiledPlan) -> str:
    """The resolved plan as text: what the .units files hold."""
    res, out = compiled.resolution, []
    out.append(f"mesh {res.mesh}" + (" (root none)" if res.root_disabled else ""))
    out.append("# units, in application order: name [params] settings that differ from the default")
    for u in compiled.units:
        changed = [f"{k}={show_value(s.value) if not isinstance(s.value, tuple) else '[' + ', '.join(map(str, s.value)) + ']'}"
                   f" ({_where(s)})" for k, s in u.settings.items()
                   if s.span is not None and (s.value != DEFAULT_SETTINGS[k].value or s.order >= 0 or s.rule == "defaults")]
        out.append(f"{u.name} [{len(u.params)}]" + ("  " + "; ".join(changed) if changed else ""))
    sections = [
        ("ignored", [f"{p}" for p in res.ignored]),
        ("placements", [f"{p} Shard({d})" for p, (d, _) in res.placements.items()]),
        ("checkpoint", [f"{m} {s.value} ({_where(s)})" for m, s in res.checkpoint.items()]),
        ("compile", [f"{m} {s.value} ({_where(s)})" for m, s in res.compile.items()]),
        ("prefetch forward", [f"{k} -> {', '.join(v)}" for k, v in res.prefetch_forward.items()]),
        ("prefetch backward", [f"{k} -> {', '.join(v)}" for k, v in res.prefetch_backward.items()]),
        ("diagnostics", [f"{d.severity}[{d.code}] {pathlib.Path(d.span.file).name}:{d.span.line}: {d.message}"
                         for d in compiled.diagnostics]),
    ]
    for title, lines in sections:
        if lines:
            out.append(f"# {title}")
            out.extend(sorted(lines) if title in ("ignored", "placements") else lines)
    return "\n".join(out) + "\n"


def compile_fixture(path: pathlib.Path) -> CompiledPlan:
    plan = planc.load(path)
    return CompiledPlan(plan, _graph(plan.model_ref), world_size=8)


@pytest.mark.parametrize("plan", CASES, ids=[p.stem for p in CASES])
def test_fixture(plan: pathlib.Path):
    actual = describe(compile_fixture(plan))
    check_golden(plan.with_suffix(".units"), actual)


# ===================================================================== invariants on every fixture


@pytest.mark.parametrize("plan", CASES, ids=[p.stem for p in CASES])
def test_units_are_bottom_up_and_own_disjoint_params(plan: pathlib.Path):
    """What FSDP2 needs from any resolution: children before parents, each parameter once."""
    c = compile_fixture(plan)
    g = c.graph
    seen: set[str] = set()
    for k, u in enumerate(c.units):
        assert not (seen & set(u.params)), f"{u.name} re-claims parameters"
        seen |= set(u.params)
        for later in c.units[k + 1:]:  # no later unit may sit strictly inside an earlier one
            for m in later.modules:
                assert not any(g.is_within(m, e) and m != e for e in u.modules if not u.is_root), \
                    f"{later.name} is inside {u.name} but comes after it"
    if c.units and c.units[-1].is_root:
        assert seen | set(c.resolution.ignored) == set(g.params)


# ===================================================================== size filter semantics


def _reference_size_filter(graph: ModelGraph, limit: float, paths: set[str]) -> set[str]:
    """FSDP1's size_based_auto_wrap_policy, written the slow and obvious way."""
    chosen: list[str] = []
    for p in sorted(paths, key=graph.post):
        inner = [c for c in chosen if graph.is_within(c, p) and c != p]
        maximal = [c for c in inner if not any(o != c and graph.is_within(c, o) for o in inner)]
        # containers (no forward) are never chosen; their parameters count for the parent
        if graph.has_forward(p) and graph.subtree_numel[p] - sum(graph.subtree_numel[c] for c in maximal) >= limit:
            chosen.append(p)
    return set(chosen)


class _Node(nn.Module):
    def forward(self, x):
        return x


def _random_tree(rng: random.Random, n: int) -> nn.Module:
    root = _Node()
    nodes = [root]
    with torch.device("meta"):
        for i in range(n):
            parent = rng.choice(nodes)
            child = nn.Linear(rng.randint(1, 6), rng.randint(1, 6), bias=rng.random() < 0.5) \
                if rng.random() < 0.6 else (nn.ModuleList() if rng.random() < 0.2 else _Node())
            parent.add_module(f"m{i}", child)
            nodes.append(child)
    return root


@pytest.mark.parametrize("seed", range(20))
def test_size_filter_matches_fsdp1_reference(seed):
    rng = random.Random(seed)
    graph = ModelGraph.from_module(_random_tree(rng, rng.randint(5, 60)))
    candidates = {p for p in graph.modules if p and rng.random() < 0.7}
    limit = rng.choice([1, 10, 30, 60, 200])
    where = loads(f"unit ** where size >= {limit}").statements[0].target.where
    assert _size_filter(graph, where, candidates) == _reference_size_filter(graph, limit, candidates)


# ===================================================================== mesh sizes


# One contract: sizes that multiply to the world, or None (a fixed mesh that does not fit
# the world has no sizes there: that is P401).
@pytest.mark.parametrize("mesh,world,sizes", [
    ((1, None), 8, (1, 8)), ((2, None), 8, (2, 4)), ((3, None), 8, None), ((None, 4), 8, (2, 4)),
    ((None, 3), 8, None), ((2, 4), 8, (2, 4)), ((2, 4), 64, None), ((1, None), None, None),
    ((None, None), 8, None), ((2, 4), None, (2, 4)), ((1, None), 0, None), ((None, 4), -8, None)])
def test_mesh_sizes(mesh, world, sizes):
    from planc.resolve.mesh import Mesh
    m = Mesh.data_parallel(mesh[0], mesh[1])
    assert m.dp_sizes(world) == sizes
    assert m.sizes(world) == (None if sizes is None else {"replicate": sizes[0], "shard": sizes[1]})


@pytest.mark.parametrize("text,dims,str_", [
    ("mesh (replicate = 1, shard = *)", ("shard",), "(replicate = 1, shard = *)"),
    ("mesh (replicate = 2, shard = *)", ("replicate", "shard"), "(replicate = 2, shard = *)"),
    ("mesh (dp_replicate = 2, fsdp = *)", ("dp_replicate", "fsdp"), "(dp_replicate = 2, fsdp = *)"),
    ("mesh (fsdp = 8)", ("fsdp",), "(replicate = 1, fsdp = 8)"),
])
def test_mesh_dimensions_are_named_as_written(text, dims, str_):
    """The word a plan writes for a dimension names the DeviceMesh dimension planc builds."""
    from planc.resolve.resolver import resolve_mesh
    diags = []
    mesh = resolve_mesh(loads(text).statements[0], diags)
    assert not diags and mesh.dp_axis_names == dims and str(mesh) == str_


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="at least 1 rank"):
        planc.compile(loads("unit blocks.*"), None, world_size=0)
