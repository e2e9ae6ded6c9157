"""The model graph: an `nn.Module` tree as a networkx graph of modules and parameters.

Module nodes are keyed by their dotted path (`""` is the root) and parameter nodes by
`("param", canonical_name)`. Edges run parent -> child module and module -> parameter, each
labelled with the local attribute name. A tied parameter is one node with two owners, so
`owners(name)` shows both modules. Works on meta-device models: only shapes and dtypes are
read, never values.
"""

from __future__ import annotations

import contextlib
import gc
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator

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


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


class ModelGraph:
    """A read-only view of a module tree, built once from a model (see `from_module`).

    Queries run on plain dicts and a pre-order list built with the graph (`g` stays the
    networkx view for callers that want graph algorithms): a subtree is a contiguous slice of
    the pre-order, so `subtree` and `subtree_params` cost the size of the answer, never a
    traversal of the whole tree. This keeps compiling linear in the model size.
    """

    def __init__(self, graph: nx.DiGraph, params: dict[str, ParamInfo], aliases: dict[str, str],
                 model: nn.Module | None = None):
        self.g = graph
        self.params = params          # canonical name -> info
        self.aliases = aliases        # every name (canonical or tied alias) -> canonical
        self.model = model
        self._index()

    def _index(self) -> None:
        """Children, own parameters, pre/post order and subtree extents, as dicts."""
        g = self.g
        self._data: dict = {n: d for n, d in g.nodes(data=True) if d["kind"] == "module"}
        mods = sorted(self._data, key=lambda p: self._data[p]["pre"])
        self._children: dict[str, list[str]] = {m: [] for m in mods}
        self._child_names: dict[str, list[str]] = {m: [] for m in mods}
        self._own: dict[str, list[tuple[str, str]]] = {m: [] for m in mods}
        for m, n, local in g.edges(data="name"):
            if isinstance(n, tuple):
                self._own[m].append((local, n[1]))
        for m in mods[1:]:  # registration order: children appear in the pre-order list in order
            parent, _, local = m.rpartition(".")
            self._children[parent].append(m)
            self._child_names[parent].append(local)
        self._order = tuple(mods)
        self._pre = {m: i for i, m in enumerate(mods)}
        # subtree of m = _order[pre(m) : _end[m]]; post-order number from a reverse sweep
        end: dict[str, int] = {}
        post: dict[str, int] = {}
        counter = 0
        stack = [(mods[0], False)] if mods else []
        while stack:
            node, done = stack.pop()
            if done:
                post[node] = counter
                counter += 1
                kids = self._children[node]
                end[node] = end[kids[-1]] if kids else self._pre[node] + 1
                continue
            stack.append((node, True))
            stack.extend((c, False) for c in reversed(self._children[node]))
        self._end = end
        self._post = post
        for m in mods:
            self._data[m]["post"] = post[m]

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_module(cls, model: nn.Module) -> "ModelGraph":
        with paused_gc():
            return cls._from_module(model)

    @classmethod
    def _from_module(cls, model: nn.Module) -> "ModelGraph":
        nodes: list = []
        edges: list = []
        params: dict[str, ParamInfo] = {}
        aliases: dict[str, str] = {}
        seen: dict[int, str] = {}
        # NOTE: named_modules() is pre-order in registration order; positions below depend on it.
        for order, (path, module) in enumerate(model.named_modules(remove_duplicate=True)):
            kind = type(module)
            nodes.append((path, {"kind": "module", "cls": kind.__name__,
                                 "qualname": f"{kind.__module__}.{kind.__qualname__}",
                                 "has_forward": kind.forward is not nn.Module.forward,
                                 "pre": order, "module": module}))
            if path:
                parent, _, local = path.rpartition(".")
                edges.append((parent, path, {"name": local}))
            for local, p in module._parameters.items():
                if p is None:
                    continue
                full = f"{path}.{local}" if path else local
                canon = seen.setdefault(id(p), full)
                if canon == full:
                    params[canon] = ParamInfo(canon, tuple(p.shape), p.dtype, p.requires_grad,
                                              p.is_contiguous())
                    nodes.append((("param", canon), {"kind": "param"}))
                aliases[full] = canon
                edges.append((path, ("param", canon), {"name": local}))
        g = nx.DiGraph()
        g.add_nodes_from(nodes)  # bulk adds: a third of the per-call cost on large models
        g.add_edges_from(edges)
        return cls(g, params, aliases, model)

    def describes(self, model: nn.Module) -> bool:
        """True if this graph still describes `model`: built from it, and since then the same
        module objects at the same paths, the same parameter names, shapes and dtypes, and the
        same ties (names that shared one parameter still do, and no others)."""
        if model is not self.model:
            return False
        modules = dict(model.named_modules(remove_duplicate=True))
        if len(modules) != len(self._order) or any(modules.get(p) is not self._data[p]["module"] for p in self._order):
            return False
        canon_of_id: dict[int, str] = {}
        names = 0
        for path in self._order:
            for local, p in self._data[path]["module"]._parameters.items():
                if p is None:
                    continue
                names += 1
                canon = self.aliases.get(f"{path}.{local}" if path else local)
                info = self.params.get(canon) if canon else None
                if info is None or tuple(p.shape) != info.shape or p.dtype != info.dtype:
                    return False
                if canon_of_id.setdefault(id(p), canon) != canon:
                    return False  # a new tie
        return names == len(self.aliases) and len(canon_of_id) == len(self.params)  # no broken tie

    # ----------------------------------------------------------------- modules
    @property
    def modules(self) -> tuple[str, ...]:
        """Every module path in pre-order (registration order); the root is `""`."""
        return self._order

    def children(self, path: str) -> list[str]:
        """Child module paths in registration order."""
        return self._children[path]

    def child_names(self, path: str) -> list[str]:
        return self._child_names[path]

    def own_params(self, path: str) -> list[tuple[str, str]]:
        """(local name, canonical name) of parameters registered directly on the module."""
        return self._own[path]

    def cls(self, path: str) -> str:
        return self._data[path]["cls"]

    def qualname(self, path: str) -> str:
        return self._data[path]["qualname"]

    def has_forward(self, path: str) -> bool:
        return self._data[path]["has_forward"]

    def pre(self, path: str) -> int:
        return self._pre[path]

    def post(self, path: str) -> int:
        return self._post[path]

    def module(self, path: str) -> nn.Module:
        return self._data[path]["module"]

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
        """Every module that registers this parameter (two or more for tied weights)."""
        return sorted(self.g.predecessors(("param", canonical)), key=self.pre)

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
        return {c for m in self.subtree(path) for _, c in own[m]}

    @cached_property
    def subtree_numel(self) -> dict[str, int]:
        """Parameter count of each module's subtree (tied parameters counted once)."""
        result: dict[str, int] = {}
        for path in sorted(self._order, key=self._post.__getitem__):
            own = {c for _, c in self._own[path]}
            result[path] = sum(self.params[c].numel for c in own) + sum(result[c] for c in self._children[path])
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
