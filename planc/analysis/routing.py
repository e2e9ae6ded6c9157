"""Record a routing histogram from a real step: the rows each rank sends to each expert, per MoE layer.

    with record_routing(model) as recorded:      # after planc.apply, or on a dense model in one process
        loss = loss_fn(model(batch)); loss.backward()
    recorded.save("routing.json")                # every rank calls it (the counts are gathered)

Each experts container of a known layout (`planc.resolve.experts.layout`) gets a forward pre-hook
that counts, in the last forward of the model inside the block (several steps: the last one's, as
`measure_real` measures its last), the rows of this rank's tokens per expert: from the
sorted layout's `offsets` (under expert parallelism the dispatched forward receives the same global
offsets: the counts the dispatch exchanges before its all-to-all), or Hugging Face's `top_k_index`.
A recomputed forward (activation checkpointing) calls it again and is not counted twice. The model's
first tensor input gives the batch shape. `routing()` gathers every rank's counts over the default
process group when there is one (a collective: every rank calls it), and returns the
`planc.estimate.routing.Routing` the estimates read (`planc explain --routing FILE`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from planc.backends.experts import EXPERT_SLICE
from planc.estimate.routing import Layer, Routing
from planc.resolve.experts import SORTED, layout


class RoutingRecorder:
    """The counts `record_routing` collects; `routing()`/`save(path)` when the step is done."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.counts: dict[str, list[int]] = {}
        self.batch: tuple[int, ...] | None = None
        self.fresh: set[str] = set()  # the containers counted in this forward of the model
        self.degree = 1
        self.handles: list = []
        self.containers = {}
        for path, module in model.named_modules():
            try:
                self.containers[path] = layout(module)
            except ValueError:
                continue
            self.degree = max(self.degree, getattr(module, EXPERT_SLICE, (0, 1))[1])
        if not self.containers:
            raise ValueError("the model has no experts container of a known layout (3-D weights [experts, ...] "
                             "with forward(rows, offsets) or forward(hidden, top_k_index, top_k_weights))")

    def _count(self, path: str, module: nn.Module, args) -> None:
        if path in self.fresh:  # recomputed in the backward: counted in its forward
            return
        self.fresh.add(path)
        if self.containers[path] == SORTED:
            offsets = args[1]
            counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        else:
            rank_slice = getattr(module, EXPERT_SLICE, None)
            total = next(module.parameters()).shape[0] * (1 if rank_slice is None else rank_slice[1])
            counts = torch.bincount(args[1].reshape(-1), minlength=total)
        self.counts[path] = [int(c) for c in counts.tolist()]

    def _input(self, module: nn.Module, args, kwargs) -> None:
        """A new forward of the model: its counts replace the last one's."""
        first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        self.batch = None if first is None else tuple(first.shape)
        self.fresh = set()

    def __enter__(self) -> "RoutingRecorder":
        for path in self.containers:
            module = self.model.get_submodule(path)
            self.handles.append(module.register_forward_pre_hook(
                lambda m, args, path=path: self._count(path, m, args)))
        self.handles.append(self.model.register_forward_pre_hook(self._input, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def routing(self, file: str = "<recorded>") -> Routing:
        """Every rank's counts (gathered over the default process group if one is initialised)."""
        missing = sorted(set(self.containers) - set(self.counts))
        if missing or self.batch is None:
            raise ValueError(f"no forward was recorded for {', '.join(missing) or 'the model'}: run one step inside "
                             f"`record_routing(model)`")
        mine = [self.counts[path] for path in self.containers]
        ranks = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        layers = tuple(Layer(path, tuple(tuple(r[i]) for r in ranks)) for i, path in enumerate(self.containers))
        return Routing(layers, self.batch, self.degree, file)

    def save(self, path: str) -> Routing:
        """Write the histogram (JSON, `planc/estimate/routing.py`'s format) on rank 0; every rank calls it."""
        routing = self.routing(path)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            routing.save(path)
        return routing


def record_routing(model: nn.Module) -> RoutingRecorder:
    """A context manager recording, per experts container of `model`, the rows this rank routes to each
    expert in one forward (see the module docstring)."""
    return RoutingRecorder(model)


__all__ = ["RoutingRecorder", "record_routing"]
