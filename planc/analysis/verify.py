"""`planc check --verify`: a plan's training steps on real processes, against one unsharded process.

The shape simulation (`check --simulate`) proves that a plan runs; this proves that it trains
the function the model computes. A small twin of the model (`twin_reference`: the zoo model's
tiny variant, the Hugging Face config's tiny sibling, or a factory the user names) is built
with one seed on every rank and in the reference; the plan is applied for real on local gloo
processes at the smallest world that keeps every axis of its mesh > 1 (`simulation_world`:
the fixed axes, 2 ranks for the `*` one, 1 when 2 do not fit); every rank trains `STEPS` AdamW steps on its slice
of the same global batches (ranks of one tensor group take the same slice), through the
plan's own step (`applied.accumulate`, `applied.loss_parallel`), and the losses, every
gradient (before each optimizer step) and the updated parameters are compared with one
process training the unsharded twin on the whole batches.

Why real processes: torch 2.13's `LocalTensorMode` simulates tensor parallelism in one
process but not FSDP2 (its hooks and collectives need a process group), and a fake process
group computes nothing. Why fp32: the comparison must see errors of 1e-3 (a fused projection
split across parts moves the loss by 8.6e-4) that bf16 round-off would hide, so every unit's
mixed-precision policy is replaced by fp32 for the run (what is verified is the sharding, not
the precision). Dropout is turned off in both runs (each process would draw other masks).
AdamW runs with `eps = 1e-3`: Adam moves a parameter by about the learning
rate whatever the size of its gradient, so a gradient that is zero but for round-off (an
attention key bias) would move by round-off-sized noise times lr / eps; the larger eps keeps
the comparison of updated parameters meaningful while exercising the same optimizer code.

A mismatch is a located diagnostic (P425) on the rule whose modules' gradients differ: the
`parallel` line that styles the module (or its nearest styled ancestor), else the `unit` that
shards it; with the worst error and what that rule does to the gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from planc.analysis.launch import LaunchError, launch
from planc.diagnostics import Diagnostic
from planc.resolve.mesh import Role
from planc.resolve.styles import STYLES

STEPS = 2
LR = 1e-2
EPS = 1e-3
ATOL, RTOL = 1e-5, 1e-4   # |sharded - one process| <= ATOL + RTOL * max|one process|, per tensor
MAX_PROCESSES = 4         # what this kind of machine runs at once (2 cores)
SEQ = 16

# Shipped Hugging Face configs and their small twins (planc/model/configs/).
HF_TWINS = {"llama-3-8b": "llama-tiny", "mixtral-8x7b": "mixtral-tiny", "gpt2": "gpt2-tiny",
            "bert-base": "bert-tiny", "t5-base": "t5-tiny"}

class VerifyError(Exception):
    """The plan cannot be verified here (no twin, too many processes, a model that does not run)."""


@dataclass
class Mismatch:
    param: str
    error: float        # max |sharded - one process|
    scale: float        # max |one process|
    what: str           # "gradient (step 1)", "parameter after step 2", "loss (step 1)"
    step: float = 0     # when it shows: a step's loss and gradients at `step`, the updated parameters after


@dataclass
class Verdict:
    """What `verify` compared and found."""

    world: int
    sizes: dict[str, int]
    twin: str
    compared: int                       # tensors compared (losses, gradients, parameters)
    mismatches: list[Mismatch] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    first_output: tuple[str, float] | None = None  # the first module whose forward output differs, its error
    stage_of: dict[str, int] = field(default_factory=dict)  # a pipeline plan: each parameter's stage on the twin

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def summary(self) -> str:
        mesh = " x ".join(f"{k} {v}" for k, v in self.sizes.items() if v > 1) or "1 rank"
        return (f"verified at {self.world} ranks ({mesh}) against one process on `{self.twin}`: {STEPS} AdamW steps, "
                f"{self.compared} losses, gradients and parameters within {ATOL:g} + {RTOL:g} x max, fp32"
                + "".join(f"; {note}" for note in self.notes))


# ===================================================================== the twin


def twin_reference(ref: str, base: str | None = None, folder: str | None = None) -> str:
    """The small model a plan for `ref` is verified on (the same module tree, names, heads and tying):
    a shipped tiny sibling, else (a Hugging Face config) the config shrunk by `shrink_config`, written
    into `folder`; a zoo model's `_tiny` variant; any other reference as it is."""
    from planc import zoo

    if ref.startswith("hf:"):
        from planc.model.hf import config_path, shipped_configs

        name = ref[3:]
        twin = HF_TWINS.get(name) or (name if name.endswith("-tiny") else None)
        if twin is None and f"{name}-tiny" in shipped_configs():
            twin = f"{name}-tiny"
        if twin is not None:
            return f"hf:{twin}"
        if folder is None:
            raise VerifyError(f"no small twin of `{ref}` is shipped: pass --verify-model MODULE:FN, a factory of a "
                              "small model with the same module names, head counts and tying")
        try:
            raw = json.loads(config_path(name, base).read_text(encoding="utf-8"))
        except Exception as err:  # the plan's own check already said what is wrong with the config
            raise VerifyError(f"cannot read the config of `{ref}`: {err}") from err
        path = os.path.join(folder, "config.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(shrink_config(raw), f)
        return f"hf:{path}"
    if ref.startswith("planc.zoo:"):
        name = ref.split(":", 1)[1]
        return ref if name.endswith("_tiny") or f"{name}_tiny" not in zoo.ZOO else f"planc.zoo:{name}_tiny"
    return ref  # a factory the user named (or torchtitan's debug model): taken as it is


# Width fields a twin shrinks (head counts, experts, tying and the module tree are kept).
HIDDEN = ("hidden_size", "n_embd", "d_model", "dim")
HEADS = ("num_attention_heads", "n_head", "num_heads")
FFN = ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "moe_intermediate_size", "shared_expert_intermediate_size",
       "encoder_ffn_dim", "decoder_ffn_dim")
