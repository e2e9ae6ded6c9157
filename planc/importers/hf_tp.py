"""Translate a Hugging Face model's tensor-parallel plan into `parallel` statements: `planc import --hf-tp-plan`.

transformers ships a tensor-parallel plan with each model that supports it: a dict from module
paths to style names, `config.base_model_tp_plan` for the base model (`"layers.*.self_attn.q_proj":
"colwise"`, `*` standing for a layer number) and the model class's `_tp_plan` for the head
(`"lm_head": "colwise_gather_output"`). A built model carries the two merged, prefixed with its
`base_model_prefix`, as `model._tp_plan`. `tensor_statements` maps each style to planc's
`parallel` statement with the arguments that give Hugging Face's layouts
(transformers/distributed/tensor_parallel.py registers them), groups siblings with one style
into `{a,b}`, leaves out (with the reason) the styles no torch `ParallelStyle` expresses, and
replicates on the tensor axis every module with parameters the plan does not place, so that
every parameter lives on the same meshes (foreach optimizers and `clip_grad_norm_` need that).
"""

from __future__ import annotations

import fnmatch
import re
import textwrap
from dataclasses import dataclass, field

from torch import nn

# Hugging Face style -> (planc style, its block options), the layouts HF's registered style uses.
STYLES: dict[str, tuple[str, tuple[str, ...]]] = {
    "colwise": ("colwise", ()),  # input Replicate, output Shard(-1): torch's defaults
    "rowwise": ("rowwise", ()),  # input Shard(-1), output Replicate
    "colwise_gather_output": ("colwise", ("output replicate",)),
    "colwise_rep": ("colwise", ("output replicate",)),
    "rowwise_split_input": ("rowwise", ("input replicate",)),
    "rowwise_rep": ("rowwise", ("input replicate",)),
    # the token ids are replicated; torch's RowwiseParallel would take them as Shard(-1)
    "embedding_rowwise": ("rowwise", ("input replicate", "output replicate")),
    "embedding_colwise": ("colwise", ("output replicate",)),
    "sequence_parallel": ("sequence", ("local_output true",)),
    "replicate": ("replicate", ()),
    # transformers 4's names for the same layouts with local (non-DTensor) parameters
    "local_colwise": ("colwise", ()),
    "local_rowwise": ("rowwise", ()),
    # a norm inside a head-sharded region (Qwen3's q_norm / k_norm on (batch, seq, heads,
    # head_dim)): SequenceParallel on the head dim keeps its weight replicated and sums its
    # gradient over the tensor axis, as torchtitan's Qwen3 plan does
    "replicated_with_grad_allreduce": ("sequence", ("sequence_dim 2", "local_output true")),
}

# Styles with no torch `ParallelStyle` equivalent, and why.
UNSUPPORTED: dict[str, str] = {
    "packed_colwise": "a fused weight packed along its output (e.g. [gate; up]): colwise would give the first "
                      "ranks all of one part; planc has no packed style",
    "packed_rowwise": "a fused weight packed along its input: planc has no packed style",
    "local_packed_rowwise": "a fused weight packed along its input: planc has no packed style",
    "moe_tp_experts": "tensor parallelism inside the experts: planc keeps experts FSDP-only this round",
    "moe_identity_expert": "an expert-parallel identity expert: planc keeps experts FSDP-only this round",
    "grouped_gemm": "expert parallelism: planc keeps experts FSDP-only this round",
    "ep_router": "expert parallelism: planc keeps experts FSDP-only this round",
    "gather": "an output all-reduce of expert-parallel partial sums: planc keeps experts FSDP-only",
    "mla_kv_a_proj": "a projection whose output is split into a colwise and a replicated part (MLA); no torch "
                     "style does that",
    "all_reduce": "an all-reduce of a module's partial output with no sharded weight; no torch style does that",
    "local_params": "parameters kept as local tensors outside DTensor; no torch style does that",
    "local": "parameters kept as local tensors outside DTensor; no torch style does that",
    "isolated": "a module computed per rank on its own submesh; no torch style does that",
}

_LAYER = re.compile(r"\.\d+(?=\.|$)")


@dataclass
class Skipped:
    """One entry of the Hugging Face plan that was not imported; `comment` is its line in the plan."""

    key: str
    style: str
    reason: str
    comment: str


@dataclass
class TensorStatements:
    """What `tensor_statements` found: the plan lines, what was left out, header notes."""

    lines: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tied: list[tuple[str, ...]] = field(default_factory=list)  # parameters shared by modules, which TP unties


