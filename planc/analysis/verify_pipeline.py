"""`check --verify` of a pipeline plan: the twin trained through `planc.apply`'s schedule on gloo ranks.

`planc.analysis.verify` calls `run` for a plan with a pipeline axis. Each rank builds the twin,
compiles the plan against it, applies it as `planc.apply` does (`planc.backends.pipelining`:
its stages, their programs, torch's schedule of the plan's name with the plan's microbatches)
and trains `STEPS` AdamW steps with `applied.step`. The oracle is one process on the unsharded
twin with the same microbatching: the global batch cut into data-parallel slices, each into the
plan's microbatches, the loss the mean of the microbatches' losses (the schedule's
`scale_grads`, averaged by FSDP over the data-parallel ranks). Compared: the loss of each step
(on the ranks that hold the last stage, averaged over the data-parallel slices), every gradient
and every updated parameter (each gathered whole on the stage that holds it, data-parallel rank
0, and merged over the stages).

The world: the mesh's fixed axes, the `*` axis 2 ranks when that stays within the machine's
`MAX_PROCESSES`, else 1 (`plans/zoo-llama-pp.plan`, pipeline 4, runs at 4 ranks, one per stage).

The twin has fewer blocks than the full-size model. Without `stage` lines the automatic split
cuts the twin itself (the same rule, the twin's blocks). With `stage` lines, which name the
full-size model's modules, the lines are rewritten for the twin (`twin_stages`): modules
outside a numbered container (embedding, norm, head) stay where they are; each stage keeps the
share of a container's blocks it had, rounded, and at least one block if it had any; a twin with
fewer blocks than the stages that hold blocks is refused (P426), as such a plan cannot be
meaningfully shrunk.
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import Any

import torch
from torch import nn

_INDEXED = re.compile(r"^(?P<parent>.+)\.(?P<index>\d+)$")


def pipeline_world(mesh, max_processes: int) -> int:
    """The fixed axes' product, times 2 for a `*` axis when that fits `max_processes`, else times 1."""
    import math

    from planc.resolve.mesh import RULE

    axes = [a for a in mesh.axes if RULE[a.role].multiplies]
    fixed = math.prod(a.size for a in axes if a.size is not None)
    if not any(a.size is None for a in axes):
        return fixed
    return fixed * 2 if fixed * 2 <= max_processes else fixed


def twin_stages(stages: tuple[tuple[str, ...], ...], full_paths: list[str], twin: nn.Module) -> list[list[str]]:
    """The full-size model's stages (module subtrees) mapped onto the twin (see the module docstring).

    Raises:
        ValueError: a module outside the numbered containers is not in the twin, or the twin has
            fewer blocks in a container than the stages holding some of them.
    """
    twin_names = dict(twin.named_modules())
    full_count: dict[str, int] = {}
    for path in full_paths:
        m = _INDEXED.match(path)
        if m and isinstance(twin_names.get(m["parent"]), (nn.ModuleList, nn.Sequential)):
            full_count[m["parent"]] = max(full_count.get(m["parent"], 0), int(m["index"]) + 1)
    out: list[list[str]] = [[] for _ in stages]
    blocks: dict[str, list[tuple[int, int]]] = {}  # container -> (stage, blocks it holds), in order
    for s, modules in enumerate(stages):
        for path in modules:
            m = _INDEXED.match(path)
            if m and m["parent"] in full_count:
                held = blocks.setdefault(m["parent"], [])
                if held and held[-1][0] == s:
                    held[-1] = (s, held[-1][1] + 1)
                else:
                    held.append((s, 1))
            elif path in twin_names:
                out[s].append(path)
            else:
                raise ValueError(f"stage {s}'s `{path}` is not a module of the twin")
    for parent, held in blocks.items():
        n_twin, n_full = len(twin_names[parent]), full_count[parent]
        if n_twin < len(held):
            raise ValueError(f"the twin's `{parent}` has {n_twin} blocks, fewer than the {len(held)} stages that "
                             f"hold some of its {n_full}: pass --verify-model with a twin of at least {len(held)}")
        start, cumulative = 0, 0
        for i, (s, count) in enumerate(held):
            cumulative += count
            left = len(held) - i - 1  # stages after this one, each needing a block
            end = min(max(round(cumulative * n_twin / n_full), start + 1), n_twin - left)
            if i == len(held) - 1:
                end = n_twin
            out[s] += [f"{parent}.{k}" for k in range(start, end)]
            start = end
    order = {path: i for i, path in enumerate(twin_names)}
    return [sorted(mods, key=order.__getitem__) for mods in out]


