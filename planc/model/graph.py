"""The model graph: an `nn.Module` tree of modules and parameters, walked once.

`ModelGraph` answers the compiler's questions (paths in pre-order, children, subtrees, own
and tied parameters, sizes) from flat indices, and offers the same tree as a networkx graph
(`ModelGraph.g`, built on first use): module nodes keyed by their dotted path (`""` is the
root), parameter nodes by `("param", canonical_name)`, edges parent -> child module and
module -> parameter, each labelled with the local attribute name. A tied parameter is one
node with two owners, so `owners(name)` shows both modules. Works on meta-device models:
only shapes and dtypes are read, never values.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Iterator

import networkx as nx
import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """What planc needs to know about one parameter (shape and dtype, never the values)."""

    name: str  # canonical fully qualified name: the first path under which it was found
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    contiguous: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Run a block with the cyclic garbage collector off (restoring its previous state).

    Building a graph or compiling a plan allocates hundreds of thousands of small acyclic
    objects; with a large model already on the heap, each automatic full collection walks
    all of it, which made compile time grow faster than the model (100k modules: 7.1 s with
    collections, 3.0 s without). Reference counting still frees everything promptly.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Never:
    """A class nothing is an instance of."""


def _sharding_apis() -> tuple[type, type, Callable[[nn.Module], dict | None]]:
    """`FSDPModule`, `DTensor` and the composable-API registry lookup, if loaded.

    Only imported torch classes can have instances: when `torch.distributed.fsdp` was never
    imported, no module is an `FSDPModule`, so `planc check` need not pay the second it takes
    to import it just to learn that.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    tensor = sys.modules.get("torch.distributed.tensor")
    contract = sys.modules.get("torch.distributed._composable.contract")
    # NOTE: torch keeps a module's composable-API registry in its __dict__ under
    # `contract.REGISTRY_KEY` (`contract._get_registry` reads it with getattr, which on a
    # module without one goes through nn.Module.__getattr__ and costs 7 ms on 1,500 modules).
    key = getattr(contract, "REGISTRY_KEY", None)
    registry = (lambda module: module.__dict__.get(key)) if key else (lambda module: None)
    return getattr(fsdp, "FSDPModule", _Never), getattr(tensor, "DTensor", _Never), registry


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


