"""planc: a compiler for declarative FSDP2 sharding plans.

The pipeline, one package per stage (docs/architecture.md):

    grammar/plan.lark -> lang (parse -> syntax tree) -> model (graph) -> resolve (IR)
        -> checks -> lower (the lowered program) -> analysis (trace, memory, explain)
        -> backends (apply, materialize, emit) -> cli

Public API, shaped like the `json` module: `load(path)`, `loads(text)`, then
`compile(plan, model)` and `apply(model, plan)`.
"""

from planc.compiler import CompiledPlan, compile
from planc.diagnostics import Diagnostic, PlanError, Span
from planc.lang.parse import load, loads
from planc.model.graph import ModelGraph

__all__ = ["CompiledPlan", "Diagnostic", "ModelGraph", "PlanError", "Span", "apply", "compile",
           "load", "loads", "materialize"]
__version__ = "0.1.0"


def __getattr__(name):
    # `apply` and `materialize` import torch.distributed; keep `import planc` light for the
    # compiler-only uses (CI checks, editors).
    if name in ("apply", "AppliedPlan"):
        from planc.backends import runtime
        return getattr(runtime, name)
    if name == "materialize":
        from planc.backends.materialize import materialize
        return materialize
    raise AttributeError(name)
