"""planc: a compiler for declarative FSDP2 sharding plans.

The pipeline, one module per stage:

    grammar/plan.lark -> parse -> syntax -> graph -> resolve -> validate -> memory
                      -> apply / emit -> cli

Public API, shaped like the `json` module: `load(path)`, `loads(text)`, then
`compile(plan, model)` and `apply(model, plan)`.
"""

from planc.compiler import CompiledPlan, compile
from planc.diagnostics import Diagnostic, PlanError, Span
from planc.graph import ModelGraph
from planc.parse import load, loads

__all__ = ["CompiledPlan", "Diagnostic", "ModelGraph", "PlanError", "Span", "apply", "compile",
           "load", "loads", "materialize"]
__version__ = "0.1.0"


def __getattr__(name):
    # `apply` and `materialize` import torch.distributed; keep `import planc` light for the
    # compiler-only uses (CI checks, editors).
    if name in ("apply", "materialize", "AppliedPlan"):
        from planc import runtime as _apply_mod
        return getattr(_apply_mod, name)
    raise AttributeError(name)
