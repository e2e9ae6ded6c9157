"""`planc explain` on 2-D plans: the tensor axis in the header, each unit's placements per mesh axis.

The placements explain derives from the lowered program are checked against the DTensors
`planc.apply` really makes, on a fake process group (any world size, one process): HSDP x TP,
a `place` dim that tensor parallelism shards too, an ignored parameter, a module left off the
tensor mesh, and the shipped Llama plan. (tests/test_tp_dist.py checks the same on 4 gloo ranks.)
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.distributed as dist

import planc
from planc.analysis.explain import parameter_placements, placement_text
from planc.analysis.simulate import init_fake

ROOT = pathlib.Path(__file__).resolve().parent.parent

PLAN = """
model tests.ui_models:local_heads_net
mesh ({mesh})
unit attns.*
root {{}}
{extra}
parallel embed rowwise {{ input replicate; output replicate }}
parallel attns.*.{{q, k, v}} colwise
parallel attns.*.o rowwise
parallel output colwise {{ output replicate }}
parallel norms.* replicate
"""


def real_placements(text: str, build, world: int) -> tuple[dict, dict]:
    """(explain's placements, the ones `planc.apply` made) for `text` at `world` fake ranks."""
    from torch.distributed.tensor import DTensor

    from planc.backends.runtime import apply, build_mesh
    init_fake(world)
    try:
        with torch.device("meta"):
            model = build()
        compiled = planc.compile(planc.loads(text), model, world)
        expected = parameter_placements(compiled, world)
        apply(model, compiled, mesh=build_mesh(compiled.mesh, world, "cpu"))
        real = {n: dict(zip(p.device_mesh.mesh_dim_names, (placement_text(x) for x in p.placements)))
                if isinstance(p, DTensor) else {} for n, p in model.named_parameters()}
        return expected, real
    finally:
        dist.destroy_process_group()


def heads_net():
    from ui_models import HeadsNet
    return HeadsNet()


@pytest.mark.parametrize("mesh,extra,world", [
    ("shard = *, tensor = 2", "parallel norm replicate", 4),  # (left out it is P418)
    ("replicate = 2, shard = *, tensor = 2", "parallel norm replicate", 16),  # HSDP x TP
    ("shard = *, tensor = 4", "place attns.*.o.weight Shard(1)\nignore norm.*", 8),  # strided on dim 1; ignored
    ("shard = *, tensor = 2", "parallel norm sequence", 512),
], ids=["fsdp_tp", "hsdp_tp", "place_and_ignore", "world_512"])
def test_explain_placements_equal_the_runtime_dtensors(mesh, extra, world):
    expected, real = real_placements(PLAN.format(mesh=mesh, extra=extra), heads_net, world)
    assert expected == real
    assert any("_StridedShard" in v for axes in real.values() for v in axes.values())


def test_llama_tp_plan_placements_equal_the_runtime():
    pytest.importorskip("transformers")
    from planc.model.build import build_model
    expected, real = real_placements((ROOT / "plans" / "llama-tp.plan").read_text(),
                                     lambda: build_model("hf:llama-tiny", device="meta"), 8)
    assert expected == real
    assert real["model.layers.0.self_attn.o_proj.weight"] == {"shard": "Shard(0)", "tensor": "Shard(1)"}


def explain(args, monkeypatch):
    from test_explain import explain as run
    return run(args, monkeypatch)


def test_header_names_the_tensor_axis_and_text_shows_placements(monkeypatch):
    pytest.importorskip("transformers")
    code, out, err = explain(["plans/llama-tp.plan", "--world-size", "16"], monkeypatch)
    assert code == 0, err
    assert "world 16 (replicate 1 x shard 8 x tensor 2)" in out.splitlines()[0]
    lines = out.splitlines()
    start = lines.index("placements per mesh axis (shard x tensor)")
    section = "\n".join(lines[start:start + 6])
    assert "(shard: _StridedShard(0, sf=2), tensor: Shard(0))  self_attn.q_proj.weight" in section
    assert "(shard: Shard(0), tensor: Shard(1))" in section and "self_attn.o_proj.weight, mlp.down_proj.weight" in section
    assert "(shard: Shard(0), tensor: Replicate())" in section


def test_json_has_the_tensor_axis_and_per_unit_placements(monkeypatch):
    pytest.importorskip("transformers")
    code, out, _ = explain(["plans/llama-tp.plan", "--world-size", "16", "--format", "json"], monkeypatch)
    data = json.loads(out)
    assert data["mesh"]["tensor"] == 2 and data["mesh"]["shard"] == 8
    assert data["mesh"]["axes"] == [{"axis": "shard", "role": "shard", "size": 8},
                                    {"axis": "tensor", "role": "tensor", "size": 2}]
    layer = data["units"][0]
    groups = {g["params"][0]: g["axes"] for g in layer["placements"]}
    assert groups["self_attn.q_proj.weight"] == {"shard": "_StridedShard(0, sf=2)", "tensor": "Shard(0)"}


def test_one_d_header_unchanged_and_no_placement_section(monkeypatch):
    code, out, _ = explain(["plans/seed.plan", "--model", "planc.zoo:seed_transformer_tiny", "--world-size", "8"],
                           monkeypatch)
    assert code == 0 and "world 8 (replicate 1 x shard 8)  optimizer" in out
    assert "placements per mesh axis" not in out


def test_html_header_names_the_tensor_axis(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    page = tmp_path / "r.html"
    code, _, err = explain(["plans/llama-tp.plan", "--world-size", "8", "--html", str(page)], monkeypatch)
    assert code == 0, err
    assert "world 8 (replicate 1 × shard 4 × tensor 2)" in page.read_text(encoding="utf-8")