TWIN_HEAD_DIM, TWIN_LAYERS, TWIN_VOCAB = 16, 2, 256


def shrink_config(raw: dict) -> dict:
    """A Hugging Face config's small twin: 2 layers of each kind, heads of 16 features (the head and
    key/value-head counts, experts, top-k, tying and architecture kept), feed-forward widths twice the
    hidden size, a vocabulary of 256: every size a tensor degree of 2 or 4 divides where the original's does."""
    from planc.model.hf import LAYER_FIELDS

    out = dict(raw)
    heads = next((raw[k] for k in HEADS if isinstance(raw.get(k), int)), None)
    hidden = heads * TWIN_HEAD_DIM if heads else 64
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if key in LAYER_FIELDS:
            out[key] = min(value, TWIN_LAYERS)
        elif key in HIDDEN:
            out[key] = hidden
        elif key in FFN:
            out[key] = 2 * hidden
        elif key in ("head_dim", "d_kv"):
            out[key] = TWIN_HEAD_DIM
        elif key == "vocab_size":
            out[key] = TWIN_VOCAB
    return out


def _build(ref: str, base: str | None) -> nn.Module:
    from planc.model.build import build_model

    torch.manual_seed(0)
    model = build_model(ref, device="cpu", base=base)
    if hasattr(getattr(model, "config", None), "use_cache"):
        model.config.use_cache = False
    for module in model.modules():  # dropout draws other masks in every process: off, in both runs
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    return model.float()


def _batches(model: nn.Module, global_batch: int, seq: int) -> list[torch.Tensor]:
    from planc.estimate.trace import vocab_sizes

    vocab = min(vocab_sizes(model) or {64})
    gen = torch.Generator().manual_seed(1234)
    return [(torch.randint(0, vocab, (global_batch, 1), generator=gen) + torch.arange(seq)) % vocab
            for _ in range(STEPS)]


# ===================================================================== one training run


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()


