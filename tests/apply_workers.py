"""Rank bodies for tests/test_apply_dist.py: apply plans on real gloo ranks, read FSDP back.

Each worker returns plain data (picklable) read from the live FSDP states and DTensors, so
the test process compares it with the compiled plan and with an unsharded reference run.
`train` (tests/training.py) is shared by the workers and the unsharded reference, so both
do the same steps.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from training import batches, clip_grad_norm, next_token_loss, train

import planc
from planc import zoo


def example_clip(model: nn.Module, max_norm: float, world: int) -> torch.Tensor:
    """examples/train.py's gradient sync and clipping (it also handles `ignore`d params)."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train.py"
    spec = importlib.util.spec_from_file_location("planc_example_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.sync_and_clip(model, max_norm, world)


def read_back(applied) -> dict:
    """What FSDP actually holds: per unit its params and policies, per param its DTensor."""
    model = applied.model
    name_of = {id(p): n for n, p in model.named_parameters()}
    state_unit = {id(a.handle._get_fsdp_state()): a.name for a in applied.units}
    units = {}
    for a in applied.units:
        state = a.handle._get_fsdp_state()
        groups = state._fsdp_param_groups
        info = {
            "modules": tuple(a.unit.modules),
            "fsdp_modules": [type(m).__name__ for m in a.modules],
            "same_state": all(m._get_fsdp_state() is state for m in a.modules),
            "params": sorted(name_of[id(fp.sharded_param)] for g in groups for fp in g.fsdp_params),
            "mp": [(g.mp_policy.param_dtype, g.mp_policy.reduce_dtype, g.mp_policy.output_dtype,
                    g.mp_policy.cast_forward_inputs) for g in groups],
            "state_mp": (state._mp_policy.param_dtype, state._mp_policy.reduce_dtype,
                         state._mp_policy.output_dtype, state._mp_policy.cast_forward_inputs),
            "offload": [(type(g.offload_policy).__name__, getattr(g.offload_policy, "pin_memory", None))
                        for g in groups],
            "reshard": [_reshard(g) for g in groups],
            "prefetch_forward": [state_unit[id(s)] for s in state._states_to_forward_prefetch],
            "prefetch_backward": [state_unit[id(s)] for s in state._states_to_backward_prefetch],
        }
        units[a.name] = info
    params = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        params[name] = {"dtensor": isinstance(p, DTensor), "placements": tuple(map(repr, p.placements))
                        if isinstance(p, DTensor) else None, "shape": tuple(p.shape),
                        "local_shape": tuple(local.shape), "device": str(local.device)}
    from torch.distributed._composable.contract import _get_registry
    checkpointed = [n for n, m in model.named_modules() if "checkpoint" in (_get_registry(m) or {})]
    shard_rank = applied.mesh["shard"].get_local_rank() if applied.mesh.ndim == 2 else applied.mesh.get_local_rank()
    return {"units": units, "params": params, "shard_rank": shard_rank, "mesh_shape": tuple(applied.mesh.shape),
            "mesh_names": applied.mesh.mesh_dim_names, "local_param_bytes": applied.local_param_bytes(),
            "summary": applied.summary(), "checkpointed": checkpointed}


def _reshard(group) -> bool | int:
    """The effective reshard_after_forward of an FSDP param group (after lazy init)."""
    post = group.post_forward_mesh_info
    if post is None:
        return False
    if post.shard_mesh_size == group.mesh_info.shard_mesh_size:
        return True
    return post.shard_mesh_size


def zoo_plans(rank: int, world: int, cases: list[tuple[str, str, str]]) -> dict:
    """Apply each (case name, plan text, zoo builder) to a seeded CPU model and train it."""
    out = {}
    for case, text, builder in cases:
        torch.manual_seed(0)  # same init on every rank and in the reference
        model = zoo.ZOO[builder]()
        keys = list(model.state_dict().keys())
        applied = planc.apply(model, planc.loads(text, filename=case))
        clip = example_clip if case.endswith("+example-clip") else clip_grad_norm
        run = train(model, batches(model), rank, world, clip=clip)
        out[case] = {**run, **read_back(applied), "state_dict_keys_kept": list(model.state_dict().keys()) == keys}
    return out


def _snapshot(model: nn.Module) -> dict:
    """Everything `apply` could change: parameter objects and values, hooks, classes."""
    return {
        "params": {n: (id(p), p.detach().clone()) for n, p in model.named_parameters()},
        "classes": {n: type(m) for n, m in model.named_modules()},
        "hooks": {n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                      len(m._backward_pre_hooks), len(m._state_dict_hooks)) for n, m in model.named_modules()},
        "forward": {n: m.forward for n, m in model.named_modules()},
    }


