"""Rank bodies for tests/test_torchtitan_dist.py: torchtitan's recipe against `planc.apply`.

For each case (precision, tied or not, eager or meta flow) one rank builds torchtitan's Llama
3 debug model twice from the same seed: once sharded by torchtitan's own
`apply_fsdp_to_decoder` (as its trainer calls it: bf16 or fp32 params, fp32 reduce, default
reshard policy, no pipeline parallelism) and once by `planc.apply` with the shipped plan, and
nothing else. Both train 3 steps as torchtitan's trainer does: each rank its own tokens, loss
= summed cross-entropy over fp32 logits / the global token count, `clip_grad_norm_(1.0)`,
AdamW. The only line added on torchtitan's side: `set_force_sum_reduction_for_comms(True)`,
as gloo refuses the PREMUL_SUM that `gradient_divide_factor = 1.0` asks for (the same numbers;
docs/fsdp2-facts.md). The eager flow builds and initialises on the CPU, then shards; the meta
flow builds on meta, shards, then allocates and initialises (torchtitan: `to_empty` +
`init_weights(buffer_device=None)`; planc: `planc.materialize(model, "cpu")`).
"""

from __future__ import annotations

import pathlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

import planc
from planc.model.torchtitan import llama3

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS, BATCH, SEQ, SEQ_CAP = 3, 2, 16, 64
FP32 = "defaults { precision param = fp32, reduce = fp32 }\n"


REDUCTION = "  reduction divide_factor = 1.0, force_sum = true\n"


def plan_text(tied: bool, dtype: str, reduction: bool = True) -> str:
    """The shipped plan (fp32: with a `defaults` line after it; `reduction=False`: without
    its gradient reduction line, to show what that line is for)."""
    name = "torchtitan_llama3_tied.plan" if tied else "torchtitan_llama3.plan"
    text = (ROOT / "plans" / name).read_text()
    assert REDUCTION in text
    return (text if reduction else text.replace(REDUCTION, "")) + (FP32 if dtype == "fp32" else "")


def _build(tied: bool, flow: str):
    torch.manual_seed(0)
    if flow == "meta":
        with torch.device("meta"):
            return llama3("debugmodel", tied=tied, max_seq_len=SEQ_CAP)
    model = llama3("debugmodel", tied=tied, max_seq_len=SEQ_CAP)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def reference(tied: bool, dtype: str, flow: str):
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    model = _build(tied, flow)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
                          reduce_dtype=torch.float32, pp_enabled=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM (same numbers)
    if flow == "meta":
        torch.manual_seed(1)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=None)
    return model


def with_planc(tied: bool, dtype: str, flow: str, reduction: bool = True):
    model = _build(tied, flow)
    planc.apply(model, planc.loads(plan_text(tied, dtype, reduction), filename="plan"))
    if flow == "meta":
        torch.manual_seed(1)
        planc.materialize(model, "cpu")
    return model


def units(model) -> list[dict]:
    """What each FSDP unit is: modules, parameters with placements and local shapes, policy."""
    names = {id(m): n for n, m in model.named_modules()}
    pnames = {id(p): n for n, p in model.named_parameters()}
    out, seen = [], set()
    for m in model.modules():
        if not isinstance(m, FSDPModule) or id(m._get_fsdp_state()) in seen:
            continue  # a group unit's modules share one state
        state = m._get_fsdp_state()
        seen.add(id(state))
        unit = {"modules": sorted(names[id(x)] for x in state._modules), "params": []}
        for group in state._fsdp_param_groups:  # none for a unit without parameters (the root here)
            mp = group.mp_policy
            unit.update({
                "params": [(pnames[id(fp.sharded_param)], str(fp.sharded_param.placements),
                            tuple(fp.sharded_param.to_local().shape)) for fp in group.fsdp_params],
                "reshard": group.post_forward_mesh_info is not None,
                "mp": (mp.param_dtype, mp.reduce_dtype, mp.output_dtype, mp.cast_forward_inputs),
                "divide": group.gradient_divide_factor, "force_sum": group.force_sum_reduction_for_comms,
            })
        out.append(unit)
    return sorted(out, key=lambda u: u["modules"])


def train(model, rank: int) -> list[str]:
    """torchtitan's step; the global loss of each step in hex."""
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, weight_decay=0.1, foreach=True)
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=gen)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        tokens_here = torch.tensor(float(labels.numel()))
        global_tokens = tokens_here.clone()
        dist.all_reduce(global_tokens)
        pred = model(inputs)
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1),
                                                 reduction="sum") / global_tokens
        del pred
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        out.append(total.item().hex())
    return out


def parity(rank: int, world: int, cases: list[tuple[bool, str, str]], reduction: bool = True) -> list[dict]:
    torch.set_num_threads(1)
    results = []
    for tied, dtype, flow in cases:
        row = {"case": (tied, dtype, flow)}
        for side, make in (("torchtitan", reference), ("planc", lambda *c: with_planc(*c, reduction=reduction))):
            model = make(tied, dtype, flow)
            row[side] = {"units": units(model), "losses": train(model, rank)}
        results.append(row)
    return results
