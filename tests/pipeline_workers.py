"""Rank bodies for tests/test_pipeline_dist.py: pipeline plans trained through `planc.apply`.

Each plan is written without a pipeline and given one (`pipeline_plan`: a pipeline axis
outermost, the schedule, `stage` lines), compiled and lowered as any plan. The oracle is one unsharded
process (the same seed, the same global batch, the same microbatches and loss reduction),
computed on every rank; a second oracle is hand-written torchtitan-style code: the same
split, `PipelineStage`s and schedule without planc.
"""

from __future__ import annotations

import torch
import tp_rules
from torch import nn
from torch.distributed.tensor import DTensor

import planc
from planc.lower.schedules import SINGLE_STAGE
from planc.zoo import llama_tiny

FSDP_PLAN = """model planc.zoo:llama_tiny
mesh (shard = *)
unit tok_embeddings
unit layers.*
unit [norm, output]
"""

TP_PLAN = ("model planc.zoo:llama_tiny\nmesh (shard = *, tensor = 2)\n" + tp_rules.ATTENTION + tp_rules.FEED_FORWARD
           + tp_rules.head("output replicate"))

ONE_STAGE = [("tok_embeddings", "layers.0"), ("layers.1", "norm", "output")]  # per rank: GPipe, 1F1B
TWO_STAGES = [("tok_embeddings",), ("layers.0",), ("layers.1",), ("norm", "output")]  # the others
STEPS, MICROBATCHES, BATCH, SEQ, LR = 3, 4, 8, 8, 1e-2


