"""`planc emit`: the printed `apply_plan(model, mesh)` source, without ranks.

Goldens: tests/golden/emit/<name>.py is what `planc emit` prints for the case's plan (see
CASES). Rewrite them after an intended change with

    PLANC_UPDATE_GOLDENS=1 pytest tests/test_emit.py

and review the diff. tests/test_emit_dist.py runs the emitted code on real ranks.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import pathlib

import pytest
import torch

import planc
from planc.backends.emit import emit_python, expression
from planc.lower.job import UnknownKind
from planc.model.build import build_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "emit"
from goldens import check_golden  # noqa: E402

# golden name -> (plan path relative to the repo, model reference or None for the plan's own)
CASES = {
    "seed": ("plans/seed.plan", None),
    "moe_everything": ("tests/golden/emit/moe_everything.plan", None),
    "gpt_tied": ("plans/gpt.plan", "planc.zoo:gpt_tiny"),
    "zoo_llama_context": ("plans/zoo-llama-context.plan", None),
}


def emitted(plan: str, model_ref: str | None = None, text: str | None = None) -> str:
    parsed = planc.loads(text, filename=plan) if text is not None else planc.load(ROOT / plan)
    ref = model_ref or parsed.model_ref
    compiled = planc.compile(parsed, build_model(ref))
    return emit_python(compiled, plan_path=plan, model_ref=ref)


def run_emit(plan: str, model: str | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            from planc import cli
            code = cli.main(["emit", plan] + (["--model", model] if model else []))
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name: str):
    plan, ref = CASES[name]
    code, out, err = run_emit(plan, ref)
    assert code == 0, err
    golden = GOLDEN / f"{name}.py"
    check_golden(golden, out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_emitted_code_is_valid_python_with_apply_plan(name: str):
    plan, ref = CASES[name]
    source = emitted(plan, ref)
    tree = ast.parse(source)
    assert ast.get_docstring(tree).startswith("FSDP2 sharding of")
    funcs = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert "apply_plan" in funcs
    namespace: dict = {}
    exec(compile(source, f"<emit {name}>", "exec"), namespace)  # imports resolve, no NameError at import
    assert callable(namespace["apply_plan"])
    # every imported name is used (code people vendor should pass their linters)
    imported = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert imported - {"annotations"} <= used, imported - used


def test_order_checkpoint_compile_then_fully_shard_then_prefetch():
    source = emitted("tests/golden/emit/moe_everything.plan")
    body = source[source.index("def apply_plan"):]
    first = {what: body.index(what) for what in
             ("checkpoint(", ".compile(", "fully_shard(", "set_modules_to_forward_prefetch", "return model")}
    assert list(first) == sorted(first, key=first.get)
    # the root is the last fully_shard call; group units are one list call
    calls = [line.strip() for line in body.splitlines() if line.strip().startswith("fully_shard(")]
    assert calls[-1].startswith("fully_shard(model,")
    assert any(c.startswith("fully_shard([model.norm, model.output],") for c in calls)


def test_runs_become_loops_not_copies():
    # seed_transformer has 24 blocks: one loop, never 24 copies
    source = emitted("plans/seed.plan")
    assert "for block in model.transformer_layers:\n        fully_shard(block," in source
    assert "transformer_layers[3]" not in source
    # a partial run is a slice; a different setting on the tail breaks the run
    text = ("model planc.zoo:seed_transformer\nunit transformer_layers.*\n"
            "unit transformer_layers[-2:] { offload cpu }\n")
    source = emitted("<t>", text=text)
    assert "for block in model.transformer_layers[0:22]:" in source
    assert "for block in model.transformer_layers[22:24]:" in source


def test_prefetch_chains_become_index_loops():
    source = emitted("plans/moe.plan")  # 8 layers, prefetch forward = 1, backward = 2
    assert ("for i in range(0, 7):\n"
            "        model.layers[i].set_modules_to_forward_prefetch([model.layers[i + 1]])") in source
    assert "model.layers[7].set_modules_to_forward_prefetch([model.norm])" in source
    assert "for i in range(7, 1, -1):" in source


def test_an_op_emit_cannot_print_is_an_error():
    # a new kind of operation in the program without a printer is refused, never dropped
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class NewOp:
        unit: str

    compiled = planc.compile(planc.load(ROOT / "plans/seed.plan"), build_model("planc.zoo:seed_transformer_tiny"))
    job = compiled.job
    program = dataclasses.replace(job.program, ops=job.program.ops + (NewOp("<root>"),))
    compiled.__dict__["job"] = dataclasses.replace(job, parts=(dataclasses.replace(job.parts[0], program=program),))
    with pytest.raises(UnknownKind, match="NewOp"):
        emit_python(compiled)


def test_unit_methods_are_printed_after_sharding():
    text = ("model planc.zoo:seed_transformer_tiny\nunit transformer_layers.*\n"
            "defaults { reduction divide_factor = 1.0, force_sum = true }\n")
    source = emitted("<t>", text=text)
    assert "    model.set_gradient_divide_factor(1.0)\n" in source
    assert "    model.set_force_sum_reduction_for_comms(True)\n" in source
    loop = source[source.index("    for block in model.transformer_layers:", source.rindex("fully_shard(")):]
    assert "block.set_gradient_divide_factor(1.0)" in loop and "block.set_force_sum_reduction_for_comms(True)" in loop
    assert source.index("set_gradient_divide_factor") > source.rindex("fully_shard(")


def test_pin_memory_follows_the_mesh_device_as_in_apply():
    text = ("model planc.zoo:seed_transformer_tiny\nunit embedding { offload cpu }\n"
            "unit transformer_layers.* { offload cpu, pin_memory = false }\n")
    source = " ".join(emitted("<t>", text=text).split())  # calls may be wrapped
    assert ('fully_shard(model.embedding, mesh=mesh, '
            'offload_policy=CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu"))') in source
    assert "fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))" in source


def test_expressions():
    model = build_model("planc.zoo:moe_transformer_tiny")
    assert expression("model", model, "") == "model"
    assert expression("model", model, "layers.1.moe.experts.w1") == "model.layers[1].moe.experts.w1"
    dict_model = torch.nn.Module()
    dict_model.blocks = torch.nn.ModuleDict({"0": torch.nn.Linear(1, 1), "class": torch.nn.Linear(1, 1)})
    assert expression("model", dict_model, "blocks.0.weight") == "model.blocks['0'].weight"
    assert expression("model", dict_model, "blocks.class") == "model.blocks['class']"


def test_cli_errors():
    code, out, err = run_emit("plans/does-not-exist.plan")
    assert code == 2 and "P002" in err and not out
    code, out, err = run_emit("tests/golden/emit/moe_everything.plan", "planc.zoo:seed_transformer_tiny")
    assert code == 1 and "error[P201]" in err and not out  # selectors that match nothing
    code, out, err = run_emit("plans/seed.plan", "planc.zoo:nope")
    assert code == 2 and "nope" in err


def test_cli_warnings_go_to_stderr_code_to_stdout(tmp_path):
    plan = tmp_path / "fsdp1.plan"
    plan.write_text("model planc.zoo:seed_transformer_tiny\nunit transformer_layers.* { strategy SHARD_GRAD_OP }\n")
    code, out, err = run_emit(str(plan))
    assert code == 0 and "note[P901]" in err
    ast.parse(out)
    assert "fully_shard(block, mesh=mesh, reshard_after_forward=False)" in out


SHIPPED = sorted((ROOT / "plans").glob("*.plan"))


@pytest.mark.parametrize("plan", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_plan_emits_python(plan: pathlib.Path):
    import shipped
    if shipped.not_run(plan):
        pytest.skip(shipped.not_run(plan))
    if "model hf:" in plan.read_text(encoding="utf-8"):
        pytest.importorskip("transformers")
    code, out, err = run_emit(plan.relative_to(ROOT).as_posix())
    assert code == 0, err
    namespace: dict = {}
    exec(compile(out, str(plan), "exec"), namespace)
    assert callable(namespace["build_pipeline" if shipped.is_pipeline(plan) else "apply_plan"])


def test_numbered_module_dict_loops_over_values():
    # torchtitan keeps blocks in a ModuleDict keyed "0", "1", ...; tests/test_emit_dist.py
    # runs this case on ranks
    from test_emit_dist import DICT_PLAN
    source = emitted("<dict>", "test_emit_dist:NumberedDictModel", text=DICT_PLAN)
    assert "for block in model.layers.values():\n        # unit layers.*.0 (<dict>:4)\n" in source
    assert "        fully_shard(block[0], mesh=mesh, reshard_after_forward=False" in source
    assert "model.layers['" not in source
    # a partial run over a ModuleDict is written out, with the keys as strings
    source = emitted("<dict>", "test_emit_dist:NumberedDictModel", text=DICT_PLAN + "unit layers[1:] { offload cpu }\n")
    assert "fully_shard(model.layers['1']," in source and "model.layers.values()" not in source


def test_emit_follows_each_ops_own_mesh():
    """Ops may run on different submeshes (experts will): emit slices each op's own axes, as the
    runtime does, instead of one data-parallel mesh for every unit. Checked on FSDP2's own state
    after both ran on one fake 2 x 2 process group: every unit on the same mesh axes."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from planc.analysis.simulate import init_fake
    from planc.backends.runtime import build_mesh
    from planc.lower.program import FullyShard

    def build():
        torch.manual_seed(0)
        with torch.device("meta"):
            return build_model("planc.zoo:seed_transformer_tiny")

    model = build()
    compiled = planc.compile(planc.load(ROOT / "plans/seed_hsdp.plan"), model, 4)
    job = compiled.job
    ops = tuple(dataclasses.replace(op, axes=("shard",)) if isinstance(op, FullyShard) and op.name == "embedding"
                else op for op in job.program.ops)
    program = dataclasses.replace(job.program, ops=ops)
    compiled.__dict__["job"] = dataclasses.replace(job, parts=(dataclasses.replace(job.parts[0], program=program),))
    source = emit_python(compiled)
    assert "    mesh_shard = mesh['shard']\n" in source and "fully_shard(model.embedding, mesh=mesh_shard" in source

    def meshes(root):
        return {name: tuple(m._get_fsdp_state()._fsdp_param_group.mesh_info.mesh.mesh_dim_names)
                for name, m in root.named_modules() if isinstance(m, FSDPModule)
                and m._get_fsdp_state()._fsdp_param_group is not None}

    init_fake(4)
    try:
        mesh = build_mesh(compiled.mesh, 4, "cpu")
        planc.apply(model, compiled, mesh=mesh)
        emitted, scope = build(), {}
        exec(compile(source, "<emitted>", "exec"), scope)
        scope["apply_plan"](emitted, mesh)
        applied_meshes, emitted_meshes = meshes(model), meshes(emitted)
    finally:
        dist.destroy_process_group()
    assert applied_meshes["embedding"] == ("shard",) and applied_meshes["transformer_layers.0"] == ("replicate", "shard")
    assert emitted_meshes == applied_meshes
