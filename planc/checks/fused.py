"""How the model takes apart a projection's output: one forward on fake CPU tensors, stopped early.

A fused projection (`gate_up_proj` = [gate | up], `qkv_proj` = [q | k | v]) makes an output
that the model's forward cuts into parts along the features (`chunk`, `split`, a slice of
the last dim); a per-head fused one (GPT-NeoX's `query_key_value`) is first viewed as
(..., heads, 3 * head_dim), so each head keeps its parts together. The module tree cannot
tell them apart, so `first_uses` runs the model, unsharded, on fake CPU tensors (shapes only,
no memory) up to the end of the blocks that hold the projections, and reports the first
operation each projection's output meets. A model that does not run on token ids is not
judged (None): the simulation and `--verify` still see it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# ops that cut a tensor into parts along a dim: (op name, the index of its `dim` argument, default dim)
CUTS = {"split.Tensor": (2, 0), "split_with_sizes.default": (2, 0), "unsafe_split.Tensor": (2, 0),
        "chunk.default": (2, 0), "narrow.default": (1, None), "slice.Tensor": (1, 0), "unbind.int": (1, 0),
        "select.int": (1, None), "tensor_split.sections": (2, 0), "tensor_split.indices": (2, 0)}
# ops that hand the same features on (a cast, a copy): the output is followed instead
SAME = {"_to_copy.default", "clone.default", "detach.default", "alias.default", "contiguous.default"}
PROBE_TOKENS = (1, 8)


@dataclass(frozen=True)
class Use:
    """The first operation a module's output meets: `cut` True when it cuts the features into parts."""

    op: str
    cut: bool


class _Stop(Exception):
    """Every block to watch has run: the rest of the forward is not needed."""


class _Watch(TorchDispatchMode):
    """Records the first use of each watched tensor (the projections' outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: dict[int, str] = {}   # id(tensor) -> module path
        self.keep: list[torch.Tensor] = []  # keeps the ids valid
        self.first: dict[str, Use] = {}

    def watch(self, path: str, out) -> None:
        if isinstance(out, torch.Tensor) and path not in self.first:
            self.watched[id(out)] = path
            self.keep.append(out)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__ if func.namespace == "aten" else None
        if name is None or not self.watched:
            return out
        for i, a in enumerate(args):
            path = self.watched.get(id(a)) if isinstance(a, torch.Tensor) else None
            if path is None or path in self.first or i != 0:
                continue
            if (name in SAME or _whole_slice(name, args, a)) and isinstance(out, torch.Tensor) \
                    and out.shape[-1:] == a.shape[-1:]:
                self.watch(path, out)  # the same features: follow the copy
                continue
            self.first[path] = Use(name, _cuts_last(name, args, kwargs, a.dim()))
        return out


def _whole_slice(name: str, args, a: torch.Tensor) -> bool:
    """`x[..., :]`-like slices that keep the whole dim (indexing emits them)."""
    if name != "slice.Tensor" or len(args) < 2:
        return False
    dim = args[1] % a.dim() if a.dim() else 0
    start = args[2] if len(args) > 2 else 0
    end = args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    return start in (0, None) and (end is None or end >= a.shape[dim]) and step == 1


def _cuts_last(name: str, args, kwargs, ndim: int) -> bool:
    """True when op `name` cuts its first argument along the last dim."""
    if name not in CUTS or ndim == 0:
        return False
    at, default = CUTS[name]
    dim = kwargs.get("dim", args[at] if len(args) > at else default)
    return isinstance(dim, int) and dim % ndim == ndim - 1


def _fake_copy(model: nn.Module, fake) -> nn.Module:
    """The model with fake CPU parameters and buffers (its own dtypes), ties kept."""
    memo = {id(t): torch.empty_like(t, device="meta") for t in [*model.parameters(), *model.buffers()]}
    out = copy.deepcopy(model, memo)
    made: dict[int, torch.Tensor] = {}
    with fake:
        for mod in out.modules():
            for key, p in list(mod._parameters.items()):
                if p is not None:
                    if id(p) not in made:
                        made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=False)
                    mod._parameters[key] = made[id(p)]
            for key, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[key] = torch.empty(b.shape, dtype=b.dtype)
    return out


@contextlib.contextmanager
def _quiet():
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    was = logger.disabled
    logger.disabled = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.disabled = was


# model -> {modules probed: result}: a plan checked again (the LSP on every edit, several world
# sizes) probes the same model once
_PROBED: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def first_uses(model: nn.Module | None, modules: list[str]) -> dict[str, Use] | None:
    """Module path -> the first operation its output meets in the model's forward (fake tensors,
    `PROBE_TOKENS` token ids, stopped once the parent of every module has returned); None when the
    model does not run that far on token ids. Cached per model and module list."""
    if model is None or not modules:
        return None
    cache = _PROBED.setdefault(model, {})
    key = tuple(sorted(modules))
    if key not in cache:
        cache[key] = _probe(model, list(key))
    return cache[key]


def _probe(model: nn.Module, modules: list[str]) -> dict[str, Use] | None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    watch = _Watch()
    handles = []
    try:
        with _quiet():
            copied = _fake_copy(model, fake)
            parents = {m.rpartition(".")[0] for m in modules}
            pending = set(parents)

            def done(path: str):
                def hook(mod, args, out):
                    pending.discard(path)
                    if not pending:
                        raise _Stop
                return hook

            for path in modules:
                handles.append(copied.get_submodule(path).register_forward_hook(
                    lambda mod, args, out, path=path: watch.watch(path, out)))
            for path in parents:
                handles.append(copied.get_submodule(path).register_forward_hook(done(path)))
            with torch.no_grad(), fake, watch:
                copied(torch.zeros(PROBE_TOKENS, dtype=torch.long))
    except _Stop:
        return dict(watch.first)
    except Exception:  # any model code may refuse token ids on fake tensors: not judged
        return None
    finally:
        for h in handles:
            h.remove()
    return dict(watch.first)