def hf_llama_tiny() -> nn.Module:
    """A tiny Hugging Face Llama (the pass-through split of its decoder, tests/test_stages.py)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


HF_PLAN = "mesh (shard = *)\nunit model.layers.*\n"
HF_STAGES = [("model.embed_tokens", "model.layers.0"), ("model.layers.1", "model.norm", "lm_head")]


def pipeline_plan(plan: str, name: str, pp: int, microbatches: int, cut=None) -> str:
    """`plan` (written without a pipeline) with a pipeline axis of `pp` outermost, torch's schedule
    `name` and `stage` lines for `cut` (one stage per rank for GPipe and 1F1B, two otherwise)."""
    cut = cut or (ONE_STAGE if name in SINGLE_STAGE else TWO_STAGES)
    per_rank = "" if name in SINGLE_STAGE else ", stages_per_rank = 2"
    lines = [f"pipeline {name} {{ microbatches {microbatches}{per_rank} }}"]
    lines += [f"stage {i}: " + ", ".join(modules) for i, modules in enumerate(cut)]
    return plan.replace("mesh (shard = *", f"mesh (pipeline = {pp}, shard = *") + "\n".join(lines) + "\n"


def pipeline_compiled(plan: str, model: nn.Module, world: int, name: str, pp: int, microbatches: int, cut=None):
    """The pipeline plan (`pipeline_plan`) compiled against `model` at `world`: what `planc.apply` runs."""
    compiled = planc.compile(planc.loads(pipeline_plan(plan, name, pp, microbatches, cut), filename="pp.plan"),
                             model, world)
    compiled.raise_for_errors()
    assert len(compiled.job.parts) == len(cut or (ONE_STAGE if name in SINGLE_STAGE else TWO_STAGES))
    return compiled


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def batches(dp: int):
    """Per step, the global batch (dp x BATCH sequences): tokens and next-token labels."""
    g = torch.Generator().manual_seed(7)
    vocab = llama_tiny().config.vocab_size
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (dp * BATCH, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out.logits


def reference(dp: int, microbatches: int, build=llama_tiny):
    """One process, the whole global batch: per step the mean over data-parallel slices and
    microbatches of `loss_fn`; returns (per step: per dp slice loss, grads), final params, and
    per step the total gradient norm."""
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads, norms = [], [], []
    for tokens, labels in batches(dp):
        per_slice = []
        total = 0.0
        for x, y in zip(tokens.chunk(dp), labels.chunk(dp)):
            mb = [loss_fn(_logits(model(a)), b) for a, b in zip(x.chunk(microbatches), y.chunk(microbatches))]
            per_slice.append(torch.stack(mb).mean().item())
            total = total + sum(mb) / (microbatches * dp)
        total.backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        losses.append(per_slice)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _whole(applied, name: str, t: torch.Tensor) -> torch.Tensor:
    """`_full(t)` of parameter `name` (or its gradient); of an expert-parallel experts container,
    all experts: each expert rank's, gathered over the stage's expert axis in rank order."""
    import torch.distributed as dist

    from planc.backends.experts import EXPERT_SLICE

    local = _full(t)
    if not hasattr(applied.model.get_submodule(name.rpartition(".")[0]), EXPERT_SLICE):
        return local
    axis = applied.expert_mesh[applied.compiled.job.view("expert").axes[-1].name]
    parts = [torch.empty_like(local) for _ in range(axis.size())]
    dist.all_gather(parts, local.contiguous(), group=axis.get_group())
    return torch.cat(parts)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def train(rank: int, world: int, plan: str, name: str, pp: int, build=llama_tiny, cut=None) -> dict:
    """Train the zoo Llama tiny 3 AdamW steps under `plan` cut for schedule `name`; compare with one process."""
    torch.manual_seed(0)
    model = build()
    compiled = pipeline_compiled(plan, model, world, name, pp, MICROBATCHES, cut)
    applied = planc.apply(model, compiled)
    dp_rank, dp = applied.data_parallel_rank()
    ref_losses, ref_grads, ref_params, ref_norms = reference(dp, MICROBATCHES, build)
    opt = torch.optim.AdamW(applied.parameters(), lr=LR)
    norms = []
    losses, grad_err, worst = [], [0.0] * STEPS, [None] * STEPS
    for step, (tokens, labels) in enumerate(batches(dp)):
        x, y = tokens.chunk(dp)[dp_rank], labels.chunk(dp)[dp_rank]
        loss = applied.step(x, y, lambda out, target: loss_fn(out, target))  # a new function each step
        if loss is not None:
            losses.append((loss.item(), ref_losses[step][dp_rank]))
        for n, p in applied.named_parameters():
            err = _rel(_whole(applied, n, p.grad), ref_grads[step][n])
            if err > grad_err[step]:
                grad_err[step], worst[step] = err, n
        norms.append((applied.clip_grad_norm_(float("inf")).item(), ref_norms[step]))  # the norm only: no clipping
        opt.step()
        opt.zero_grad()
    params = {n: _whole(applied, n, p.detach()) for n, p in applied.named_parameters()}
    return {"holds_loss": applied.holds_loss, "bytes": applied.local_param_bytes(), "norms": norms,
            "loss_rank": applied.loss_pipeline_rank, "losses": losses,
            "grad_err": grad_err, "worst": worst, "names": sorted(params), "params": params, "stages": applied.stage_ids,
            "param_err": max(_rel(p, ref_params[n]) for n, p in params.items())}


def handwritten(rank: int, world: int, name: str, pp: int) -> dict:
    """torchtitan-style code without planc: deep-copy the model per stage, delete what is outside
    it, `PipelineStage` + the schedule class; 3 AdamW steps. Returns losses and params per stage."""
    import copy

    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    torch.manual_seed(0)
    whole = llama_tiny()
    single = name in SINGLE_STAGE
    cut = ONE_STAGE if single else TWO_STAGES
    held = [rank] if single else ([rank, 2 * pp - 1 - rank] if name in ("ZBVZeroBubble", "DualPipeV")
                                  else [rank, rank + pp])
    modules, pstages = [], []
    for s in held:
        part = copy.deepcopy(whole)
        keep = cut[s]
        for child in ("tok_embeddings", "norm", "output"):
            if child not in keep:
                setattr(part, child, nn.Identity())
        for i in range(len(part.layers)):
            if f"layers.{i}" not in keep:
                part.layers[i] = nn.Identity()
        modules.append(part)
        pstages.append(PipelineStage(part, s, len(cut), torch.device("cpu")))
    sched = get_schedule_class(name)(pstages[0] if single else pstages, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    return _train_stages(modules, sched, held, len(cut))


def _train_stages(modules, sched, held, n_stages):
    """3 AdamW steps of a hand-built (or emitted) pipeline on the global batch of one dp rank."""
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=LR)
    losses = []
    for tokens, labels in batches(1):
        out: list = []
        first, last = 0 in held, n_stages - 1 in held
        sched.step(*((tokens,) if first else ()), **({"target": labels, "losses": out} if last else {}))
        if last:
            losses.append(torch.stack([v.detach() for v in out]).mean())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": {n: _full(p.detach()) for m in modules for n, p in m.named_parameters()}}


def emitted(rank: int, world: int, name: str, pp: int, plan: str = FSDP_PLAN, build=llama_tiny, cut=None) -> dict:
    """The code `planc emit` prints for the job, executed: its `build_pipeline`, 3 AdamW steps
    (every data-parallel rank on the same batch, `batches(1)`)."""
    from planc.backends.emit import emit_python
    from planc.backends.runtime import build_mesh

    with torch.device("meta"):
        shape = build()
    compiled = pipeline_compiled(plan, shape, world, name, pp, MICROBATCHES, cut)
    namespace: dict = {}
    exec(compile(emit_python(compiled), "emitted.py", "exec"), namespace)  # noqa: S102 - the code under test
    torch.manual_seed(0)
    model = build()
    mesh = build_mesh(compiled.job.mesh)
    modules, sched = namespace["build_pipeline"](model, mesh, loss_fn)
    held = namespace["HELD"][mesh["pipeline"].get_local_rank()]
    return _train_stages(modules, sched, held, len(namespace["STAGES"]))


ONE_D_PLAN = "model planc.zoo:llama_tiny\nmesh (shard = *)\nunit layers.*\n"


def _gather_full(named) -> dict:
    """Every rank's {name: full tensor} of `named`, merged (each pipeline rank adds its stages)."""
    import torch.distributed as dist

    mine = {n: _full(t.detach()).clone() for n, t in named}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {n: t for part in every for n, t in part.items()}


