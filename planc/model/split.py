"""Cut one pipeline stage's module from the whole model: the modules outside it become pass-throughs.

A stage (`Part.modules`: module subtrees, paths in the whole model) runs as the whole model
whose forward meets, in place of every module outside the stage, a `PassThrough` that returns
its first argument. The stage's root is a copy of the model's root (same class, same forward)
that shares every kept module with the model, so parameter paths and state-dict keys do not
change (torchtitan's `pipeline_module_split` keeps them by deleting modules and making the
model's forward skip a missing embedding or head; planc needs no change to the model's forward).

What a stage keeps of the model (`split`):
* each module in the stage, the very object (so applying the stage's program shards it);
* each ancestor of a kept module, copied, its children replaced as below;
* each module that has no parameters and lies in no stage (rotary embeddings, dropout,
  activation modules): it holds nothing to train, every stage may need it, so every stage
  shares it;
* every other module (a maximal subtree outside the stage that holds parameters) is a
  `PassThrough`, or an empty container of its class when it is a `ModuleList`, `ModuleDict`
  or `Sequential` (a forward iterates those).

This is sound for a forward that is a chain: each module takes the previous one's output as
its first argument and returns the next hidden state (the zoo's Llama and seed transformer,
torchtitan's Llama, Hugging Face decoders' layer loops). `check_chain` runs the split on meta
and refuses what it can see is not one: a removed module called with other tensors than a
hidden state (e.g. GPT's position embedding added to the token embedding), or called twice.
Nothing is allocated: on meta the copies are meta too. A stage returns a tensor (a Hugging Face
`ModelOutput` gives its first field, the logits); Hugging Face decoders (`model.embed_tokens`,
`model.layers.N`, `model.norm`, `lm_head`) split soundly this way: their forward builds the
mask and positions from the hidden state's shape and loops over `self.layers[:n]`, which
pass-throughs and an empty `ModuleList` keep intact (tests/test_stages.py).
"""

from __future__ import annotations

import copy
from typing import Iterable, Sequence

import torch
from torch import nn


class SplitError(ValueError):
    """The model cannot be cut into these stages by pass-through modules."""