def hf_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's full tensor-parallel plan (paths from the model's root), or None without one."""
    plan = getattr(model, "_tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    nested = prefix and isinstance(getattr(model, prefix, None), nn.Module)
    merged = {(f"{prefix}.{k}" if nested else k): v for k, v in base.items()}
    head = getattr(type(model), "_tp_plan", None)
    if isinstance(head, dict):
        merged.update(head)
    return merged


def _matches(key: str, names: list[str]) -> list[str]:
    """Modules `key` names, as Hugging Face matches it: `*` one path segment."""
    parts = key.split(".")
    return [n for n in names if len(n.split(".")) == len(parts)
            and all(fnmatch.fnmatchcase(a, b) for a, b in zip(n.split("."), parts))]


def _statement(path: str, style: str, options: tuple[str, ...]) -> str:
    if not options:
        return f"parallel {path} {style}"
    if len(options) == 1:
        return f"parallel {path} {style} {{ {options[0]} }}"
    return f"parallel {path} {style} {{\n" + "\n".join(f"  {o}" for o in options) + "\n}"


def _grouped(entries: list[tuple[str, str, tuple[str, ...]]]) -> list[str]:
    """Siblings with one style become `parent.{a,b}`, in the order of first appearance."""
    groups: dict[tuple[str, str, tuple[str, ...]], list[str]] = {}
    for path, style, options in entries:
        parent, _, leaf = path.rpartition(".")
        groups.setdefault((parent, style, options), []).append(leaf)
    out = []
    for (parent, style, options), leaves in groups.items():
        leaf = leaves[0] if len(leaves) == 1 else "{" + ",".join(dict.fromkeys(leaves)) + "}"
        out.append(_statement(f"{parent}.{leaf}" if parent else leaf, style, options))
    return out


def tensor_statements(model: nn.Module) -> TensorStatements | None:
    """The `parallel` statements of the model's Hugging Face tensor-parallel plan; None if it has none."""
    plan = hf_tp_plan(model)
    if plan is None:
        return None
    result = TensorStatements()
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    params = dict(model.named_parameters())
    imported: list[tuple[str, str, tuple[str, ...]]] = []
    covered_exact: set[str] = set()   # modules whose own parameters a style places
    covered_tree: set[str] = set()    # modules whose whole subtree a style places
    used: set[str] = set()
    param_names = list(params)

    def skip(key: str, style: str, reason: str) -> None:
        wrapped = textwrap.wrap(reason, 96, initial_indent="#   ", subsequent_indent="#   ")
        result.skipped.append(Skipped(key, style, reason, "\n".join([f"# not imported: {key} {style}", *wrapped])))

    for key, style in plan.items():
        matched = _matches(key, names)
        if not matched and _matches(key, param_names):
            skip(key, style, UNSUPPORTED.get(style) or "a style on one parameter; planc's styles apply to modules")
            continue
        if style not in STYLES:
            skip(key, style, UNSUPPORTED.get(style, "a style planc does not know"))
            continue
        if not matched:
            skip(key, style, "no module of the model has this path")
            continue
        ours, options = STYLES[style]
        used.add(style)
        imported.append((key, ours, options))
        for name in matched:
            (covered_tree if ours in ("replicate", "sequence") else covered_exact).add(name)
    result.lines += _grouped(imported)
    result.lines += [s.comment for s in result.skipped]
    if "replicated_with_grad_allreduce" in used:
        result.notes.append("`replicated_with_grad_allreduce` became `sequence { sequence_dim 2 }`: it assumes the "
                            "norm's input is (batch, seq, heads, head_dim), as in Qwen3.")

    def placed(owner: str) -> bool:
        if owner in covered_exact:
            return True
        parts = owner.split(".")
        return any(".".join(parts[:i]) in covered_tree for i in range(1, len(parts) + 1))

    left: list[str] = []
    for pname in params:
        owner = pname.rpartition(".")[0]
        if owner and not placed(owner):
            left.append(_LAYER.sub(".*", owner))
    owners: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(pname)
    for shared in (v for v in owners.values() if len(v) > 1):
        # any style registers a new parameter on its own module only (see plans/gpt2.plan)
        result.tied.append(tuple(shared))
    left = list(dict.fromkeys(left))
    if left:
        result.lines.append("# Not placed by the imported styles: replicated on the tensor axis, so every parameter lives on")
        result.lines.append("# the same meshes (foreach optimizers and `clip_grad_norm_` need that).")
        result.lines += _grouped([(path, "replicate", ()) for path in left])
    return result