class ModelGraph:
    """A read-only view of a module tree, built once from a model (see `from_module`).

    One walk over the model fills plain dicts and a pre-order list, and every query the
    compiler makes runs on them: a subtree is a contiguous slice of the pre-order, so
    `subtree` and `subtree_params` cost the size of the answer, never a traversal of the
    whole tree. This keeps compiling linear in the model size.

    `g` is the same tree as a networkx `DiGraph` (module and parameter nodes, see the module
    docstring), for graph algorithms and for callers who want one. It is built on first use:
    the compile path never needs it, and building it cost more than half of compiling a
    405B-shaped model (`benchmarks/compile_bench.py`).
    """

    def __init__(self, order: list[str], data: dict[str, tuple], own: dict[str, list[tuple[str, str]]],
                 params: dict[str, ParamInfo], aliases: dict[str, str], owners: dict[str, list[str]],
                 children: dict[str, list[str]], child_names: dict[str, list[str]], end: dict[str, int],
                 post: dict[str, int], model: nn.Module | None = None,
                 sharded: dict[str, list[str]] | None = None, shared: dict[str, tuple[str, ...]] | None = None):
        self._order = tuple(order)    # module paths, pre-order (registration order)
        self._data = data             # path -> (cls name, qualname, has_forward, module)
        self._own = own               # path -> (local name, canonical name) of its own parameters
        self.params = params          # canonical name -> info
        self.aliases = aliases        # every name (canonical or tied alias) -> canonical
        self._owners = owners         # canonical name -> owner paths, pre-order
        self._children = children     # path -> child paths, registration order
        self._child_names = child_names
        self._pre = {m: i for i, m in enumerate(self._order)}
        self._end = end               # subtree of m = _order[pre(m) : _end[m]]
        self._post = post             # post-order number
        self.model = model
        # What was already sharded when the graph was built (see `already_sharded`).
        self._sharded = sharded or {"fsdp": [], "dtensor": [], "checkpoint": []}
        # A module object registered at several paths: first path -> the other paths (see
        # `shared_modules`)
        self._shared = shared or {}

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_module(cls, model: nn.Module) -> "ModelGraph":
        with paused_gc():
            return cls._from_module(model)

    @classmethod
    def _from_module(cls, model: nn.Module) -> "ModelGraph":
        """One walk: pre-order, children, parameters, what is already sharded; then one
        reverse sweep for subtree extents and post-order numbers."""
        fsdp_module, dtensor, registry = _sharding_apis()
        order: list[str] = []
        depths: list[int] = []
        data: dict[str, tuple] = {}
        own: dict[str, list[tuple[str, str]]] = {}
        children: dict[str, list[str]] = {}
        child_names: dict[str, list[str]] = {}
        params: dict[str, ParamInfo] = {}
        aliases: dict[str, str] = {}
        owners: dict[str, list[str]] = {}
        seen: dict[int, str] = {}
        visited: dict[int, str] = {}  # module id -> the path it was first seen at
        shared: dict[str, list[str]] = {}
        sharded: dict[str, list[str]] = {"fsdp": [], "dtensor": [], "checkpoint": []}
        classes: dict[type, tuple[str, str, bool]] = {}  # a model has few classes and many modules
        forward = nn.Module.forward
        # NOTE: the walk is `named_modules(remove_duplicate=True)`'s: pre-order in registration
        # order (children pushed in reverse), None children skipped, a module object seen
        # before skipped with its subtree. Positions below depend on that order.
        stack: list[tuple[str, str, nn.Module, int, str]] = [("", "", model, 0, "")]
        while stack:
            path, local_name, module, depth, parent = stack.pop()
            key = id(module)
            first = visited.get(key)
            if first is not None:  # registered again here: one object, several paths (ALBERT)
                shared.setdefault(first, []).append(path)
                continue
            visited[key] = path
            kind = type(module)
            info = classes.get(kind)
            if info is None:
                info = classes[kind] = (kind.__name__, f"{kind.__module__}.{kind.__qualname__}",
                                        kind.forward is not forward)
            if path:  # leaves get no lists (most modules are leaves): see `children`
                if parent in children:
                    children[parent].append(path)
                    child_names[parent].append(local_name)
                else:
                    children[parent] = [path]
                    child_names[parent] = [local_name]
            order.append(path)
            depths.append(depth)
            data[path] = (*info, module)
            mine = None
            if isinstance(module, fsdp_module):
                sharded["fsdp"].append(path)
            if "checkpoint" in (registry(module) or {}):  # torch's composable checkpoint
                sharded["checkpoint"].append(path)
            for local, p in module._parameters.items():
                if p is None:
                    continue
                full = f"{path}.{local}" if path else local
                canon = seen.setdefault(id(p), full)
                if canon == full:
                    params[canon] = ParamInfo(canon, tuple(p.shape), p.dtype, p.requires_grad,
                                              p.is_contiguous())
                    owners[canon] = []
                    if isinstance(p, dtensor):
                        sharded["dtensor"].append(canon)
                aliases[full] = canon
                if mine is None:
                    mine = own[path] = []
                mine.append((local, canon))
                owners[canon].append(path)
            kids = [(name, child) for name, child in module._modules.items() if child is not None]
            prefix = f"{path}." if path else ""
            for name, child in reversed(kids):
                stack.append((prefix + name, name, child, depth + 1, path))
        # subtree of m = order[pre(m) : end[m]], from a reverse sweep (children come later).
        # Post-order number: the nodes finished before m are its subtree but itself, and every
        # node entered before it except its ancestors (one per level).
        end: dict[str, int] = {}
        post: dict[str, int] = {}
        for pre in range(len(order) - 1, -1, -1):
            m = order[pre]
            kids = children.get(m)
            e = end[kids[-1]] if kids else pre + 1
            end[m] = e
            post[m] = pre - depths[pre] + (e - pre) - 1
        return cls(order, data, own, params, aliases, owners, children, child_names, end, post, model, sharded,
                   {k: tuple(v) for k, v in shared.items()})

    @property
    def shared_modules(self) -> dict[str, tuple[str, ...]]:
        """Modules registered at more than one path (one MLP object in two blocks, as ALBERT
        shares layers): the path the graph keeps (the first in registration order) -> the
        other paths. The graph holds each module once, at its first path; parameters under
        the other paths are not aliases here, since FSDP2 sees one module."""
        return self._shared

    @cached_property
    def g(self) -> nx.DiGraph:
        """The tree as a networkx `DiGraph`: module nodes keyed by path (with `kind="module"`,
        `cls`, `qualname`, `has_forward`, `pre`, `post`, `module`), parameter nodes keyed by
        `("param", canonical name)` (`kind="param"`), and edges parent -> child and module ->
        parameter labelled with the local `name`. A tied parameter has two in-edges."""
        graph = nx.DiGraph()
        graph.add_nodes_from((path, {"kind": "module", "cls": self.cls(path), "qualname": self.qualname(path),
                                     "has_forward": self.has_forward(path), "pre": self.pre(path),
                                     "post": self.post(path), "module": self.module(path)})
                             for path in self._order)
        graph.add_nodes_from((("param", canon), {"kind": "param"}) for canon in self.params)
        graph.add_edges_from((path.rpartition(".")[0], path, {"name": path.rpartition(".")[2]})
                             for path in self._order[1:])
        graph.add_edges_from((path, ("param", canon), {"name": local})
                             for path in self._order for local, canon in self.own_params(path))
        return graph

    def describes(self, model: nn.Module) -> bool:
        """True if this graph still describes `model`: built from it, and since then the same
        module objects at the same paths, of the same classes (FSDP swaps a module's class),
        with no composable API newly applied, the same parameter names, shapes and dtypes, no
        parameter newly made a DTensor, and the same ties (names that shared one parameter
        still do, and no others)."""
        _, dtensor, registry = _sharding_apis()
        if model is not self.model:
            return False
        modules = dict(model.named_modules(remove_duplicate=True))
        if len(modules) != len(self._order):
            return False
        sharded, checkpointed = set(self._sharded["dtensor"]), set(self._sharded["checkpoint"])
        canon_of_id: dict[int, str] = {}
        names = 0
        for path in self._order:
            module = modules.get(path)
            if module is not self.module(path) or type(module).__name__ != self.cls(path):
                return False
            if "checkpoint" in (registry(module) or {}) and path not in checkpointed:
                return False
            for local, p in module._parameters.items():
                if p is None:
                    continue
                names += 1
                canon = self.aliases.get(f"{path}.{local}" if path else local)
                info = self.params.get(canon) if canon else None
                if info is None or tuple(p.shape) != info.shape or p.dtype != info.dtype:
                    return False
                if isinstance(p, dtensor) and canon not in sharded:
                    return False
                if canon_of_id.setdefault(id(p), canon) != canon:
                    return False  # a new tie
        return names == len(self.aliases) and len(canon_of_id) == len(self.params)  # no broken tie

    @property
    def already_sharded(self) -> dict[str, list[str]]:
        """What of the model was already sharded when the graph was built: `fsdp` (module
        paths that are `FSDPModule`s), `dtensor` (canonical names of DTensor parameters) and
        `checkpoint` (module paths with torch's composable checkpoint applied)."""
        return self._sharded

    # ----------------------------------------------------------------- modules
    @property
    def modules(self) -> tuple[str, ...]:
        """Every module path in pre-order (registration order); the root is `""`."""
        return self._order

    def children(self, path: str) -> list[str]:
        """Child module paths in registration order."""
        return self._children.get(path) or []

    def child_names(self, path: str) -> list[str]:
        return self._child_names.get(path) or []

    def own_params(self, path: str) -> list[tuple[str, str]]:
        """(local name, canonical name) of parameters registered directly on the module."""
        return self._own.get(path) or []

    def cls(self, path: str) -> str:
        return self._data[path][0]

    def qualname(self, path: str) -> str:
        return self._data[path][1]

    def has_forward(self, path: str) -> bool:
        return self._data[path][2]

    def pre(self, path: str) -> int:
        return self._pre[path]

    def post(self, path: str) -> int:
        return self._post[path]

    def module(self, path: str) -> nn.Module:
        return self._data[path][3]

    def subtree(self, path: str) -> Iterator[str]:
        """`path` and every module below it, pre-order."""
        return iter(self._order[self._pre[path]:self._end[path]])

    def subtree_size(self, path: str) -> int:
        """How many modules `subtree(path)` yields."""
        return self._end[path] - self._pre[path]

    def is_within(self, path: str, ancestor: str) -> bool:
        """True if `path` is `ancestor` or below it (O(1), by pre-order extents)."""
        return self._pre[ancestor] <= self._pre[path] < self._end[ancestor]

    def ancestors(self, path: str) -> Iterator[str]:
        """Strict ancestors of `path`, nearest first, ending with the root `""`."""
        while path:
            path = path.rpartition(".")[0]
            yield path

    @cached_property
    def class_names(self) -> frozenset[str]:
        return frozenset(self.cls(p) for p in self.modules)

    # ----------------------------------------------------------------- parameters
    def owners(self, canonical: str) -> list[str]:
        """Every module that registers this parameter (two or more for tied weights), pre-order."""
        return list(self._owners[canonical])

    @cached_property
    def tied(self) -> dict[str, list[str]]:
        """Canonical name -> owner modules, for parameters held by more than one module."""
        counts = Counter(self.aliases.values())
        owners = {n: self.owners(n) for n, k in counts.items() if k > 1}
        return {n: o for n, o in owners.items() if len(o) > 1}

    @cached_property
    def param_order(self) -> dict[str, int]:
        """Canonical name -> position in registration order (for sorting parameter lists)."""
        return {name: k for k, name in enumerate(self.params)}

    def subtree_params(self, path: str) -> set[str]:
        """Canonical names of all parameters in the subtree of `path`."""
        own = self._own
        return {c for m in self.subtree(path) for _, c in own.get(m, ())}

    @cached_property
    def subtree_numel(self) -> dict[str, int]:
        """Parameter count of each module's subtree (tied parameters counted once)."""
        result: dict[str, int] = {}
        for path in sorted(self._order, key=self._post.__getitem__):
            own = {c for _, c in self.own_params(path)}
            result[path] = sum(self.params[c].numel for c in own) + sum(result[c] for c in self.children(path))
        for canon, owners in self.tied.items():  # undo double counts above the meeting point
            numel = self.params[canon].numel
            seen_paths: dict[str, int] = {}
            for owner in owners:
                for anc in [owner, *self.ancestors(owner)]:
                    seen_paths[anc] = seen_paths.get(anc, 0) + 1
            for anc, n in seen_paths.items():
                if n > 1:
                    result[anc] -= numel * (n - 1)
        return result

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params.values())

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, path: object) -> bool:
        """True if `path` is a module path of the model."""
        return path in self._data
