"""The mesh as axes with roles (planc/resolve/mesh.py): one table row per role, no per-combination code.

Checked here: every word names its role; axes come out in the table's order whatever the
order written; `Mesh.sizes(world)` keeps its contract (the world's axes multiply to it) with
an axis that borrows ranks (expert: shard x context x tensor); the dense `DeviceMesh` axes; a
role that is not built is a located P408 and building it is flipping its row; P405's help
comes from the starred axis's row.
"""

from __future__ import annotations

import dataclasses

import pytest

from planc import loads
from planc.resolve import mesh as mesh_mod
from planc.resolve.mesh import BUILT, ROLES, RULE, RULES, Mesh, Role, resolve_mesh


def _resolve(text: str):
    diags: list = []
    return resolve_mesh(loads(text).statements[0], diags), diags


def test_table_order_and_words():
    assert [r.role for r in RULES] == [Role.PIPELINE, Role.REPLICATE, Role.SHARD, Role.CONTEXT, Role.TENSOR,
                                       Role.EXPERT]
    assert BUILT == (Role.PIPELINE, Role.REPLICATE, Role.SHARD, Role.CONTEXT, Role.TENSOR, Role.EXPERT)
    for word, role in {"pp": "pipeline", "dp_replicate": "replicate", "fsdp": "shard", "dp_shard": "shard",
                       "cp": "context", "tp": "tensor", "ep": "expert"}.items():
        assert ROLES[word] == role
    assert all(RULE[r].words[0] == r.value for r in Role)


@pytest.mark.parametrize("text,names,sizes", [
    ("mesh (tensor = 2, shard = *)", ("replicate", "shard", "tensor"), {"replicate": 1, "shard": 4, "tensor": 2}),
    ("mesh (cp = 2, shard = *)", ("replicate", "shard", "cp"), {"replicate": 1, "shard": 4, "context": 2}),
    ("mesh (tp = 2, fsdp = 2, dp_replicate = *)", ("dp_replicate", "fsdp", "tp"),
     {"replicate": 2, "shard": 2, "tensor": 2}),
    ("mesh (replicate = 2)", ("replicate", "shard"), {"replicate": 2, "shard": 4}),
])
def test_axes_in_table_order(text, names, sizes):
    mesh, diags = _resolve(text)
    assert not diags
    assert tuple(a.name for a in mesh.axes) == names
    assert mesh.sizes(8) == sizes
    assert mesh.sizes(7) is None


def test_dense_axes_and_borrowing_expert():
    mesh = Mesh.of({Role.PIPELINE: 2, Role.SHARD: None, Role.CONTEXT: 2, Role.TENSOR: 2, Role.EXPERT: 4},
                   {Role.PIPELINE: "pp"})
    # pipeline outermost, context between shard and tensor, the replicate axis of 1 and the
    # expert axis (it borrows ranks) out of the dense mesh
    assert [a.name for a in mesh.device_axes] == ["pp", "shard", "context", "tensor"]
    assert [a.name for a in mesh.dp_axes] == ["shard"]
    sizes = mesh.sizes(64)
    assert sizes == {"pipeline": 2, "replicate": 1, "shard": 8, "context": 2, "tensor": 2, "expert": 4}
    assert 2 * 1 * 8 * 2 * 2 == 64  # the expert axis does not multiply into the world
    assert Mesh.borrowed(Role.EXPERT, sizes) == 8 * 2 * 2  # shard x context x tensor
    assert Mesh.borrowed(Role.EXPERT, sizes) // sizes["expert"] == 8  # the experts' FSDP degree
    everything = Mesh.of({Role.SHARD: None, Role.TENSOR: 2, Role.EXPERT: None})
    assert everything.sizes(16)["expert"] == 16 and everything.fixed_world is None
    assert Mesh.of({Role.SHARD: 4, Role.EXPERT: 2}).fixed_world == 4


@pytest.mark.parametrize("word,role", [("ep", "expert"), ("expert", "expert")])
def test_unbuilt_roles_are_p408_at_the_axis(word, role, monkeypatch):
    # every role is built now: the rule is shown on the expert row flipped back to unbuilt
    monkeypatch.setattr(mesh_mod, "RULE", {**RULE, Role.EXPERT: dataclasses.replace(RULE[Role.EXPERT], built=False)})
    mesh, diags = _resolve(f"mesh (shard = *, {word} = 2)")
    (d,) = diags
    assert d.code == "P408" and role in d.label and f"`{word}`" in d.message
    assert d.span.column == len("mesh (shard = *, ") + 1
    assert mesh.axes == Mesh().axes  # no cascade: the default mesh fits any world


def test_the_pipeline_row_is_built_outermost():
    assert RULE[Role.PIPELINE].built
    mesh, diags = _resolve("mesh (shard = *, pp = 2)")
    assert not diags
    assert [a.name for a in mesh.device_axes] == ["pp", "shard"]
    assert mesh.sizes(8) == {"pipeline": 2, "replicate": 1, "shard": 4}


@pytest.mark.parametrize("text,message,help_", [
    ("mesh (replicate = *, shard = *)", "both mesh dimensions are `*`", "replicate = *, shard = 8"),
    ("mesh (replicate = *)", "both mesh dimensions are `*`", "replicate = *, shard = 8"),
    ("mesh (shard = *, tensor = *)", "two mesh dimensions are `*`", "tensor-parallel size"),
    ("mesh (replicate = *, shard = *, tensor = *)", "three mesh dimensions are `*`", "tensor-parallel size"),
])
def test_p405_help_from_the_starred_row(text, message, help_):
    mesh, diags = _resolve(text)
    (d,) = diags
    assert d.code == "P405" and d.message == message and help_ in d.help[0]
    assert mesh.axes == Mesh().axes