class PassThrough(nn.Module):
    """Stands for a module outside the stage: returns its first argument unchanged."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.calls = 0  # counted, so `check_chain` sees a module called more than once

    def forward(self, *args, **kwargs):
        self.calls += 1
        if not args:
            raise SplitError(f"`{self.path}` is outside this pipeline stage and was called without a positional "
                             "input: a pass-through has nothing to return")
        first = args[0]
        if isinstance(first, torch.Tensor) and not (first.is_floating_point() or first.is_complex()):
            # token ids or positions, never a hidden state: the forward feeds this module something
            # else than the previous module's output (e.g. a position embedding added to the tokens')
            raise SplitError(f"`{self.path}` is outside this pipeline stage and the forward passes it a "
                             f"{first.dtype} tensor of shape {tuple(first.shape)}, not a hidden state: the forward "
                             "is not a chain of the stages' modules, so a pass-through cannot stand for it")
        return first

    def extra_repr(self) -> str:
        return f"outside this stage: {self.path}"


# Containers a forward iterates (`for layer in self.layers`): one wholly outside the stage
# becomes an empty one of its class (a `PassThrough` cannot be iterated).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def split(model: nn.Module, modules: Sequence[str]) -> nn.Module:
    """The stage of `model` holding the subtrees `modules` (see the module docstring).

    Raises:
        SplitError: a path is not a module of the model, or an ancestor of a kept module owns
            parameters directly (they would be in no stage).
    """
    names = dict(model.named_modules(remove_duplicate=False))
    for path in modules:
        if path not in names:
            raise SplitError(f"`{path}` is not a module of {type(model).__name__}")
    if "" in modules:
        return model
    memo: dict[int, object] = {}
    for path, module in names.items():
        if inside(path, modules) or (not _holds_parameters(module) and not _ancestor(path, modules)):
            memo[id(module)] = module  # kept, or shared: nothing to train in it
        elif _ancestor(path, modules):
            own = list(module.named_parameters(recurse=False))
            if own and path:
                raise SplitError(f"`{path}` owns parameters ({', '.join(n for n, _ in own)}) and lies across "
                                 "stages: move them into a submodule, or keep the whole subtree in one stage")
            for _, t in [*own, *module.named_buffers(recurse=False)]:
                memo[id(t)] = t  # the root's own tensors: shared, not copied
        elif not _ancestor(_parent(path), modules) or id(module) in memo:
            continue  # inside a subtree already replaced
        elif isinstance(module, _CONTAINERS):
            memo[id(module)] = type(module)()  # iterating it runs none of its blocks
        else:
            memo[id(module)] = PassThrough(path)
    stage = copy.deepcopy(model, memo)
    _tensor_output(stage)
    return stage


def _tensor_output(stage: nn.Module) -> None:
    """Make the stage copy return a tensor: torch's `PipelineStage` sends tensors, and a Hugging
    Face model returns a `ModelOutput` (its first field: the logits, or the hidden state a
    passed-through head leaves there). Its key/value cache is turned off: a pipeline trains."""
    config = getattr(stage, "config", None)
    if getattr(config, "use_cache", None):
        config.use_cache = False  # the copy's config (deep-copied), not the model's
    forward = stage.forward

    def tensor_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        return out.to_tuple()[0] if not isinstance(out, torch.Tensor) and hasattr(out, "to_tuple") else out

    stage.forward = tensor_forward


def inside(path: str, modules: Iterable[str]) -> bool:
    """Whether module `path` lies in one of the subtrees `modules` (`""` is the whole model)."""
    return any(m == "" or path == m or path.startswith(m + ".") for m in modules)


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _ancestor(path: str, modules: Iterable[str]) -> bool:
    """Whether `path` is the root or a proper ancestor of a kept module."""
    return path == "" or any(m.startswith(path + ".") for m in modules)


def pass_throughs(stage: nn.Module) -> list[PassThrough]:
    return [m for m in stage.modules() if isinstance(m, PassThrough)]


def check_chain(stage: nn.Module, example: Sequence[torch.Tensor]) -> torch.Tensor:
    """Run `stage` (built on meta) on meta copies of `example`; check that each pass-through
    was called at most once, with a hidden state (the stage's input or output shape) as its
    first argument; return the stage's output (on meta).

    `example`: the stage's inputs (the model's inputs for the first stage, the previous
    stage's output otherwise).

    Raises:
        SplitError: a pass-through was called twice, or with something other than the hidden state.
    """
    seen: dict[str, tuple] = {}

    def record(module, args):
        if module.path in seen:
            raise SplitError(f"`{module.path}` is outside this pipeline stage and the forward calls it twice")
        seen[module.path] = tuple(args[0].shape) if args and isinstance(args[0], torch.Tensor) else None

    handles = [m.register_forward_pre_hook(record) for m in pass_throughs(stage)]
    failed = None
    try:
        with torch.no_grad():
            out = stage(*(t.to("meta") for t in example))
    except (RuntimeError, TypeError, ValueError) as err:  # SplitError is a ValueError: kept as it is
        if isinstance(err, SplitError):
            raise
        failed, out = err, None
    finally:
        for h in handles:
            h.remove()
    if failed is not None:
        calls = ", ".join(f"`{p}` got {shape}" for p, shape in seen.items()) or "none called"
        raise SplitError(f"the stage's forward fails with its modules outside it passed through ({calls}): "
                         f"{type(failed).__name__}: {str(failed)[:200]}") from failed
    hidden = {tuple(example[0].shape), tuple(out.shape)}
    for path, shape in seen.items():
        if shape not in hidden:
            raise SplitError(f"`{path}` is outside this pipeline stage and the forward passes it a tensor of "
                             f"shape {shape}, not the hidden state {sorted(hidden)}: the forward is not a chain "
                             "of the stages' modules, so a pass-through cannot stand for it")
    return out


def check_split(model: nn.Module, stages: Sequence[Sequence[str]], inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Split `model` (built on meta) into `stages` and run them chained on meta copies of the
    model's `inputs` (`check_chain` per stage): what the pipeline checks run before any process
    starts. Returns the last stage's output (on meta).

    Raises:
        SplitError: naming the first stage that cannot be cut or run as a chain.
    """
    h: Sequence[torch.Tensor] = inputs
    for index, modules in enumerate(stages):
        try:
            h = [check_chain(split(model, modules), h)]
        except SplitError as err:
            found = SplitError(f"stage {index} ({', '.join(modules)}): {err}")
            found.stage = index  # type: ignore[attr-defined]  # which stage: the checks locate it (P456)
            # a pass-through misused (or the cut itself), not the forward failing for another reason
            # (on meta, e.g. `.item()`): what the static check judges
            found.not_a_chain = not isinstance(err.__cause__, Exception) or isinstance(  # type: ignore[attr-defined]
                err.__cause__, SplitError)
            raise found from err
    return h[0]