def meta_and_checkpoint(rank: int, world: int, directory: str) -> dict:
    """Built on meta, applied (1F1B) and materialized per stage; one step; a DCP checkpoint of the
    stages loaded under a 1-D FSDP plan, and one saved under that plan loaded back under the pipeline."""
    import torch.distributed.checkpoint as dcp

    with torch.device("meta"):
        model = llama_tiny()
    applied = planc.apply(model, pipeline_compiled(FSDP_PLAN, model, world, "1F1B", 2, MICROBATCHES))
    assert planc.materialize(applied, "cpu") is applied
    out = {"stage_meta": any(p.is_meta for p in applied.parameters()),
           "finite": all(torch.isfinite(_full(p)).all().item() for p in applied.parameters()),
           "others_meta": [n for n, p in model.named_parameters() if n not in dict(applied.named_parameters())
                           and not p.is_meta]}
    out["summary"] = applied.summary()
    tokens, labels = batches(1)[0]
    loss = applied.step(tokens, labels, loss_fn)
    out["loss"] = None if loss is None else loss.item()
    torch.optim.AdamW(applied.parameters(), lr=LR).step()
    dcp.save(applied.state_dict(), checkpoint_id=f"{directory}/pp")
    pipelined = _gather_full(applied.named_parameters())
    one_d = llama_tiny()
    plain = planc.apply(one_d, planc.loads(ONE_D_PLAN, filename="one_d.plan"))
    state = one_d.state_dict()
    dcp.load(state, checkpoint_id=f"{directory}/pp")
    one_d.load_state_dict(state)
    loaded = _gather_full(one_d.named_parameters())
    out["pp_to_1d"] = sorted(pipelined) == sorted(loaded) and all(torch.equal(pipelined[n], loaded[n]) for n in loaded)
    with torch.no_grad():  # change every value, save under the 1-D plan, load back under the pipeline
        for p in one_d.parameters():
            p.mul_(0.5).add_(0.25)
    dcp.save(one_d.state_dict(), checkpoint_id=f"{directory}/one_d")
    changed = _gather_full(one_d.named_parameters())
    fresh = llama_tiny()
    again = planc.apply(fresh, pipeline_compiled(FSDP_PLAN, fresh, world, "1F1B", 2, MICROBATCHES))
    state = again.state_dict()
    dcp.load(state, checkpoint_id=f"{directory}/one_d")
    again.load_state_dict(state)
    back = _gather_full(again.named_parameters())
    out["1d_to_pp"] = sorted(back) == sorted(changed) and all(torch.equal(back[n], changed[n]) for n in back)
    out["changed"] = not torch.equal(changed["output.weight"], loaded["output.weight"])
    del plain
    return out


