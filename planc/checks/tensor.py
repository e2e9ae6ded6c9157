"""Static tensor-parallel checks: a 2-D plan read against the module tree and the mesh, no GPU.

Each check reads the resolved styles (`Resolution.parallel`), the model graph (module
classes, shapes, and the attributes the module objects hold: head counts, the Hugging Face
`config`) and the tensor-parallel size (the mesh's `tensor` axis, filled from the world size
when it is `*`), at any world size and without `torch.distributed`:

* P410 the tensor axis is not the last `mesh` dimension (planc builds it last anyway);
* P411 / P412 the tensor-parallel size does not divide an attention module's query / KV heads;
* P413 a colwise -> rowwise split that is not even; P414 the vocabulary under `loss_parallel`
  (a warning: torch copes); P415 the sequence length of an `input = BxS` under sequence parallel;
* P416 a colwise output (`Shard(-1)`) nothing takes back, P422 a rowwise input (`Shard(-1)`)
  nothing produces (warnings); P417 a norm with weights
  between sequence-sharded activations that is not `sequence`; P419 `loss_parallel` on a
  module that does not make the logits; P420 colwise / rowwise on a module torch cannot split;
* P421 a tied parameter placed differently by its owners.

P418 (parameters left out) and the rules for plans whose shapes chain but whose numbers do not
(P423, P424) are in planc/checks/tensor_holes.py.

What planc cannot see is the forward code: producer -> consumer order is read from the module
tree (registration order, siblings, enclosing blocks), so the chaining checks that depend on
it (P416, P422) are warnings. The shape-level simulation on a fake process group is a separate check.
"""

from __future__ import annotations

import bisect
import re
from typing import Iterator

from torch import nn

from planc.checks.context import Context, by_key, err, listed
from planc.diagnostics import Diagnostic
from planc.lang import syntax as st
from planc.lower.lowering import tensor_param_dim
from planc.resolve.ir import Setting
from planc.resolve.mesh import ROLES, RULE, Role
from planc.resolve.styles import IN, ROWS, STYLES, SUBTREE
from planc.resolve.tensor import Layout, TensorStyle

STATIC_TENSOR_CODES = frozenset(f"P{n}" for n in range(410, 423))  # what the checks here report

SEQ = Layout("shard", 1)          # activations sharded on the sequence (batch, seq, hidden)
SPLIT = tuple(r.word for r in ROWS if r.splits)    # the styles that split parameters
# styles that put a whole subtree's parameters on the tensor axis
COVER_SUBTREE = tuple(r.word for r in ROWS if r.places == SUBTREE)

# Head counts, from the attention module itself or from the Hugging Face config it keeps
Q_ATTRS = ("num_heads", "n_heads", "num_attention_heads", "n_head")
KV_ATTRS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
CONFIG_Q = ("num_attention_heads", "n_head", "num_heads")
CONFIG_KV = ("num_key_value_heads",)


# ===================================================================== shared helpers


def tp_size(ctx: Context, world: int | None = None) -> int | None:
    """The tensor-parallel size at `world` ranks (default the context's), None when unknown."""
    mesh = ctx.res.mesh
    axis = mesh.axis(Role.TENSOR)
    if axis is None:
        return None
    if axis.size is not None:
        return axis.size
    sizes = mesh.sizes(world if world is not None else ctx.world_size)
    return None if sizes is None else sizes.get(Role.TENSOR)


def styled(ctx: Context) -> dict[str, Setting]:
    """module -> style setting, in module (pre-)order; empty without a tensor axis, or when the
    mesh cannot fill the world size (P401 says so; a check on top would only echo it).
    Computed once per context (every check here reads it; none mutates it)."""
    return ctx.memo("tensor.styled", lambda: _styled(ctx))