def _train(model: nn.Module, data: list[torch.Tensor], steps_of, loss_context, microbatches: float,
           reduce_loss, forward=None, full=None) -> dict[str, Any]:
    """STEPS AdamW steps; `steps_of(batch)` yields the microbatches (1-tuples) of a step, `forward(model,
    tokens)` runs one and returns (output, labels); `full(name, tensor)` a parameter or gradient whole."""
    forward = forward or (lambda model, tokens: (_forward(model, tokens), tokens))
    full = full or (lambda name, t: _full(t))
    from planc.estimate.trace import Example, default_loss

    loss_fn = default_loss(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    out: dict[str, Any] = {"losses": [], "grads": [], "params": None, "outputs": {}}
    for batch in data:
        total = torch.zeros(())
        for (mb,) in steps_of(batch):
            if out["outputs"]:
                output, labels = forward(model, mb)
            else:  # the first forward: every module's output, to find where a wrong forward starts
                with _outputs(model, out["outputs"]):
                    output, labels = forward(model, mb)
            with loss_context():
                value = loss_fn(output, Example((labels,))) / microbatches
                value.backward()
            total += _full(value)
        out["grads"].append({n: full(n, p.grad) for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        out["losses"].append(reduce_loss(total))
    out["params"] = {n: full(n, p) for n, p in model.named_parameters()}
    return out


class _outputs:
    """Record each module's first floating-point output (whole: a DTensor gathered), in the order
    the modules finish their forward, into `into` (path -> tensor; insertion order is that order)."""

    def __init__(self, model: nn.Module, into: dict[str, torch.Tensor]):
        self.model, self.into, self.handles = model, into, []

    def __enter__(self):
        from torch.utils._pytree import tree_flatten

        def hook(path: str):
            def record(module, args, output):
                first = next((x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor)
                              and x.is_floating_point()), None)
                if first is not None and path not in self.into:
                    self.into[path] = _full(first)
            return record
        self.handles = [m.register_forward_hook(hook(p)) for p, m in self.model.named_modules()]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False


def _forward(model: nn.Module, tokens: torch.Tensor):
    """The model on token ids; an encoder-decoder (T5) gets them as its decoder's ids too."""
    import inspect

    if "decoder_input_ids" in inspect.signature(model.forward).parameters:
        return model(input_ids=tokens, decoder_input_ids=tokens)
    return model(tokens)


def _fp32(compiled):
    """The compiled plan with every unit's mixed precision replaced by fp32 (see the module docstring)."""
    from planc.lower.program import FullyShard, Precision

    job = compiled.job
    parts = []
    for part in job.parts:
        ops = tuple(dataclasses.replace(op, policy=dataclasses.replace(op.policy, precision=Precision()))
                    if isinstance(op, FullyShard) else op for op in part.program.ops)
        parts.append(dataclasses.replace(part, program=dataclasses.replace(part.program, ops=ops)))
    compiled.__dict__["job"] = dataclasses.replace(job, parts=tuple(parts))
    return compiled


def _rank(rank: int, world: int, spec: dict) -> dict | None:
    """One rank of the sharded run (on a `launch`ed gloo process); rank 0 returns what it gathered."""
    import torch.distributed as dist

    import planc
    from planc.backends.runtime import build_mesh, run

    warnings.simplefilter("ignore")  # the ranks' own warnings are not the verdict (it is written by rank 0)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)

    model = _build(spec["twin"], spec["base"])
    compiled = planc.compile(planc.loads(spec["text"], filename=spec["file"]), model, world, strict=False,
                             check_memory=False)
    blocking = [d for d in compiled.diagnostics if d.is_error and d.code not in spec["allow"]]
    if blocking:
        raise VerifyError(f"{blocking[0].code} on the twin: {blocking[0].message}")
    compiled = _fp32(compiled)  # then made real as `planc.apply` does, op by op
    applied = run(compiled.job.program, model, build_mesh(compiled.mesh, world), compiled)
    dp_rank, dp = applied.data_parallel_rank()  # ranks of one tensor or context group share a slice
    per = spec["global_batch"] // dp
    tensor = applied.compiled.mesh.axis_name("tensor")
    tp = applied.mesh[tensor].size() if tensor else 1

    def reduce_loss(total: torch.Tensor) -> float:
        total = total.clone()
        dist.all_reduce(total)  # tensor ranks hold the same loss: the mean over all is the data-parallel mean
        return (total / world).item()

    data = [b[dp_rank * per:(dp_rank + 1) * per] for b in _batches(model, spec["global_batch"], spec["seq"])]
    scale = _loss_scale(compiled, world // tp)

    def forward(model: nn.Module, tokens: torch.Tensor):  # a context axis: this rank's sequence shard
        batch = applied.shard_batch(tokens, tokens)
        if batch.positions is None:
            return _forward(model, tokens), tokens
        return model(batch.tokens, positions=batch.positions), batch.labels

    out = _train(model, data, applied.accumulate, applied.loss_parallel, applied.microbatches / scale,
                 lambda total: reduce_loss(total / scale), forward, _whole_experts(applied))
    return out if rank == 0 else None


def _whole_experts(applied):
    """`full(name, tensor)` for `_train` and the pipelined run (`verify_pipeline.rank`): an
    expert-parallel parameter (each expert rank holds its experts' slice) gathered over the expert
    axis into all experts; every other one `_full`. None when this rank holds no such parameter."""
    import torch.distributed as dist

    from planc.lower.program import DispatchExperts

    ops = [op for part in applied.compiled.job.parts for op in part.program.of_type(DispatchExperts)]
    if not ops or applied.expert_mesh is None:  # under a pipeline: none of this rank's stages dispatches
        return None
    names = {p for op in ops for p in op.params}
    group = applied.expert_mesh[ops[0].axis].get_group()

    def full(name: str, t: torch.Tensor) -> torch.Tensor:
        mine = _full(t)
        if name not in names:
            return mine
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, mine.contiguous(), group=group)
        return torch.cat(parts)
    return full


def _loss_scale(compiled, dp: int) -> float:
    """What each rank's loss is multiplied by so that the reduced gradients are the one-process mean.

    `dp` ranks (data-parallel x context) each take the mean over an equal share of the tokens; FSDP2
    divides the summed gradients by that many unless the plan says otherwise (`reduction
    divide_factor = 1.0`: torchtitan sums, having divided its loss by the global token count)."""
    from planc.lower.program import UnitMethod

    programs = [part.program for part in compiled.job.parts]  # one, or a pipeline's stages
    factors = {op.unit: float(op.args[0]) for program in programs for op in program.ops
               if isinstance(op, UnitMethod) and op.method == "set_gradient_divide_factor"}
    found = {factors.get(u.name, float(dp)) for program in programs for u in program.units if u.params}
    if len(found) > 1:
        raise VerifyError(f"the units divide their gradients by different factors ({sorted(found)}): no one loss "
                          "scale makes them the one-process mean")
    return found.pop() / dp if found else 1.0


def _launch(world: int, spec: dict, timeout: float, body=None) -> Any:
    try:
        results = launch(body or _rank, world, spec, timeout=timeout)
        return results if body is not None else results[0]
    except LaunchError as err:
        if err.timed_out:
            raise VerifyError(f"the sharded run did not finish in {timeout:.0f} s (a hang?)") from None
        raise VerifyError(f"the plan did not train on {world} ranks: {err.error or 'a rank died'}") from None


# ===================================================================== compare and locate


def _compare(got: dict, ref: dict) -> tuple[int, list[Mismatch]]:
    found: list[Mismatch] = []
    count = 0

    def check(name: str, a: torch.Tensor, b: torch.Tensor, what: str, step: float) -> None:
        nonlocal count
        count += 1
        scale = float(b.abs().max()) if b.numel() else 0.0
        error = float((a - b).abs().max()) if a.shape == b.shape else math.inf
        if not error <= ATOL + RTOL * scale:
            found.append(Mismatch(name, error, scale, what, step))

    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"]), 1):
        check("", torch.tensor(a), torch.tensor(b), f"loss (step {step})", step)
    for step, (ga, gb) in enumerate(zip(got["grads"], ref["grads"]), 1):
        for name, g in gb.items():
            check(name, ga.get(name, torch.full_like(g, math.nan)), g, f"gradient (step {step})", step)
    for name, p in ref["params"].items():
        check(name, got["params"].get(name, torch.full_like(p, math.nan)), p, f"parameter after step {STEPS}",
              STEPS + 0.5)
    return count, found


def _first_wrong_output(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[str, float] | None:
    """The first module (in the order modules finish their forward) whose output on rank 0 differs from
    the same rows of the one-process output, with its relative error; modules whose output is a
    shard (another shape) are passed over."""
    for path, a in got.items():
        b = ref.get(path)
        if b is None or a.dim() == 0 or a.shape[1:] != b.shape[1:] or a.shape[0] > b.shape[0]:
            continue
        b = b[:a.shape[0]]  # rank 0 is data-parallel rank 0: the first rows of the global batch
        scale = float(b.abs().max()) if b.numel() else 0.0
        error = float((a - b).abs().max())
        if not error <= ATOL + RTOL * scale:
            return path, error / scale if scale else math.inf
    return None


def _forward_rules(compiled, module: str) -> list[str]:
    """The styled modules around `module`: in its parent's subtree (else the nearest ancestor's that has
    any), in the model's order: the rules that shape the activations `module` takes."""
    res, graph = compiled.resolution, compiled.graph
    order = {p: i for i, p in enumerate(graph.modules)}
    for parent in [module.rpartition(".")[0], *graph.ancestors(module.rpartition(".")[0])] if module else [""]:
        inside = [p for p in res.parallel if not parent or p == parent or p.startswith(parent + ".")]
        if inside:
            return sorted(inside, key=lambda p: order.get(p, len(order)))
    return []


def _forward_diagnostic(compiled, verdict: Verdict) -> Diagnostic | None:
    """P425 for a forward that computes another function: at the first rule around the first module
    whose output differs (a fused projection split colwise shows at its consumer's output)."""
    module, rel = verdict.first_output
    rules = _forward_rules(compiled, module)
    if not rules:
        return None
    res = compiled.resolution
    first = res.parallel[rules[0]]
    shown = "; ".join(f"`{p}` {res.parallel[p].value.kind} (line {res.parallel[p].span.line})" for p in rules[:4])
    return Diagnostic(
        code="P425", severity="error", span=first.span,
        message=f"the forward computes another function than one process: `{module}`'s output is off by "
                f"{100 * rel:.3g}%, the first module whose output differs",
        label="the first rule around it",
        notes=(f"the tensor-parallel rules that shape its input: {shown}",
               f"{verdict.world} ranks against one process on `{verdict.twin}`, fp32, tolerance {ATOL:g} + "
               f"{RTOL:g} x max"),
        related=tuple((res.parallel[p].span, f"`{p}` {res.parallel[p].value.kind}") for p in rules[1:4]),
        help=("a colwise output that the forward cuts into parts (a fused projection) is not the split the "
              "next layer expects: gather it (`colwise { output replicate }`, the consumer `rowwise { input "
              "replicate }`) or split the fused weight per part; `planc check` names such rules (P424)",))


def _rule_of(compiled, param: str) -> tuple[Any, str]:
    """The plan line a parameter's gradient is shaped by, and what it does to it."""
    res, graph = compiled.resolution, compiled.graph
    module = param.rpartition(".")[0]
    for path in [module, *graph.ancestors(module)] if module else [""]:  # the nearest styled module
        if path in res.parallel:
            setting = res.parallel[path]
            return setting.span, STYLES[setting.value.kind].gradient or f"applies `{setting.value.kind}`"
    unit = res.enclosing(module, graph)
    if unit is not None and unit.span is not None:
        return unit.span, "FSDP2 shards it and averages its gradient over the data-parallel ranks"
    return compiled.mesh.span, "the mesh decides how its gradient is reduced"


def diagnostics(compiled, verdict: Verdict) -> list[Diagnostic]:
    """P425 per plan line whose parameters trained differently from one process, from the first step
    anything differs (after one wrong update every later gradient differs: the first is the cause)."""
    losses = [m for m in verdict.mismatches if m.step == 1 and not m.param]
    if losses and verdict.first_output is not None:  # the first forward is already wrong: say where
        found = _forward_diagnostic(compiled, verdict)
        if found is not None:
            return [found]
    by_rule: dict[Any, list[Mismatch]] = {}
    meaning: dict[Any, str] = {}
    first = min((m.step for m in verdict.mismatches), default=0)
    for m in (m for m in verdict.mismatches if m.step == first):
        span, what = _rule_of(compiled, m.param) if m.param else (compiled.mesh.span, "the loss")
        by_rule.setdefault(span, []).append(m)
        meaning[span] = what
    out = []
    for span, ms in by_rule.items():
        worst = max(ms, key=lambda m: m.error / (m.scale or 1.0))
        names = sorted({m.param or "the loss" for m in ms})
        shown = ", ".join(f"`{n}`" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        rel = f"{100 * worst.error / worst.scale:.3g}%" if worst.scale else f"{worst.error:.3g}"
        stages = sorted({verdict.stage_of[m.param] for m in ms if m.param in verdict.stage_of})
        out.append(Diagnostic(
            code="P425", severity="error", span=span,
            message=f"trains differently from one process: {shown} ({worst.what} of `{worst.param or 'the loss'}` "
                    f"off by {rel}, max error {worst.error:.3g})",
            label="sharded here",
            notes=(f"this rule {meaning[span]}",
                   *([f"in pipeline stage {', '.join(map(str, stages))} of the twin"] if stages else []),
                   f"{verdict.world} ranks against one process on `{verdict.twin}`, fp32, tolerance {ATOL:g} + "
                   f"{RTOL:g} x max"),
            help=("run `planc check --simulate` and read the P4xx rules for this line; a module with weights on "
                  "sharded activations needs the style that reduces its gradient",)))
    return out


# ===================================================================== entry point


def verify(compiled, *, base: str | None = None, twin: str | None = None, timeout: float = 240.0,
           allow: frozenset[str] = frozenset(), model: str | None = None) -> Verdict:
    """Train the plan on its twin on local processes and compare with one process (see the module docstring).

    Args:
        compiled: the plan compiled against its model (any size: the twin is what runs).
        base: the plan's folder (relative `hf:` config paths).
        twin: the model reference to run as it is (default: `twin_reference` of `model`).
        model: the model the plan is for (default the plan's `model` line; `planc check --model`).
        allow: error codes the run goes on despite (the tests verify the plans P423/P424 refuse,
            to show that the static rules and this oracle agree); `planc check` verifies only
            plans without errors.

    Raises:
        VerifyError: no twin, a mesh needing more than `MAX_PROCESSES` processes, a plan that does not
            apply or train on the twin, or a run past `timeout`.
    """
    with tempfile.TemporaryDirectory(prefix="planc-twin-") as folder:  # a shrunk config lives here
        return _verify(compiled, base, twin, timeout, allow, folder, model)


def verify_world(mesh) -> int:
    """How many processes `check --verify` runs a (pipeline-free) plan's mesh on: the shape check's
    smallest world, or with the `*` axis at 1 when that does not fit `MAX_PROCESSES` (not with an
    expert axis, whose size must divide the ranks it borrows)."""
    from planc.analysis.shapecheck import simulation_world

    world = simulation_world(mesh)
    if world > MAX_PROCESSES and mesh.axis(Role.EXPERT) is None:
        from planc.analysis.verify_pipeline import pipeline_world
        world = pipeline_world(mesh, MAX_PROCESSES)  # the `*` axis at 1 when 2 does not fit
    return world


def _verify(compiled, base: str | None, twin: str | None, timeout: float, allow: frozenset[str],
            folder: str, model: str | None = None) -> Verdict:
    start = time.monotonic()
    ref = model or compiled.plan.model_ref
    if twin is None:  # a full-size model is never run: its small twin is
        if ref is None:
            raise VerifyError("the plan has no `model` line: pass --model or --verify-model")
        twin = twin_reference(ref, base, folder)
    if compiled.resolution.pipeline is not None:
        return _verify_pipeline(compiled, base, twin, allow, timeout, start)
    world = verify_world(compiled.mesh)
    if world > MAX_PROCESSES:
        raise VerifyError(f"the mesh needs {world} processes at its smallest ({compiled.mesh}); this machine runs "
                          f"at most {MAX_PROCESSES} at once")
    sizes = compiled.mesh.sizes(world) or {}
    tp = sizes.get("tensor", 1)
    k = compiled.job.schedule.microbatches
    spec = {"twin": twin, "base": base, "text": _plan_text(compiled), "file": compiled.plan.file, "allow": allow,
            "global_batch": 2 * k * (world // tp), "seq": -(-SEQ // tp) * tp}
    try:
        reference_model = _build(twin, base)
        data = _batches(reference_model, spec["global_batch"], spec["seq"])
        ref_out = _train(reference_model, data, lambda b: iter([(b,)]), contextlib.nullcontext, 1, lambda t: t.item())
    except Exception as err:  # any model code: the twin must train on token ids in one process first
        raise VerifyError(f"the twin `{twin}` does not train in one process on token ids of shape "
                          f"{spec['global_batch']}x{spec['seq']}: {type(err).__name__}: {err}") from err
    got = _launch(world, spec, timeout)
    compared, mismatches = _compare(got, ref_out)
    first_output = _first_wrong_output(got["outputs"], ref_out["outputs"]) if mismatches else None
    if twin.startswith(f"hf:{folder}"):  # say what it is, not where it was written
        twin = f"{ref} shrunk to {TWIN_LAYERS} layers, heads of {TWIN_HEAD_DIM}, a vocabulary of {TWIN_VOCAB}"
    star = [a for a in compiled.mesh.axes if a.size is None]
    notes = [f"the `*` axis ({star[0].name}) at 1 rank: 2 would need {2 * world} processes"] \
        if star and sizes.get(star[0].role) == 1 else []
    return Verdict(world, {str(getattr(r, "value", r)): v for r, v in sizes.items()}, twin, compared, mismatches,
                   time.monotonic() - start, first_output=first_output, notes=notes)


def _verify_pipeline(compiled, base: str | None, twin: str, allow: frozenset[str], timeout: float,
                     start: float) -> Verdict:
    """`_verify` for a pipeline plan: its schedule run by `planc.apply` on the ranks
    (`planc.analysis.verify_pipeline`), one process with the same microbatching the oracle."""
    from planc.analysis import verify_pipeline as vp

    world = vp.pipeline_world(compiled.mesh, MAX_PROCESSES)
    if world > MAX_PROCESSES:
        raise VerifyError(f"the mesh needs {world} processes at its smallest ({compiled.mesh}); this machine runs "
                          f"at most {MAX_PROCESSES} at once")
    sizes = compiled.mesh.sizes(world) or {}
    tp = sizes.get("tensor", 1)
    dp = world // (tp * max(1, sizes.get("pipeline", 1)))
    try:
        reference_model = _build(twin, base)
    except Exception as err:
        raise VerifyError(f"the twin `{twin}` cannot be built: {type(err).__name__}: {err}") from err
    try:
        text, cut = vp.twin_text(compiled, _plan_text(compiled), reference_model)
    except ValueError as err:
        raise VerifyError(str(err)) from None
    k = compiled.resolution.pipeline.microbatch_count or 1
    spec = {"twin": twin, "base": base, "text": text, "file": compiled.plan.file, "allow": allow,
            "global_batch": k * dp, "seq": -(-SEQ // tp) * tp}
    try:
        data = _batches(reference_model, spec["global_batch"], spec["seq"])
        ref_out = _train(reference_model, data, lambda b: vp.reference_steps(b, dp, k), contextlib.nullcontext,
                         dp * k, lambda t: t.item())
    except Exception as err:
        raise VerifyError(f"the twin `{twin}` does not train in one process on token ids of shape "
                          f"{spec['global_batch']}x{spec['seq']}: {type(err).__name__}: {err}") from err
    got = vp.merge(_launch(world, spec, timeout, vp.rank))
    compared, mismatches = _compare(got, ref_out)
    pipeline = compiled.resolution.pipeline
    notes = [f"{pipeline.schedule}, {k} microbatches per step, {cut}"]
    star = [a for a in compiled.mesh.axes if a.size is None]
    if star and sizes.get(star[0].role) == 1:
        notes.append(f"the `*` axis ({star[0].name}) at 1 rank: 2 would need {2 * world} processes")
    return Verdict(world, {str(getattr(r, "value", r)): v for r, v in sizes.items()}, twin, compared, mismatches,
                   time.monotonic() - start, notes=notes, stage_of=got["stage_of"])


def not_verified(compiled, why: str) -> Diagnostic:
    """P426: `--verify` was asked for and could not run (at the `model` line)."""
    model = next((s for s in compiled.plan.statements if type(s).__name__ == "ModelStmt"), None)
    return Diagnostic(code="P426", severity="error", span=model.span if model is not None else None,
                      message=f"the plan was not verified: {why}", label="this model",
                      help=("`--verify-model REF` names a small model with the same module names, head counts and "
                            "tying (a `planc.zoo:`/`hf:` reference or MODULE:CALLABLE)",))


def _plan_text(compiled) -> str:
    source = compiled.plan.source(compiled.plan.file)
    if source is None:
        raise VerifyError("the plan's text is not available to the processes")
    return source
