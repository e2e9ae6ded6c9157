"""Translate a Hugging Face model's expert-parallel plan into `parallel ... expert` statements: `planc import --hf-ep-plan`.

transformers ships an expert-parallel plan with its mixture-of-experts configs,
`config.base_model_ep_plan`: module or parameter paths (`*` one layer number) to what expert
parallelism does there. `"layers.*.mlp.experts": "ep_dispatch_experts"` marks the experts
container whose tokens are dispatched: planc's `parallel model.layers.*.mlp.experts expert`
(`planc/backends/experts.py` runs Hugging Face's fused 3-D experts). `"grouped_gemm"` on the
experts' own weights says they are run grouped: planc's style covers them, nothing to write.
`"ep_router"` marks a router: planc keeps routers replicated, nothing to write. Anything else
is left out with a `# not imported:` comment saying why.
"""

from __future__ import annotations

import fnmatch

from torch import nn

DISPATCH = ("ep_dispatch_experts",)
COVERED = {"grouped_gemm": "the experts' weights: the `expert` style on their container covers them",
           "ep_router": "a router: planc keeps routers replicated"}


def hf_ep_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's expert-parallel plan, paths from the model's root; None without one."""
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_ep_plan", None)
    if not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    nested = prefix and isinstance(getattr(model, prefix, None), nn.Module)
    return {(f"{prefix}.{k}" if nested else k): v for k, v in base.items()}


def _matches(key: str, names: list[str]) -> list[str]:
    parts = key.split(".")
    return [n for n in names if len(n.split(".")) == len(parts)
            and all(fnmatch.fnmatchcase(a, b) for a, b in zip(n.split("."), parts))]


def expert_statements(model: nn.Module) -> tuple[list[str], list[str]] | None:
    """(`parallel ... expert` lines, `# not imported:` comments) of the model's plan; None without one."""
    plan = hf_ep_plan(model)
    if plan is None:
        return None
    modules = [n for n, _ in model.named_modules() if n]
    lines, skipped = [], []
    for key, style in plan.items():
        if style in DISPATCH and _matches(key, modules):
            lines.append(f"parallel {key} expert")
        elif style in COVERED:
            continue
        else:
            why = "no module of the model has this path" if style in DISPATCH else "planc has no rule for it"
            skipped.append(f"# not imported: {key} {style} ({why})")
    return lines, skipped