def _same(a: dict, b: dict) -> list[str]:
    diffs = []
    for n, (pid, value) in a["params"].items():
        if n not in b["params"] or b["params"][n][0] != pid or not torch.equal(b["params"][n][1], value):
            diffs.append(f"param {n}")
    for key in ("classes", "hooks"):
        diffs += [f"{key} {n}" for n in a[key] if a[key][n] != b[key].get(n)]
    diffs += [f"forward {n}" for n in a["forward"] if a["forward"][n] != b["forward"].get(n)]
    return diffs


def refusals(rank: int, world: int, cases: list[tuple[str, str, str, bool]]) -> dict:
    """Apply each bad (case, plan text, builder, pass a 1-D mesh) and check nothing changed."""
    from planc.backends.runtime import build_mesh
    from planc.resolve.mesh import Mesh

    out = {}
    for case, text, builder, pass_mesh in cases:
        torch.manual_seed(0)
        model = zoo.ZOO[builder]()
        before = _snapshot(model)
        mesh = build_mesh(Mesh.data_parallel(1, None)) if pass_mesh else None
        try:
            planc.apply(model, planc.loads(text, filename=case), mesh=mesh)
            codes, message = None, ""
        except planc.PlanError as err:
            codes, message = sorted(d.code for d in err.errors), str(err)
        out[case] = {"codes": codes, "message": message, "diffs": _same(before, _snapshot(model))}
    # Applying twice: the second call is refused and changes nothing of the sharded model.
    torch.manual_seed(0)
    model = zoo.gpt_tiny()
    text = open("plans/gpt.plan").read()
    planc.apply(model, planc.loads(text, filename="gpt.plan"))
    before = _snapshot(model)
    try:
        planc.apply(model, planc.loads(text, filename="gpt.plan"))
        codes, message = None, ""
    except planc.PlanError as err:
        codes, message = sorted(d.code for d in err.errors), str(err)
    after = _snapshot(model)
    loss = next_token_loss(model, batches(model, 1)[0]).item()  # still a working sharded model
    out["twice"] = {"codes": codes, "message": message, "diffs": _same(before, after), "loss": loss}
    return out


def meta_flow(rank: int, world: int, plan_path: str, builder: str) -> dict:
    """Build on meta, apply, materialise on CPU, train: the large-model flow."""
    with torch.device("meta"):
        model = zoo.ZOO[builder]()
    applied = planc.apply(model, plan_path)
    on_meta = all(p.device.type == "meta" for p in model.parameters())
    torch.manual_seed(0)
    planc.materialize(model, "cpu")
    finite = all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())
    tied = model.wte.weight is model.lm_head.weight if hasattr(model, "wte") else None
    # The tie's first owner (nn.Embedding: N(0, 1)) initialises it, not lm_head's Linear init.
    wte_std = model.wte.weight.to_local().std().item() if hasattr(model, "wte") else None
    # `reproducible=True`: every module initialised at full size, each rank keeps its shard: the
    # values of the same call on the unsharded model (GPT: the root's own init of the tie included)
    with torch.device("meta"):
        exact, unsharded = zoo.ZOO[builder](), zoo.ZOO[builder]()
    planc.apply(exact, plan_path)
    torch.manual_seed(0)
    planc.materialize(exact, "cpu", reproducible=True)
    torch.manual_seed(0)
    planc.materialize(unsharded, "cpu")
    reference = dict(unsharded.named_parameters())
    not_eager = [n for n, p in exact.named_parameters() if not torch.equal(p.full_tensor(), reference[n])]
    run = train(model, batches(model), rank, world)
    return {**run, **read_back(applied), "on_meta_after_apply": on_meta, "finite": finite, "tied": tied,
            "wte_std": wte_std, "reproducible_not_eager": not_eager,
            "reproducible_tied": exact.wte.weight is exact.lm_head.weight if hasattr(exact, "wte") else None}


def edges(rank: int, world: int, bad: list[tuple[str, str, str, bool]], plan_path: str, builder: str) -> dict:
    """`refusals` and `meta_flow` in one launch (each launch costs seconds of imports)."""
    return {"refusals": refusals(rank, world, bad), "meta": meta_flow(rank, world, plan_path, builder)}
