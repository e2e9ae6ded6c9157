"""A pipeline's stages run chained on meta before anything else runs: a forward that is not a chain is P456.

The runtime cuts each stage from the model by pass-throughs (`planc.model.split`): a module
outside the stage returns its first argument. That is sound only when the forward is a chain
(each module takes the previous one's hidden state and returns the next); a forward that
indexes its blocks or carries state across them (GPT adds `wpe(positions)` to the token
embedding: a later stage would pass token positions through as its hidden state) breaks, in
the runtime, after the processes have started. Here the model (a copy on meta: nothing is
allocated) is cut into the plan's stages and run stage after stage on token ids
(`split.check_split`); the first stage that cannot be cut or run as a chain is P456, on its
`stage` line (the `pipeline` line for an automatic split), when the stages are otherwise well
formed (P467-P471 say what is wrong with them first). A model that does not run whole
on meta token ids, or a stage whose forward fails on meta for another reason than a pass-through
(Hugging Face's `.item()` on meta), is not judged (the runtime and `check --verify` still see it).
"""

from __future__ import annotations

import copy
import logging
import warnings
import weakref
from typing import Iterator

import torch
from torch import nn

from planc.checks.context import Context, err
from planc.checks.pipeline import check_pipeline_stages
from planc.diagnostics import Diagnostic
from planc.model.split import SplitError, check_split

PROBE_TOKENS = (2, 8)

# model -> {stages: the SplitError, or None}: the language server checks on every edit
_PROBED: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _on_meta(model: nn.Module) -> nn.Module:
    """The model itself when it is on meta, else a copy with meta parameters and buffers (ties kept)."""
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.is_meta for t in tensors):
        return model
    memo: dict[int, object] = {}
    for t in tensors:
        if id(t) not in memo:
            empty = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def split_problem(model: nn.Module, stages: tuple[tuple[str, ...], ...]) -> SplitError | None:
    """Why the model cannot run as these stages chained (the first stage's SplitError), or None
    (also when the whole model does not run on meta token ids: not judged). Cached per model."""
    cache = _PROBED.setdefault(model, {})
    if stages not in cache:
        cache[stages] = _probe(model, stages)
    return cache[stages]


def _probe(model: nn.Module, stages: tuple[tuple[str, ...], ...]) -> SplitError | None:
    """The stages run chained; only when they fail, the whole model alone (a model that does not run
    whole on meta token ids is not judged): a meta forward of a 126-block model takes seconds."""
    tokens = torch.zeros(PROBE_TOKENS, dtype=torch.long, device="meta")
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        was, logger.disabled = logger.disabled, True
        try:
            meta = _on_meta(model)
            check_split(meta, [list(s) for s in stages], [tokens])
            return None
        except SplitError as found:  # a forward failing on meta for another reason is not judged
            if not getattr(found, "not_a_chain", True):
                return None
            with torch.no_grad():
                meta(tokens)
            return found
        except Exception:
            return None
        finally:
            logger.disabled = was


def check_pipeline_chain(ctx: Context) -> Iterator[Diagnostic]:
    """P456: a stage that cannot be cut from the model by pass-throughs, or whose forward is not a chain."""
    pp = ctx.res.pipeline
    model = getattr(ctx.graph, "model", None)
    if pp is None or model is None or not pp.stages or len(pp.stages) != pp.stage_count:
        return
    if any(d.is_error for d in check_pipeline_stages(ctx)):
        return  # stages in the wrong order or missing modules: said there (P467-P471), not again here
    found = split_problem(model, tuple(tuple(s) for s in pp.stages))
    if found is None:
        return
    stage = getattr(found, "stage", None)
    explicit = pp.split == "explicit" and stage is not None and stage < len(pp.stage_spans)
    span = pp.stage_spans[stage] if explicit else pp.span
    yield err("P456", f"the model cannot run as these pipeline stages: {found}", span,
              "this stage" if explicit else "the stages cut here", (
                  "a stage runs the whole model's forward with the modules outside it passed through: the forward "
                  "must be a chain of the stages' modules (each takes the previous one's hidden state)",
                  "GPT-like forwards compute from the model's inputs beside the blocks (`wte(tokens) + "
                  "wpe(positions)`): such a model cannot be cut into stages by pass-throughs; compute what crosses "
                  "the blocks inside one module (an embedding that adds its positions) or train without a pipeline; "
                  "tests/test_stages.py shows torch's own split silently training another function"))
