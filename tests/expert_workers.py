"""Worker bodies of tests/test_expert_dist.py (module level, so spawned ranks can import them)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

PLAN = """model planc.zoo:routed_moe_tiny
mesh (shard = *, expert = 2)
unit layers.*
parallel layers.*.moe.experts expert
"""


def _batches(steps: int, world: int, per_rank: int = 2, seq: int = 8):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (world * per_rank, seq + 1), generator=g) for _ in range(steps)]


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    logits = getattr(logits, "logits", logits)  # a Hugging Face output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


CLIP = 0.5  # below the tiny model's gradient norms: clipping changes every step


def _reference(model, batches, lr):
    """One process, the whole batch: losses, the first step's gradients (before clipping) and
    norm, the final parameters; foreach AdamW, gradients clipped to `CLIP`."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
    losses, grads = [], None
    for tokens in batches:
        opt.zero_grad()
        loss = _loss(model, tokens)
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        grads.setdefault("norm", norm.item())
        opt.step()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _gather_experts(name, local, mesh):
    """The whole [E, ...] tensor from each expert rank's slice (in expert-rank order)."""
    parts = [torch.empty_like(local) for _ in range(mesh.size())]
    dist.all_gather(parts, local.contiguous(), group=mesh.get_group())
    return torch.cat(parts)


def expert_axis(applied):
    """The applied plan's expert-axis mesh (None without expert parallelism)."""
    if applied.expert_mesh is None:
        return None
    return applied.expert_mesh[applied.compiled.job.view("expert").axes[-1].name]


def apply_plan(model, plan: str, meta: bool, build):
    """`plan` applied through `planc.apply`; with `meta` to a new `build()` made on the meta device and
    then materialised (every expert initialised, each rank keeping its own). (model, applied, expert axis)."""
    import planc

    if meta:
        with torch.device("meta"):
            model = build()
    applied = planc.apply(model, planc.loads(plan))
    if meta:
        torch.manual_seed(0)
        planc.materialize(model, "cpu", reproducible=True)
    return model, applied, expert_axis(applied)


def whole(name: str, t, ep_mesh):
    """`t` (parameter `name` or its gradient) as one process holds it: a DTensor made full, an
    expert's slice gathered over `ep_mesh` (the expert axis)."""
    t = _full(t)
    return _gather_experts(name, t, ep_mesh) if ep_mesh is not None and ".experts." in name else t


def differences(model, reference: dict, ep_mesh, grad: bool = False) -> dict[str, float]:
    """Each parameter's (with `grad` its gradient's) largest absolute difference, made whole
    (`whole`), from `reference[name]`."""
    return {name: (whole(name, p.grad if grad else p.detach(), ep_mesh) - reference[name]).abs().max().item()
            for name, p in model.named_parameters()}


def _emitted(model, plan: str):
    """The model sharded by the code `planc emit` prints for `plan`; (expert axis mesh, dp rank, dp size, clip)."""
    import planc
    from planc.backends import experts
    from planc.backends.emit import emit_python
    from planc.backends.runtime import build_mesh

    compiled = planc.compile(planc.loads(plan), model, dist.get_world_size())
    namespace: dict = {}
    exec(compile(emit_python(compiled), "<emitted>", "exec"), namespace)
    mesh = build_mesh(compiled.mesh)
    namespace["apply_plan"](model, mesh)
    ep_mesh = experts.expert_mesh_of(mesh, 2, ("efsdp", "expert"))["expert"]
    return ep_mesh, dist.get_rank(), dist.get_world_size(), lambda: experts.clip_grad_norm_(
        model.parameters(), CLIP, ep_mesh)


def _tiny(experts: int):
    import dataclasses

    from planc.zoo.routed import ROUTED_MOE_TINY_CONFIG, RoutedMoETransformer

    return RoutedMoETransformer(dataclasses.replace(ROUTED_MOE_TINY_CONFIG, num_experts=experts))


