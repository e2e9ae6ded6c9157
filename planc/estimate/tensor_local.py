"""One tensor-parallel rank's step on plain tensors: local shapes and the layouts' gathers and scatters.

The activation trace (`planc/estimate/trace.py`) runs the model on fake tensors. Under tensor
parallelism a rank holds each split parameter's local shard and sees local activations: a
colwise output has out/tp features, a sequence-parallel region seq/tp tokens. `local_shapes`
gives a parameter's local shape; `emulate_layouts` hooks each module a `parallel` statement
names so that its inputs and outputs change layout as torch's style changes them, with the
same allocations on one rank: an all-gather (`Shard(d)` -> `Replicate`) makes a tensor tp
times larger along d, a scatter or reduce-scatter (`Replicate`/`Partial` -> `Shard(d)`) a
local slice, an all-reduce (`Partial` -> `Replicate`) a tensor of the same size. The model
then runs on local plain tensors, which is what a rank's kernels see (DTensor's own wrapper
objects hold no memory). A model that hard-codes global head counts fails here as it would
under real tensor parallelism; the trace then says so.
"""

from __future__ import annotations

from torch import nn

from planc.lower.fsdp import fsdp_shape
from planc.lower.job import Reader
from planc.lower.lowering import tensor_dims
from planc.lower.program import (
    AttendOverContext,
    Checkpoint,
    Compile,
    DispatchExperts,
    FullyShard,
    Parallelize,
    SetPrefetch,
    UnitMethod,
)
from planc.resolve.styles import STYLES
from planc.resolve.tensor import Layout

# The tensor split is `Parallelize`'s alone: FSDP, checkpointing, the context gathers
# (`context_local.py`), the experts' dispatch (`expert_local.py`: an expert-parallel MoE layer
# takes the local tokens it is given), compile, prefetch lists and unit methods leave a tensor
# rank's local shapes and layouts as they are.
READER = Reader("the tensor-local emulation",
                (FullyShard, Parallelize, AttendOverContext, DispatchExperts, Checkpoint, Compile, SetPrefetch,
                 UnitMethod))


def local_shapes(program, graph, tp: int) -> dict[str, tuple[int, ...]]:
    """Canonical parameter -> its local shape on one tensor rank (only the split ones)."""
    READER.program(program)
    return {name: fsdp_shape(graph.params[name].shape, dim, tp) for name, dim in tensor_dims(program, graph).items()}


def _gather(x, dim: int, tp: int):
    import torch
    return torch.cat([x] * tp, dim=dim)


def _scatter(x, dim: int, tp: int):
    n = x.shape[dim]
    return x.narrow(dim, 0, -(-n // tp)).clone()


def relayout(x, have: Layout | None, want: Layout | None, tp: int):
    """`x` (this rank's local tensor in layout `have`) in layout `want`, allocating what torch's redistribute does."""
    import torch
    if not isinstance(x, torch.Tensor) or have is None or want is None or have == want or x.dim() == 0:
        return x
    if want.kind == "replicate":
        if have.kind == "shard":
            return _gather(x, have.dim, tp)
        return x.clone()  # partial -> replicate: an all-reduce into a new tensor
    if want.kind == "shard":
        if have.kind == "shard":  # all-to-all: local size, new tensor
            return _scatter(_gather(x, have.dim, tp), want.dim, tp)
        return _scatter(x, want.dim, tp)
    return x  # to partial: no data movement


def _one(layouts, default: Layout) -> Layout:
    return layouts[0] if layouts and layouts[0] is not None else default


def _first(args, fn):
    if not args:
        return args
    return (fn(args[0]), *args[1:])


def _hooks(module: nn.Module, style, tp: int, embedding: bool):
    """(forward pre-hook, forward hook) that change layouts as `style` does on one rank."""
    row = STYLES[style.kind]
    if row.splits:  # colwise / rowwise: computes in its row's input layout, its output comes out in `computes_out`
        have = _one(style.input_layouts, row.input)
        # loss parallel: the logits stay as computed (sharded on the vocabulary)
        out = row.computes_out if style.loss_parallel else _one(style.output_layouts, row.output)

        def pre(mod, args):
            return _first(args, lambda x: relayout(x, have, row.input, tp)) if not embedding else None

        def post(mod, args, output):
            return relayout(output, row.computes_out, out, tp)
        return pre, post
    if row.prepares_input or row.prepares_output:
        ins = tuple(zip(style.input_layouts or (), style.desired_input_layouts or ()))
        kw = dict(style.input_kwarg_layouts)
        kw_want = dict(style.desired_input_kwarg_layouts)
        outs = tuple(zip(style.output_layouts or (), style.desired_output_layouts or ()))

        def pre(mod, args, kwargs):
            args = tuple(relayout(a, *ins[i], tp) if i < len(ins) else a for i, a in enumerate(args))
            kwargs = {k: relayout(v, kw.get(k), kw_want.get(k), tp) for k, v in kwargs.items()}
            return args, kwargs

        def post(mod, args, output):
            if not outs:
                return None
            if isinstance(output, tuple):
                return tuple(relayout(o, *outs[i], tp) if i < len(outs) else o for i, o in enumerate(output))
            return relayout(output, *outs[0], tp)
        return (pre if row.prepares_input else None), post
    if style.kind == "sequence" and style.sequence_dim not in (None, 0, 1):
        # sharded on a later dim (`sequence_dim 2`: the features a colwise layer split, OLMo 2's
        # q_norm): DTensor runs the norm on the local features (the mean over them a partial sum,
        # all-reduced) and multiplies by its replicated weight's local slice (a view): the module
        # runs on this rank's shard with 1/tp of each 1-D weight, no activation gathered
        def pre_seq(mod, args):
            x = args[0] if args else None
            if not hasattr(x, "dim") or not x.dim():
                return None
            full = x.shape[-1] * tp
            mod._planc_whole = {}
            for name, param in list(mod._parameters.items()):
                if param is not None and param.dim() == 1 and param.shape[0] == full:
                    mod._planc_whole[name] = param
                    mod._parameters[name] = param.narrow(0, 0, param.shape[0] // tp)
            return None

        def post_seq(mod, args, output):
            for name, param in getattr(mod, "_planc_whole", {}).items():
                mod._parameters[name] = param
            mod._planc_whole = {}
            return None

        return pre_seq, post_seq
    return None, None  # sequence on the sequence dim (inputs taken as this rank's shard as they are), replicate


def emulate_layouts(model: nn.Module, program, graph, tp: int, prefix: str = "") -> list:
    """Hook every module a `Parallelize` op names on `model` (a copy of the plan's model); returns the handles.

    With `prefix`, `model` is the module at that path (one block run alone, as `planc suggest`
    profiles it): only the ops inside it are hooked, by their paths relative to it.
    """
    handles = []
    for op in READER.program(program).of_type(Parallelize):
        if prefix and op.module != prefix and not op.module.startswith(prefix + "."):
            continue
        module = model.get_submodule(op.module[len(prefix) + 1:] if prefix else op.module)
        pre, post = _hooks(module, op.style, tp, graph.cls(op.module).endswith("Embedding"))
        if pre is not None:
            with_kwargs = STYLES[op.style.kind].prepares_input
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=with_kwargs))
        if post is not None:
            handles.append(module.register_forward_hook(post))
    return handles
