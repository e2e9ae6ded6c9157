"""Resolve a `parallel ... context` statement: the context-parallel style of an attention module.

    mesh (shard = *, context = 2)
    parallel layers.*.attention context

The style word `context` marks attention modules whose causal attention runs over the whole
sequence while each rank of the context axis holds a head-tail shard of it: keys and values
are gathered over the context axis in forward (their gradients reduced in backward) and each
query chunk attends causally to the keys before it (`planc/backends/context.py`). It takes no options (P491) and
needs a context axis on the mesh (P490). Which modules it fits is checked against the model
(`planc/checks/context_parallel.py`).
"""

from __future__ import annotations

from planc.diagnostics import Diagnostic
from planc.lang import syntax as st
from planc.resolve.mesh import Mesh, Role

CONTEXT_STYLE = "context"  # the style word (a `parallel` statement's NAME)
BALANCE = "head-tail"      # how the sequence is cut: 2 x context chunks, rank r keeps r and 2cp-1-r
# The batch tensors the training loop shards, and the dim each is sharded on (the sequence).
BATCH_TENSORS: tuple[tuple[str, int], ...] = (("tokens", 1), ("labels", 1), ("positions", 0))


def is_context(stmt: st.ParallelStmt) -> bool:
    return stmt.style.value == CONTEXT_STYLE


def context_style(stmt: st.ParallelStmt, mesh: Mesh, mesh_ok: bool, diags: list[Diagnostic]) -> bool:
    """Whether a `parallel SELECTOR context` statement is well formed (P490, P491 otherwise)."""
    ok = True
    if stmt.block is not None and stmt.block.options:
        first = stmt.block.options[0]
        diags.append(Diagnostic(code="P491", severity="error", message="the `context` style takes no options",
                                span=first.span, label="not a context option",
                                help=("remove the block: the sequence is cut head-tail into 2 x context chunks "
                                      "and keys and values are gathered over the context axis",)))
        ok = False
    if mesh.axis(Role.CONTEXT) is None and mesh_ok:
        diags.append(Diagnostic(code="P490", severity="error", message="a `context` style, but the mesh has no context axis",
                                span=stmt.span, label="`context` needs a context axis",
                                help=("add one to the mesh: `mesh (shard = *, context = 2)`",)))
        ok = False
    return ok