def train_equal(rank: int, world: int, plan: str, steps: int = 3, lr: float = 1e-2, emitted: bool = False,
                meta: bool = False, experts: int = 4) -> dict:
    """The plan's 3 AdamW steps vs one process: per-step loss, first-step gradients, final
    parameters (max abs differences), and how many tokens each expert rank received; through
    `planc.apply` (on a model built on meta and materialised: `meta`), or through the code
    `planc emit` prints (`emitted`); the tiny routed MoE with `experts` experts."""

    torch.manual_seed(0)
    model = _tiny(experts)
    ref = copy.deepcopy(model)
    batches = _batches(steps, world)
    ref_losses, ref_grads, ref_params = _reference(ref, batches, lr)
    if emitted:
        ep_mesh, r, n, clip = _emitted(model, plan)
    else:
        model, applied, ep_mesh = apply_plan(model, plan, meta, lambda: _tiny(experts))
        r, n = applied.data_parallel_rank()
        clip = lambda: applied.clip_grad_norm_(CLIP)  # noqa: E731
    counts = []  # rows per global expert reaching layers.0's experts on this rank, per step
    model.layers[0].moe.experts.register_forward_pre_hook(
        lambda m, args: counts.append(torch.diff(args[1], prepend=args[1].new_zeros(1)).tolist()))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
    loss_diff, grad_diff, facts = [], {}, {}
    for step, tokens in enumerate(batches):
        opt.zero_grad()
        mine = tokens.chunk(n)[r]
        loss = _loss(model, mine)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        loss_diff.append(abs(total.item() / world - ref_losses[step]))
        if step == 0:
            grad_diff = differences(model, ref_grads, ep_mesh, grad=True)
            try:  # the fact: torch's clipping refuses parameters on two meshes
                torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
                facts["torch_clip"] = "ran"
            except RuntimeError as err:
                facts["torch_clip"] = str(err).splitlines()[0]
        norm = clip()
        if step == 0:
            facts["norm_diff"] = abs(norm.item() - ref_grads["norm"])
        opt.step()
    param_diff = differences(model, ref_params, ep_mesh)
    groups = {len(m._get_fsdp_state()._fsdp_param_groups) for m in model.layers}
    return {"loss": max(loss_diff), "grad": max(grad_diff.values()), "param": max(param_diff.values()),
            "counts": counts, "facts": facts, "groups": groups,
            "grads": len(grad_diff), "placements": {n: str(p.device_mesh.mesh_dim_names) + str(p.placements)
                                                    for n, p in model.named_parameters()}}


def train_both(rank: int, world: int, plan: str) -> list[dict]:
    """`train_equal` through `planc.apply`, through the emitted code, on meta then
    `planc.materialize(reproducible=True)`, and with 2 experts (efsdp 2 x expert 2 > 2 experts:
    FSDP shards the experts on dim 1), and under HSDP (replicate 2 x shard 2, expert 2: the experts
    on the (replicate, efsdp) mesh), in one launch."""
    return [train_equal(rank, world, plan), train_equal(rank, world, plan, emitted=True),
            train_equal(rank, world, plan, meta=True), train_equal(rank, world, plan, experts=2),
            train_equal(rank, world, plan.replace("mesh (shard = *", "mesh (replicate = 2, shard = *"))]


DENSE_PLAN = """model planc.zoo:routed_moe_tiny
unit layers.*
"""


def _model_with(plan: str, seed: int):
    import planc
    from planc.zoo import routed_moe_tiny

    torch.manual_seed(seed)
    model = routed_moe_tiny()
    applied = planc.apply(model, planc.loads(plan))
    return model, applied


def _whole(model, applied) -> dict:
    """Every parameter whole (experts gathered over the expert axis when expert-parallel)."""
    return {name: whole(name, p.detach(), expert_axis(applied)) for name, p in model.named_parameters()}


def dcp_round_trip(rank: int, world: int, folder: str) -> dict:
    """Save under expert parallelism, load into plain FSDP (other initial values), save that,
    load into expert parallelism again: max abs difference to the saved values at each end."""
    from planc.zoo import routed_moe_tiny

    return round_trip(routed_moe_tiny, _model_with, PLAN, DENSE_PLAN, folder)