def twin_text(compiled, text: str, twin: nn.Module) -> tuple[str, str]:
    """The plan's text for the twin and what was done to its stages, in words."""
    pipeline = compiled.resolution.pipeline
    if pipeline.split != "explicit":
        return text, f"the twin cut automatically into {pipeline.stage_count or 'its'} stages ({pipeline.split})"
    graph_paths = list(compiled.graph.modules)
    cut = twin_stages(pipeline.stages, graph_paths, twin)
    drop: set[int] = set()
    for span in pipeline.stage_spans:
        drop.update(range(span.line, span.end_line + 1))
    lines = [line for i, line in enumerate(text.splitlines(), 1) if i not in drop]
    lines += [f"stage {s}: " + ", ".join(mods) for s, mods in enumerate(cut)]
    shown = " | ".join(", ".join(m) for m in cut)
    return "\n".join(lines) + "\n", f"the `stage` lines rewritten for the twin: {shown}"


def reference_steps(batch: torch.Tensor, dp: int, microbatches: int):
    """One process's microbatches of a global batch: each data-parallel slice cut into the plan's."""
    return ((x,) for x in batch.chunk(dp * microbatches))


def rank(rank: int, world: int, spec: dict) -> dict:
    """One rank of the pipelined run (on a `launch`ed gloo process): its losses, and on
    data-parallel rank 0 its stages' gradients per step and parameters, whole (experts gathered
    over the stage's expert axis)."""
    import planc
    from planc.analysis import verify
    from planc.backends import pipelining
    from planc.backends.runtime import build_mesh
    from planc.estimate.trace import Example, default_loss

    warnings.simplefilter("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    model = verify._build(spec["twin"], spec["base"])
    compiled = planc.compile(planc.loads(spec["text"], filename=spec["file"]), model, world, strict=False,
                             check_memory=False)
    blocking = [d for d in compiled.diagnostics if d.is_error and d.code not in spec["allow"]]
    if blocking:
        raise verify.VerifyError(f"{blocking[0].code} on the twin: {blocking[0].message}")
    data = verify._batches(model, spec["global_batch"], spec["seq"])
    base = default_loss(model)
    compiled = verify._fp32(compiled)
    # the errors the run is allowed to go on despite (the tests verify plans P465 refuses): not `apply`'s to refuse
    compiled.__dict__["diagnostics"] = [d for d in compiled.diagnostics if not d.is_error]
    applied = pipelining.apply(model, compiled, [], build_mesh(compiled.mesh, world))
    dp_rank, dp = applied.data_parallel_rank()
    per = spec["global_batch"] // dp
    scale = verify._loss_scale(compiled, dp)

    def loss_fn(output, target):
        return base(output, Example((target,))) * scale

    full = verify._whole_experts(applied) or (lambda name, t: verify._full(t))
    opt = torch.optim.AdamW(list(applied.parameters()), lr=verify.LR, eps=verify.EPS)
    out: dict[str, Any] = {"losses": [], "grads": [], "params": {}, "dp_rank": dp_rank, "stages": applied.stage_ids}
    for batch in data:
        mine = batch[dp_rank * per:(dp_rank + 1) * per]
        loss = applied.step(mine, mine, loss_fn)
        out["losses"].append(None if loss is None else float(loss) / scale)
        out["grads"].append({n: full(n, p.grad) for n, p in applied.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    out["params"] = {n: full(n, p) for n, p in applied.named_parameters()}
    out["stage_of"] = {n: s for s, module in zip(applied.stage_ids, applied.stages) for n, _ in module.named_parameters()}
    if dp_rank:
        out["grads"], out["params"] = [], {}
    return out


def merge(results: list[dict]) -> dict:
    """The ranks' results as one run's (`verify._compare`'s shape): the losses averaged over the
    data-parallel slices of the loss-holding ranks, the stages' gradients and parameters merged."""
    steps = len(results[0]["losses"])
    losses = []
    for step in range(steps):
        by_slice = {r["dp_rank"]: r["losses"][step] for r in results if r["losses"][step] is not None}
        losses.append(sum(by_slice.values()) / len(by_slice) if by_slice else float("nan"))
    grads: list[dict] = [{} for _ in range(steps)]
    params: dict = {}
    stage_of: dict[str, int] = {}
    for r in results:
        stage_of.update(r["stage_of"])
        for step, g in enumerate(r["grads"]):
            grads[step].update(g)
        params.update(r["params"])
    return {"losses": losses, "grads": grads, "params": params, "outputs": {}, "stage_of": stage_of}