def _styled(ctx: Context) -> dict[str, Setting]:
    mesh = ctx.res.mesh
    if mesh.axis(Role.TENSOR) is None or not ctx.res.parallel:
        return {}
    if ctx.world_size is not None and mesh.sizes(ctx.world_size) is None:
        return {}
    return {p: ctx.res.parallel[p] for p in sorted(ctx.res.parallel, key=ctx.graph.pre)}


class _View:
    """What several checks derive from `styled(ctx)`, once per context (`_view`): the styled
    modules in module order with their pre-order numbers and subtree ends (for bisect), their
    parents, and per-module flags of the style (each distinct style judged once)."""

    def __init__(self, ctx: Context, styles: dict[str, Setting]):
        graph = ctx.graph
        self.styles = styles
        self.order = list(styles)
        self.pres = [graph.pre(p) for p in self.order]
        self.ends = [pre + graph.subtree_size(p) for pre, p in zip(self.pres, self.order)]
        self.parents = [_parent(p) for p in self.order]
        # the module object splittable by torch (an nn.Linear or nn.Embedding), a Linear
        modules = [graph.module(p) for p in self.order]
        self.splittable = [isinstance(m, (nn.Linear, nn.Embedding)) for m in modules]
        self.linear = [isinstance(m, nn.Linear) for m in modules]
        judged: dict[int, tuple[bool, bool, bool]] = {}
        self.producer, self.reads_last, self.prepares = [], [], []
        for setting in styles.values():
            style = setting.value
            flags = judged.get(id(style))
            if flags is None:
                flags = judged[id(style)] = (
                    _producer(style),
                    STYLES[style.kind].splits == IN and _is_last(_first(style.input_layouts, STYLES[style.kind].input)),
                    STYLES[style.kind].prepares_input)
            self.producer.append(flags[0])
            self.reads_last.append(flags[1])
            self.prepares.append(flags[2])
        # a rowwise Linear reading `Shard(-1)` (P422's subject, one of P416's consumers)
        self.rowwise_reader = [r and lin for r, lin in zip(self.reads_last, self.linear)]
        # a style that takes a `Shard(-1)` activation: a rowwise Linear reading `Shard(-1)` or an
        # explicit `prepare_input` / `prepare`
        self.consumer = [pr or rr for pr, rr in zip(self.prepares, self.rowwise_reader)]


def _view(ctx: Context) -> _View:
    return ctx.memo("tensor.view", lambda: _View(ctx, styled(ctx)))