def round_trip(build, model_with, plan: str, dense_plan: str, folder: str) -> dict:
    """The DCP round trip of `plan` through `dense_plan` and back, each model `model_with(plan,
    seed)` from other initial values: max abs difference to the first model's values (seed 0 of
    `build`) after loading into the dense model (`to_dense`) and back (`to_ep`), and of a fresh
    model that loaded nothing (`fresh`: the comparison can fail); the keys saved."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    saved = {n: p.detach().clone() for n, p in build().named_parameters()}

    def error(model, applied) -> float:
        return max((t - saved[n]).abs().max().item() for n, t in _whole(model, applied).items())

    first, _ = model_with(plan, 0)
    dcp.save(first.state_dict(), checkpoint_id=f"{folder}/ep")
    dense, dense_applied = model_with(dense_plan, 1)
    state = dense.state_dict()
    dcp.load(state, checkpoint_id=f"{folder}/ep")  # in place, into the local shards
    to_dense = error(dense, dense_applied)
    dcp.save(dense.state_dict(), checkpoint_id=f"{folder}/dense")
    back, back_applied = model_with(plan, 2)
    state = back.state_dict()
    dcp.load(state, checkpoint_id=f"{folder}/dense")
    return {"to_dense": to_dense, "to_ep": error(back, back_applied), "fresh": error(*model_with(plan, 3)),
            "keys": sorted(state)}


HF_PLAN = """mesh (shard = *, expert = 2)
unit model.layers.*
parallel model.layers.*.mlp.experts expert
"""


def hf_moe_tiny():
    """A Qwen3-MoE of Hugging Face's (fused 3-D experts, the token-choice layout), tiny: 4 experts, top-2."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                            tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(config)


def hf_train_equal(rank: int, world: int) -> dict:
    """The Hugging Face MoE tiny at expert 2: 3 clipped AdamW steps vs one process."""
    import planc

    torch.manual_seed(0)
    model = hf_moe_tiny()
    ref = copy.deepcopy(model)
    batches = _batches(3, world)
    ref_losses, ref_grads, ref_params = _reference(ref, batches, 1e-2)
    applied = planc.apply(model, planc.loads(HF_PLAN))
    ep_mesh = applied.expert_mesh["expert"]
    r, n = applied.data_parallel_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    diffs = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step, tokens in enumerate(batches):
        opt.zero_grad()
        loss = _loss(model, tokens.chunk(n)[r])
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        diffs["loss"] = max(diffs["loss"], abs(total.item() / world - ref_losses[step]))
        if step == 0:
            diffs["grad"] = max(differences(model, ref_grads, ep_mesh, grad=True).values())
        applied.clip_grad_norm_(CLIP)
        opt.step()
    diffs["param"] = max(differences(model, ref_params, ep_mesh).values())
    return diffs


def train_two(rank: int, world: int, plan: str) -> list[dict]:
    """The 2-rank launch: `train_equal` on the zoo's routed MoE, then `hf_train_equal`, then the
    routed MoE with `checkpoint layers.*` (the dispatch's all-to-alls run again in the recompute)."""
    return [train_equal(rank, world, plan), hf_train_equal(rank, world),
            train_equal(rank, world, plan + "checkpoint layers.*\n")]


def dcp_optimizer(rank: int, world: int, folder: str) -> dict:
    """One AdamW step at expert 2, model and optimizer saved by DCP (the experts' moments viewed
    whole: `whole_optimizer_state`), loaded into plain FSDP (`set_state_dict`): the moments and
    parameters equal one process's after the same step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from planc.backends.experts import whole_optimizer_state
    from planc.zoo import routed_moe_tiny

    tokens = _batches(1, world)[0]
    torch.manual_seed(0)
    ref = routed_moe_tiny()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _loss(ref, tokens).backward()
    ref_opt.step()
    want = {n: ref_opt.state[p]["exp_avg"] for n, p in ref.named_parameters()}

    def step(model, applied):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        r, n = applied.data_parallel_rank()
        _loss(model, tokens.chunk(n)[r]).backward()
        opt.step()
        return opt

    ep_model, ep_applied = _model_with(PLAN, 0)
    ep_opt = step(ep_model, ep_applied)
    model_state, optim_state = get_state_dict(ep_model, ep_opt)
    dcp.save({"model": model_state, "optim": whole_optimizer_state(ep_model, optim_state)},
             checkpoint_id=f"{folder}/ep")
    dense, dense_applied = _model_with(DENSE_PLAN, 1)
    dense_opt = step(dense, dense_applied)  # its own state, overwritten by the load
    before = {n: _full(dense_opt.state[p]["exp_avg"]) for n, p in dense.named_parameters()}
    model_state, optim_state = get_state_dict(dense, dense_opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=f"{folder}/ep")
    set_state_dict(dense, dense_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = {n: _full(dense_opt.state[p]["exp_avg"]) for n, p in dense.named_parameters()}
    return {"moments": max((got[n] - want[n]).abs().max().item() for n in want),
            "before": max((before[n] - want[n]).abs().max().item() for n in want),
            "params": max((t - ref.state_dict()[n]).abs().max().item() for n, t in _whole(dense, dense_applied).items()),
            "scale": max(v.abs().max().item() for v in want.values())}