def without_pipeline(rank: int, world: int) -> dict:
    """`AppliedPlan.step` of a plan without a pipeline (`step { accumulate 4 }`, 1-D FSDP): the
    same loop, every rank holding the loss; 3 AdamW steps against one process."""
    torch.manual_seed(0)
    model = llama_tiny()
    applied = planc.apply(model, planc.loads(FSDP_PLAN + f"step {{ accumulate {MICROBATCHES} }}\n", filename="a.plan"))
    dp_rank, dp = applied.data_parallel_rank()
    ref_losses, ref_grads, _, _ = reference(dp, MICROBATCHES)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grad_err = [], 0.0
    for step, (tokens, labels) in enumerate(batches(dp)):
        loss = applied.step(tokens.chunk(dp)[dp_rank], labels.chunk(dp)[dp_rank], loss_fn)
        losses.append((loss.item(), ref_losses[step][dp_rank]))
        grad_err = max(grad_err, max(_rel(_full(p.grad), ref_grads[step][n]) for n, p in model.named_parameters()))
        opt.step()
        opt.zero_grad()
    return {"holds_loss": applied.holds_loss, "losses": losses, "grad_err": grad_err}


def launch_two(rank: int, world: int, directory: str) -> dict:
    from torch.distributed.pipelining.schedules import get_schedule_class  # noqa: F401 - fail early without it

    from planc.lower.schedules import SCHEDULES

    out = {}
    for name in SCHEDULES:
        out[name] = train(rank, world, FSDP_PLAN, name, 2)
    for name in ("1F1B", "Interleaved1F1B", "DualPipeV"):
        out[("handwritten", name)] = handwritten(rank, world, name, 2)
        out[("emitted", name)] = emitted(rank, world, name, 2)
    out["meta_and_checkpoint"] = meta_and_checkpoint(rank, world, directory)
    out["without_pipeline"] = without_pipeline(rank, world)
    out["checkpoint"] = train(rank, world, FSDP_PLAN + "checkpoint layers.* full\n", "Interleaved1F1B", 2)
    out["hf"] = train(rank, world, HF_PLAN, "1F1B", 2, hf_llama_tiny, HF_STAGES)
    return out


def launch_four(rank: int, world: int) -> dict:
    out = {}
    for name in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
        out[("fsdp", name)] = train(rank, world, FSDP_PLAN, name, 2)
    out[("tp", "1F1B")] = train(rank, world, TP_PLAN, "1F1B", 2)
    out[("tp", "loss_parallel")] = train(rank, world, TP_PLAN.replace("output replicate", "loss_parallel"), "1F1B", 2)
    return out