def pattern(path: str) -> str:
    """`model.layers.3.mlp` -> `model.layers.*.mlp`: one name for a rule's repeated matches."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", path)


def patterns(paths: list[str]) -> list[str]:
    return list(dict.fromkeys(pattern(p) for p in paths))


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _int(obj, names: tuple[str, ...]) -> int | None:
    for name in names:
        try:
            value = getattr(obj, name, None)
        except Exception:  # a model's property may raise anything; no head count then
            value = None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def attention_heads(module: nn.Module) -> tuple[int, int] | None:
    """(query heads, key/value heads) of an attention module, or None if it is not one.

    An attention module has `attention` in its class name and a head count: its own
    attribute (torchtitan `n_heads` / `n_kv_heads`, `num_heads`, ...) or the Hugging Face
    config it keeps (`config.num_attention_heads` / `num_key_value_heads`; transformers 5
    drops the per-module copies). KV heads default to the query heads (no grouping).
    """
    if "attention" not in type(module).__name__.lower():
        return None
    q, kv = _int(module, Q_ATTRS), _int(module, KV_ATTRS)
    config = module.__dict__.get("config")
    if config is not None:
        q = q or _int(config, CONFIG_Q)
        kv = kv or _int(config, CONFIG_KV)
    head_dim = _int(module, ("head_dim",))
    if q is None and head_dim:  # no count kept: the projections' widths over the head size
        q, kv = _heads_from(module, Q_PROJ, head_dim), kv or _heads_from(module, KV_PROJ, head_dim)
    groups = _int(module, ("num_key_value_groups",))
    if q is not None and kv is None and groups and q % groups == 0:
        kv = q // groups
    return None if q is None else (q, kv or q)


Q_PROJ, KV_PROJ = ("q_proj", "wq", "query"), ("k_proj", "wk", "key")


def _heads_from(module: nn.Module, names: tuple[str, ...], head_dim: int) -> int | None:
    """Heads of the first projection child of `names`: its out-features over `head_dim`."""
    for name in names:
        proj = module._modules.get(name)
        if isinstance(proj, nn.Linear) and proj.out_features % head_dim == 0:
            return proj.out_features // head_dim
    return None


def _is_last(layout: Layout | None) -> bool:
    """`Shard(-1)` of a (batch, seq, features) activation (written `shard(-1)` or `shard(2)`)."""
    return layout is not None and layout.kind == "shard" and layout.dim in (-1, 2)


def _first(layouts, default: Layout | None) -> Layout | None:
    return layouts[0] if layouts else default


def output_layout(style: TensorStyle) -> Layout | None:
    """The layout a style leaves its (first) output in (its row's default filled: colwise / rowwise)."""
    return _first(style.output_layouts, STYLES[style.kind].output)


def _is_embedding(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding)


def _vocabulary(ctx: Context) -> tuple[str, int] | None:
    """(path, size) of the model's first `nn.Embedding` (the input embedding), if any."""
    return ctx.memo("tensor.vocabulary", lambda: _first_embedding(ctx))


def _first_embedding(ctx: Context) -> tuple[str, int] | None:
    for path in ctx.graph.modules:
        module = ctx.graph.module(path)
        if isinstance(module, nn.Embedding):
            return path, module.num_embeddings
    return None


def _choices(n: int) -> str:
    """`a tensor-parallel size that divides 12 (2, 3, 4, 6, 12)`: the sizes that would work."""
    sizes = [d for d in range(2, min(n, 4096) + 1) if n % d == 0][:6]
    if not sizes:
        return f"no tensor parallelism here: {n} has no divisor above 1"
    if sizes == [n]:  # a prime: the only size is n itself ("divides 2 (2)" says nothing)
        return f"tensor = {n}"
    return f"a tensor-parallel size that divides {n} (" + ", ".join(map(str, sizes)) + ")"


def _s(n: int) -> str:
    """The plural ending for a count."""
    return "" if n == 1 else "s"


# ===================================================================== P410: the mesh


def check_tensor_last(ctx: Context) -> Iterator[Diagnostic]:
    """P410: the tensor axis is written last in the `mesh` statement (planc builds it innermost)."""
    meshes = [s for s in ctx.plan.statements if isinstance(s, st.MeshStmt)]
    if not meshes or meshes[-1].strategy is not None:
        return
    axes = meshes[-1].axes
    roles = [ROLES.get(a.name) for a in axes]
    if Role.TENSOR not in roles:
        return
    k = roles.index(Role.TENSOR)
    # the world's axes written after it (an expert axis borrows ranks: it may follow)
    after = [i for i, r in enumerate(roles) if i > k and r is not None and RULE[r].multiplies]
    if not after:
        return
    order = [a for i, a in enumerate(axes) if i != k]
    order.insert(after[-1], axes[k])
    fixed = "mesh (" + ", ".join(f"{a.name} = {'*' if a.size is None else a.size}" for a in order) + ")"
    yield err("P410", f"the tensor axis `{axes[k].name}` is not the last mesh dimension", axes[k].span,
              "tensor parallelism is the innermost axis",
              (f"move it last: `{fixed}`; planc builds the device mesh with the tensor axis innermost "
               "(its ranks within a node) whatever the order written",))


# ===================================================================== P411 / P412: heads


def _split_attention(ctx: Context) -> dict[str, tuple[tuple[int, int], Setting]]:
    """Attention module -> (its heads, the first split style inside it), for attention modules
    holding a colwise / rowwise module (the innermost attention module above each). Once per context."""
    return ctx.memo("tensor.split_attention", lambda: _find_split_attention(ctx, styled(ctx)))


def _find_split_attention(ctx: Context, styles: dict[str, Setting]) -> dict[str, tuple[tuple[int, int], Setting]]:
    found: dict[str, tuple[tuple[int, int], Setting]] = {}
    heads_of: dict[str, tuple[int, int] | None] = {}  # each module read once
    nearest: dict[str, str | None] = {}  # module -> the innermost attention module at or above it

    def attention_above(path: str) -> str | None:
        walked = []
        while True:
            if path in nearest:
                near = nearest[path]
                break
            heads = heads_of[path] = attention_heads(ctx.graph.module(path))
            if heads is not None:
                near = path
                break
            walked.append(path)
            if not path:
                near = None
                break
            path = _parent(path)
        for p in walked:
            nearest[p] = near
        nearest[path] = near
        return near

    for path, setting in styles.items():
        if setting.value.kind not in SPLIT or not path:
            continue  # (the root has no attention module above it)
        attn = attention_above(_parent(path))
        if attn is not None and attn not in found:
            found[attn] = (heads_of[attn], setting)
    return found


def _bad_attention(ctx: Context, tp: int) -> dict[str, tuple[tuple[int, int], Setting]]:
    return {a: v for a, v in _split_attention(ctx).items() if v[0][0] % tp or v[0][1] % tp}


def check_heads(ctx: Context) -> Iterator[Diagnostic]:
    """P411 / P412: the tensor-parallel size divides the query and the key/value heads of every
    attention module whose projections the plan splits."""
    styles, tp = styled(ctx), tp_size(ctx)
    if not styles or not tp or tp == 1:
        return
    query, kv = [], []
    for attn, ((q, k), setting) in _bad_attention(ctx, tp).items():
        if q % tp:
            query.append(((setting.span, q), attn))
        if k % tp:
            kv.append(((setting.span, k, q), attn))
    for (span, q), mods in by_key(query).items():
        names = patterns(mods)
        yield err("P411", f"tensor = {tp} does not divide the {q} query heads of {listed(names)}", span,
                  f"{q} heads over {tp} ranks", (
                      f"use {_choices(q)}, or leave this attention out of the tensor-parallel plan",
                      "each rank must hold whole heads: the reshape to heads fails in forward otherwise"))
    for (span, k, q), mods in by_key(kv).items():
        names = patterns(mods)
        yield err("P412", f"tensor = {tp} does not divide the {k} key/value heads of {listed(names)} "
                  f"({q} query heads)", span, f"{k} KV heads over {tp} ranks", (
                      f"use {_choices(k)}; with fewer KV heads than ranks the key/value "
                      "projections cannot be split (Hugging Face's Qwen3-VL, 4 KV heads, crashes in forward at "
                      "tp = 8: transformers#48307)",))


# ===================================================================== P413 / P414 / P419 / P420: shapes


def check_split_modules(ctx: Context) -> Iterator[Diagnostic]:
    """P420: colwise and rowwise only on `nn.Linear` / `nn.Embedding` (torch raises otherwise)."""
    styles = styled(ctx)
    found = []
    for path, setting in styles.items():
        kind = setting.value.kind
        if kind in SPLIT and not isinstance(ctx.graph.module(path), (nn.Linear, nn.Embedding)):
            found.append(((setting.span, kind, ctx.graph.cls(path)), path))
    for (span, kind, cls), mods in by_key(found).items():
        yield err("P420", f"`{kind}` on {listed(patterns(mods))}, a {cls}: torch splits only nn.Linear and "
                  "nn.Embedding", span, f"{cls} is not a Linear or an Embedding", (
                      "select the Linear layers inside it (`parallel <path>.* ...`), or give the module "
                      "`prepare_input`, `prepare_output` or `replicate`",))


def check_split_sizes(ctx: Context) -> Iterator[Diagnostic]:
    """P413 (warning): colwise / rowwise split a dimension the tensor-parallel size divides;
    P414: the vocabulary under `loss_parallel` is divisible; P419: `loss_parallel` is on the
    projection that makes the logits."""
    styles, tp = styled(ctx), tp_size(ctx)
    if not styles:
        return
    bad_attention = _bad_attention(ctx, tp) if tp else {}
    dtensor_fed = _dtensor_fed(_view(ctx))
    vocab = _vocabulary(ctx)
    view = _view(ctx)
    uneven, vocab_uneven, not_logits = [], [], []
    for i, (path, setting) in enumerate(styles.items()):
        style = setting.value
        if style.kind not in SPLIT or not view.splittable[i]:
            continue
        module = ctx.graph.module(path)
        if style.loss_parallel:
            if isinstance(module, nn.Linear) and vocab is not None and module.out_features != vocab[1]:
                not_logits.append(((setting.span, module.out_features, *vocab), path))
            elif tp and isinstance(module, nn.Linear) and module.out_features % tp:
                vocab_uneven.append(((setting.span, module.out_features), path))
            continue
        if not tp or tp == 1 or (bad_attention and (path in bad_attention or any(
                a in bad_attention for a in ctx.graph.ancestors(path)))):
            continue  # P411 / P412 already say it (`path` is within a bad attention module)
        # NOTE (torch 2.13, 2 gloo ranks): uneven shards of a weight are fine (an Embedding's
        # vocabulary rowwise, a colwise layer gathered with `output replicate`); what fails is a
        # rowwise Linear rebuilding its input with `DTensor.from_local`, which assumes equal
        # shards (`Sharding propagation failed for aten.mm`). So: the rowwise Linear, and the
        # colwise layer that hands it uneven local shards.
        # A colwise layer with `local_output false` hands on a DTensor, which knows its true
        # global shape: no `from_local` then, and its rowwise siblings are fine too.
        if style.kind == "rowwise" and view.linear[i]:
            if view.parents[i] in dtensor_fed:
                continue
            size, what = module.in_features, "in-features"
        elif style.kind == "colwise" and view.producer[i] and style.use_local_output is not False:
            size, what = ((module.embedding_dim, "embedding dim") if _is_embedding(module)
                          else (module.out_features, "out-features"))
        else:
            continue
        if size % tp:
            uneven.append(((setting.span, style.kind, what, size), path))
    for (span, kind, what, size), mods in by_key(uneven).items():
        yield err("P413", f"`{kind}` splits the {what} ({size}) of {listed(patterns(mods))} over tensor = {tp} "
                  "ranks unevenly", span, f"{size} % {tp} != 0", (
                      f"use {_choices(size)}, or pad the layer to a multiple of {tp}",
                      "between a colwise and a rowwise layer the activation is rebuilt with `DTensor.from_local`, "
                      "which assumes equal shards: the rowwise matmul fails in forward"))
    for (span, size), mods in by_key(vocab_uneven).items():
        yield err("P414", f"`loss_parallel` splits the vocabulary ({size}) of {listed(patterns(mods))} over "
                  f"tensor = {tp} ranks unevenly", span, f"{size} % {tp} != 0", (
                      f"pad the vocabulary to a multiple of {tp} (as Megatron and torchtitan do), or use "
                      f"{_choices(size)}; torch computes the right loss on unequal shards, but the ranks "
                      "then hold unequal logits and weights",), severity="warning")
    for (span, out, emb, size), mods in by_key(not_logits).items():
        yield err("P419", f"`loss_parallel` on {listed(patterns(mods))}, whose {out} out-features are not the "
                  f"vocabulary ({size}, the size of `{emb}`)", span, "not the output projection", (
                      "put `loss_parallel` on the projection that makes the logits (`lm_head`, `output`) and "
                      "give this module `output replicate` or a rowwise consumer",))


def _dtensor_fed(view: _View) -> set[str]:
    """Modules whose colwise children all hand on DTensors (`local_output false`): a rowwise
    child of theirs reads no local shards."""
    local: dict[str, bool] = {}
    for setting, producer, parent in zip(view.styles.values(), view.producer, view.parents):
        if producer:
            local[parent] = local.get(parent, False) or setting.value.use_local_output is not False
    return {parent for parent, any_local in local.items() if not any_local}


def check_sequence_length(ctx: Context) -> Iterator[Diagnostic]:
    """P415: under sequence parallel, the sequence length of each `input = BxS` the plan writes
    is divisible by the tensor-parallel size (no input shape in the plan: nothing to check)."""
    styles = styled(ctx)
    sp = next((s for s in styles.values() if s.value.kind == "sequence"
               or SEQ in (s.value.input_layouts or ()) or SEQ in (s.value.output_layouts or ())), None)
    if sp is None:
        return
    for s in ctx.plan.statements:
        if not isinstance(s, st.ExpectMetric) or s.input_shape is None or len(s.input_shape) != 2:
            continue
        tp, seq = tp_size(ctx, s.world), s.input_shape[1]
        if not tp or not seq or seq % tp == 0:
            continue
        lower, upper = seq - seq % tp, seq - seq % tp + tp
        yield err("P415", f"sequence parallel splits each sequence over tensor = {tp} ranks, but `input = "
                  f"{'x'.join(map(str, s.input_shape))}` has {seq} tokens", sp.span, f"{seq} tokens % {tp} != 0",
                  (f"use a sequence length that is a multiple of {tp}" + (f" ({lower} or {upper})" if lower else
                                                                           f" ({upper})"),),
                  related=((s.input_span or s.span, "this input"),))


# ===================================================================== P416 / P417: layouts chain


def _producer(style: TensorStyle) -> bool:
    """A colwise style whose output stays sharded on the features (`Shard(-1)`), loss parallel aside."""
    return style.kind == "colwise" and not style.loss_parallel and _is_last(output_layout(style))


def check_colwise_consumed(ctx: Context) -> Iterator[Diagnostic]:
    """P416 (warning): every colwise output left sharded on the features has a consumer.

    The consumer is looked for in the nearest enclosing module that holds another
    tensor-parallel module: among the modules after the colwise one in module order, and its
    siblings (a block calls `w2(act(w1(x)) * w3(x))` with `w3` registered after `w2`). A
    `prepare_output` / `prepare` on an enclosing module takes the output back too.
    """
    styles = styled(ctx)
    if not styles:
        return
    graph = ctx.graph
    view = _view(ctx)
    order, pres, ends, parents, producer = view.order, view.pres, view.ends, view.parents, view.producer
    vocab = _vocabulary(ctx)
    found = []
    for i, (path, setting) in enumerate(styles.items()):
        if not producer[i] or not view.splittable[i]:
            continue
        verdict, scope, first = None, "", None
        pre, end, parent = pres[i], ends[i], parents[i]
        for anc in graph.ancestors(path):
            above = styles.get(anc)
            if above is not None and STYLES[above.value.kind].prepares_output:
                verdict = True
                break
            lo = graph.pre(anc)
            hi = lo + graph.subtree_size(anc)
            for k in range(bisect.bisect_left(pres, lo), bisect.bisect_left(pres, hi)):
                q_pre = pres[k]
                # q is anc, within path, or path within q; or another producer
                if q_pre == lo or pre <= q_pre < end or q_pre <= pre < ends[k] or producer[k]:
                    continue
                if not (q_pre > pre or parents[k] == parent):
                    continue
                if view.consumer[k]:
                    verdict = True
                    break
                first = first or order[k]
            if verdict or first is not None:
                scope = anc
                break
        if verdict:
            continue
        module = graph.module(path)
        logits = isinstance(module, nn.Linear) and vocab is not None and module.out_features == vocab[1]
        found.append(((setting.span, logits, pattern(scope) if first else None,
                       None if first is None else (pattern(first), styles[first].value.kind)), path))
    for (span, logits, scope, nxt), mods in by_key(found).items():
        where = f"the next tensor-parallel module in `{scope or '<root>'}`, {listed([nxt[0]])}, is " \
                f"`{nxt[1]}`" if nxt else "no rowwise layer or `prepare_input` follows it"
        what = "the logits stay sharded on the vocabulary" if logits else "the output stays sharded on the last dim"
        fixes = (("write `{ output replicate }` to gather the logits, or `{ loss_parallel }` to compute the loss "
                  "on the shards (in `applied.loss_parallel()`)",) if logits else
                 ("add the rowwise layer that consumes it (`parallel <path> rowwise`), a `prepare_input` on its "
                  "consumer, or write `{ output replicate }`",))
        yield err("P416", f"`colwise` on {listed(patterns(mods))}: {what} (`Shard(-1)`), and {where}", span,
                  "output `Shard(-1)` not taken back", fixes, severity="warning")


def check_rowwise_fed(ctx: Context) -> Iterator[Diagnostic]:
    """P422 (warning): a rowwise Linear reading `Shard(-1)` (its default input) has a colwise
    producer before it: a nearest enclosing module that holds another tensor-parallel module
    holds, before it or beside it, a colwise layer left `Shard(-1)`. Otherwise its input is a
    full-width local tensor that `DTensor.from_local` reads as 1/tp of the features."""
    styles = styled(ctx)
    if not styles:
        return
    graph = ctx.graph
    view = _view(ctx)
    order, pres, ends, parents, producer = view.order, view.pres, view.ends, view.parents, view.producer
    found = []
    for i, (path, setting) in enumerate(styles.items()):
        if not view.rowwise_reader[i]:
            continue
        fed, first = False, None
        pre, end, parent = pres[i], ends[i], parents[i]
        for anc in graph.ancestors(path):
            lo = graph.pre(anc)
            hi = lo + graph.subtree_size(anc)
            for k in range(bisect.bisect_left(pres, lo), bisect.bisect_left(pres, hi)):
                q_pre = pres[k]
                if q_pre == lo or pre <= q_pre < end or q_pre <= pre < ends[k]:  # anc, within path, path within it
                    continue
                if not (q_pre < pre or parents[k] == parent):
                    continue
                if producer[k]:
                    fed = True
                    break
                first = first or order[k]
            if fed or first is not None:
                break
        if not fed:
            found.append(((setting.span, None if first is None else (pattern(first), styles[first].value.kind)), path))
    for (span, before), mods in by_key(found).items():
        where = (f"the tensor-parallel module before it, {listed([before[0]])}, is `{before[1]}`" if before
                 else "no colwise layer comes before it")
        yield err("P422", f"`rowwise` on {listed(patterns(mods))} reads its input as sharded on the last dim "
                  f"(`Shard(-1)`), but {where}", span, "input `Shard(-1)` from nowhere", (
                      "make the layers that feed it `colwise`, or write `{ input replicate }` if its input is "
                      "whole on every rank",), severity="warning")


def _sequence_regions(ctx: Context, styles: dict[str, Setting]) -> dict[str, Setting]:
    """Module -> the style that makes its children see sequence-sharded activations (`Shard(1)`):
    the parent of a `sequence` style or of an `input shard(1)`; the parent of an Embedding
    with `output shard(1)` (the stream starts there) and the grandparent of any other module
    with `output shard(1)` (a block's last projection: its block's caller holds the result)."""
    regions: dict[str, Setting] = {}
    judged: dict[int, tuple[bool, bool]] = {}  # each distinct style read once
    for path, setting in styles.items():
        style = setting.value
        if not path:
            continue
        flags = judged.get(id(style))
        if flags is None:
            flags = judged[id(style)] = (
                style.kind == "sequence" or SEQ in (style.input_layouts or ())
                or any(lay == SEQ for _, lay in style.input_kwarg_layouts),
                SEQ in (style.output_layouts or ()))
        if flags[0]:
            regions.setdefault(_parent(path), setting)
        if flags[1]:
            region = _parent(path) if _is_embedding(ctx.graph.module(path)) else _parent(_parent(path))
            regions.setdefault(region, setting)
    return regions


def _sequence_norms(ctx: Context, styles: dict[str, Setting]) -> list[tuple[str, Setting]]:
    """(norm, the style to point at) for each norm with weights in a sequence region that is not `sequence`
    (`styles` is `styled(ctx)`; once per context)."""
    return ctx.memo("tensor.sequence_norms", lambda: _find_sequence_norms(ctx, styles))


def _find_sequence_norms(ctx: Context, styles: dict[str, Setting]) -> list[tuple[str, Setting]]:
    out = []
    for region, cause in _sequence_regions(ctx, styles).items():
        for child in ctx.graph.children(region):
            own = styles.get(child)
            if ("Norm" in ctx.graph.cls(child) and ctx.graph.own_params(child)
                    and (own is None or own.value.kind != "sequence")):
                out.append((child, own or cause))
    return out


def check_sequence_norms(ctx: Context) -> Iterator[Diagnostic]:
    """P417: a norm with weights between sequence-sharded activations has the `sequence` style."""
    styles = styled(ctx)
    if not styles:
        return
    found = [((setting.span, setting.value.kind if styles.get(norm) is setting else None), norm)
             for norm, setting in _sequence_norms(ctx, styles)]
    for (span, kind), mods in by_key(found).items():
        names = patterns(mods)
        has = f"`{kind}`" if kind else "no style"
        yield err("P417", f"{listed(names)} {'sits' if len(names) == 1 else 'sit'} between sequence-sharded activations "
                  f"(`Shard(1)`) with {has}, not `sequence`", span,
                  "sees 1/tp of the tokens" if kind else "shards the activations around it on the sequence", (
                      "write " + ", ".join(f"`parallel {n} sequence`" for n in names[:3])
                      + ": otherwise the norm's weight gradient misses the other ranks' tokens and the "
                      "tensor-parallel ranks drift apart",))


# ===================================================================== P421: tied placements


def _placement(ctx: Context, styles: dict[str, Setting], owner: str, local: str) -> str:
    """How the styles place one owner's parameter on the tensor axis, in words."""
    own = styles.get(owner)
    if own is not None and own.value.kind in SPLIT:
        dim = tensor_param_dim(own.value.kind, ctx.graph.cls(owner).endswith("Embedding"), local)
        return "replicated" if dim is None else f"Shard({dim})"
    if any(p in styles and styles[p].value.kind in COVER_SUBTREE for p in [owner, *ctx.graph.ancestors(owner)]):
        return "replicated"
    return "not on the tensor axis"


def check_tied_placements(ctx: Context) -> Iterator[Diagnostic]:
    """P421: a tied parameter gets the same tensor-parallel placement from each of its owners."""
    styles = styled(ctx)
    if not styles:
        return
    graph = ctx.graph
    for canon, owners in graph.tied.items():
        places = {}
        for owner in owners:
            local = next((lo for lo, c in graph.own_params(owner) if c == canon), "weight")
            places[owner] = _placement(ctx, styles, owner, local)
        if len(set(places.values())) < 2:
            continue
        lines = [o for o in owners if o in styles]
        if not lines:
            continue
        first = lines[0]
        related = tuple((styles[o].span, f"`{o}`: {places[o]}") for o in lines[1:] if styles[o].span != styles[first].span)
        shown = "; ".join(f"`{o}` {places[o]}" for o in owners)
        yield err("P421", f"`{canon}` is tied, and its owners place it differently on the tensor axis: {shown}",
                  styles[first].span, f"`{first}`: {places[first]}", (
                      "give the owners styles that place it alike: an embedding `rowwise` and its output projection "
                      "`colwise` both split the vocabulary (`Shard(0)`); keep both in one FSDP unit (P301)",),
                  related=related)
