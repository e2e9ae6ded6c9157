"""Resolve a `parallel ... expert` statement: expert parallelism on an experts container.

    mesh (shard = *, expert = 2)
    parallel layers.*.moe.experts expert

The style word `expert` marks the modules that hold a mixture-of-experts layer's experts as
3-D weights (`[experts, ...]`). Each rank of the expert axis keeps `experts / expert` whole
experts; the rows routed to an expert travel to its rank and back by all-to-all with uneven
splits (`planc/backends/experts.py`); the router before them stays replicated (it is a dense
parameter, FSDP-sharded with the rest). The expert axis borrows its ranks from shard x context
x tensor (torchtitan's rule); the experts are FSDP-sharded over what is left, the
expert-data-parallel degree `efsdp = shard x context x tensor / expert` (`expert_degrees`).
The style takes no options (P481) and needs an expert axis (P480); which modules it fits and
the sizes are checked against the model (`planc/checks/experts.py`).
"""

from __future__ import annotations

import inspect
from typing import Mapping

from planc.diagnostics import Diagnostic
from planc.lang import syntax as st
from planc.resolve.mesh import Mesh, Role

EXPERT_STYLE = "expert"  # the style word (a `parallel` statement's NAME)
EFSDP = "efsdp"          # the expert view's FSDP axis name (torchtitan's)


def is_expert(stmt: st.ParallelStmt) -> bool:
    return stmt.style.value == EXPERT_STYLE


def expert_degrees(mesh: Mesh, sizes: Mapping[str, int]) -> tuple[int, int] | None:
    """(expert, efsdp) at the axis sizes `sizes` (`Mesh.sizes`), or None when the expert size does
    not divide the ranks it borrows (P483) or the mesh has no expert axis."""
    if mesh.axis(Role.EXPERT) is None or Role.EXPERT not in sizes:
        return None
    ep, lent = sizes[Role.EXPERT], Mesh.borrowed(Role.EXPERT, sizes)
    if ep < 1 or lent % ep:
        return None
    return ep, lent // ep


def expert_style(stmt: st.ParallelStmt, mesh: Mesh, mesh_ok: bool, diags: list[Diagnostic]) -> bool:
    """Whether a `parallel SELECTOR expert` statement is well formed (P480, P481 otherwise)."""
    ok = True
    if stmt.block is not None and stmt.block.options:
        first = stmt.block.options[0]
        diags.append(Diagnostic(code="P481", severity="error", message="the `expert` style takes no options",
                                span=first.span, label="not an expert option",
                                help=("remove the block: each expert rank keeps experts / expert whole experts and "
                                      "tokens reach them by all-to-all",)))
        ok = False
    if mesh.axis(Role.EXPERT) is None and mesh_ok:
        diags.append(Diagnostic(code="P480", severity="error", message="an `expert` style, but the mesh has no expert axis",
                                span=stmt.span, label="`expert` needs an expert axis",
                                help=("add one to the mesh: `mesh (shard = *, expert = 2)` (it borrows its ranks from "
                                      "shard x context x tensor)",)))
        ok = False
    return ok


def moe_layers(experts: Mapping[str, object]) -> dict[str, str]:
    """Each expert-parallel container's MoE layer (its parent: router, shared experts, the
    experts), path -> container. Under a tensor axis the layer runs on its tensor rank's part
    of the group's tokens (`planc.backends.experts.split_over_tensor`): its parameters stay off
    the tensor axis, the dense ones' gradients summed over it."""
    return {path.rpartition(".")[0]: path for path in experts}


SORTED, TOKEN_CHOICE = "sorted", "token choice"  # the experts layouts the style fits (`layout`)


def layout(module) -> str:
    """The experts layout of `module`: SORTED (`forward(rows, offsets)`: rows sorted by expert and
    each expert's cumulative end, `planc.zoo.routed.RoutedExperts`) or TOKEN_CHOICE
    (`forward(hidden, top_k_index, top_k_weights)`: Hugging Face's fused 3-D experts, Qwen3-MoE,
    Mixtral), its own parameters 3-D `[experts, ...]`; raises ValueError saying what else it is."""
    own = list(module.named_parameters(recurse=False))
    if not own:
        raise ValueError("it has no parameters of its own")
    if any(p.dim() != 3 for _, p in own) or len({p.shape[0] for _, p in own}) != 1:
        raise ValueError("its parameters are not 3-D weights [experts, ...] with one expert count")
    if any(True for c in module.children() for _ in c.parameters()):
        raise ValueError("it has submodules with parameters (one module per expert?)")
    try:
        names = [n for n, p in inspect.signature(module.forward).parameters.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    except (TypeError, ValueError):
        names = []
    if len(names) == 2:
        return SORTED
    if len(names) == 3:
        return TOKEN_CHOICE
    raise ValueError("its forward takes neither (rows sorted by expert, offsets) nor (hidden, top_k_index, "
                     "top_k_weights)")
