"""Translate an accelerate FSDP config (YAML) into the equivalent plan: `planc import`.

accelerate keeps FSDP settings under `fsdp_config` (written by `accelerate config`):

    distributed_type: FSDP
    mixed_precision: bf16
    fsdp_config:
      fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
      fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
      fsdp_sharding_strategy: FULL_SHARD

`translate` turns that into plan text plus diagnostics (P7xx) located in the YAML file, one
for every setting that does not map. The units it writes are the ones accelerate's wrap
policies pick (torch's `transformer_auto_wrap_policy` / `size_based_auto_wrap_policy`);
tests/test_importer.py checks that against torch's own `_recursive_wrap`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from planc.diagnostics import Diagnostic, Span, suggestion
from planc.lang import printer
from planc.lang import syntax as st
from planc.lang.transform import parse_quantity
from planc.model.graph import ModelGraph

# FSDP1 ShardingStrategy, by name and by accelerate's 1-based number.
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
PRECISIONS = {"no": None, "fp16": "fp16", "bf16": "bf16", "fp8": None}
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")

# fsdp_config keys that configure checkpoint formats, loading or the launcher: not a plan's job.
SCRIPT_KEYS = {
    "fsdp_state_dict_type": "the checkpoint format is chosen where the script saves (DCP with FSDP2)",
    "fsdp_sync_module_states": "FSDP2 plans start from meta; the script initialises or loads weights",
    "fsdp_use_orig_params": "FSDP2 always keeps the original parameters",
    "fsdp_cpu_ram_efficient_loading": "loading is the script's job; plans build the model on meta",
    "fsdp_limit_all_gathers": "FSDP2 bounds in-flight all-gathers itself",
    "fsdp_activation_checkpointing_reentrant": "planc's checkpointing is non-reentrant",
}
TRANSLATED_KEYS = {
    "fsdp_version", "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params",
    "fsdp_sharding_strategy", "fsdp_reshard_after_forward", "fsdp_offload_params",
    "fsdp_activation_checkpointing", "fsdp_forward_prefetch", "fsdp_backward_prefetch",
    "fsdp_backward_prefetch_policy",
}
KNOWN_KEYS = TRANSLATED_KEYS | set(SCRIPT_KEYS)


@dataclass
class _Entry:
    """One YAML key's value and where it was written."""

    value: Any
    span: Span
    node: Any


# The nodes the importer builds come from no source text; they print through `planc.lang.printer`.
_NOWHERE = Span.point("<import>")


def _mesh(replicate: int | None, shard: int | None) -> st.MeshStmt:
    """`mesh (replicate = R, shard = S)`, None for `*`."""
    return st.MeshStmt(span=_NOWHERE, axes=(st.MeshAxis(span=_NOWHERE, name="replicate", size=replicate),
                                            st.MeshAxis(span=_NOWHERE, name="shard", size=shard)))


def _value(v: str | int) -> st.Value:
    if isinstance(v, int):
        return st.Number(span=_NOWHERE, value=v, text=str(v))
    return st.Name(span=_NOWHERE, value=v)


def _option(name: str, *positional: str | int, **keywords: str | int) -> st.Option:
    """A block option such as `precision param = bf16, reduce = bf16`."""
    args = [st.Arg(span=_NOWHERE, key=None, key_span=None, value=_value(v)) for v in positional]
    args += [st.Arg(span=_NOWHERE, key=k, key_span=_NOWHERE, value=_value(v)) for k, v in keywords.items()]
    return st.Option(span=_NOWHERE, name=name, name_span=_NOWHERE, args=tuple(args))


def _count(text: str) -> float:
    return parse_quantity(text)[0] if text[-1].isalpha() else float(text)


def _everywhere(*, classes: tuple[str, ...] = (), min_size: str | None = None) -> st.Selector:
    """`** : A | B` or `** where size >= 100M`: modules at any depth."""
    path = st.Path(span=_NOWHERE, segments=(st.Segment(span=_NOWHERE, pattern="**"),))
    guard = st.Guard(span=_NOWHERE, classes=classes) if classes else None
    where = st.Where(span=_NOWHERE, field="size", op=">=",
                     value=st.Number(span=_NOWHERE, value=_count(min_size), text=min_size)) if min_size else None
    return st.Selector(span=_NOWHERE, base=path, guard=guard, where=where)


@dataclass
class _Draft:
    """The plan being written: header comments, model, mesh, defaults options, rules."""

    header: list[str] = field(default_factory=list)
    model: str | None = None
    mesh: st.MeshStmt = field(default_factory=lambda: _mesh(1, None))
    defaults: list[st.Option] = field(default_factory=list)
    units: list[st.UnitStmt] = field(default_factory=list)
    checkpoints: list[st.CheckpointStmt] = field(default_factory=list)

    def text(self) -> str:
        """The plan in `planc fmt`'s canonical layout: a blank line between kinds of statement."""
        model = [printer.head(st.ModelStmt(span=_NOWHERE, ref=self.model))] if self.model else []
        groups = [[f"# {line}" if line else "#" for line in self.header] + model, [printer.head(self.mesh)]]
        defaults = st.DefaultsStmt(span=_NOWHERE, block=st.Block(span=_NOWHERE, options=tuple(self.defaults)))
        if len(self.defaults) == 1:
            groups.append([printer.statement(defaults)])
        elif self.defaults:
            groups.append(["defaults {", *(f"  {printer.text(opt)}" for opt in self.defaults), "}"])
        groups += [[printer.statement(s) for s in g] for g in (self.units, self.checkpoints) if g]
        return "\n\n".join("\n".join(g) for g in groups if g) + "\n"


class _Config:
    """The YAML document as values with spans (PyYAML's composed node tree has the marks)."""

    def __init__(self, file: str, root):
        self.file = file
        self.root = root

    def span(self, node) -> Span:
        start, end = node.start_mark, node.end_mark
        if end.line > start.line:  # block values end at the start of the next line
            return Span(self.file, start.line + 1, start.column + 1, start.line + 1, start.column + 2)
        return Span(self.file, start.line + 1, start.column + 1, end.line + 1, max(end.column + 1, start.column + 2))

    def mapping(self, node) -> dict[str, tuple[Any, Any]]:
        """key -> (key node, value node) of a YAML mapping node."""
        import yaml
        if not isinstance(node, yaml.MappingNode):
            return {}
        return {str(k.value): (k, v) for k, v in node.value}

    def entry(self, node) -> _Entry:
        import yaml
        value = yaml.safe_load(yaml.serialize(node)) if not isinstance(node, yaml.ScalarNode) \
            else yaml.SafeLoader("").construct_object(node)
        return _Entry(value, self.span(node), node)


def _error(code: str, message: str, span: Span | None, label: str = "", help_: tuple[str, ...] = (),
           severity: str = "error", notes: tuple[str, ...] = ()) -> Diagnostic:
    return Diagnostic(code=code, severity=severity, message=message, span=span, label=label, help=help_,
                      notes=notes)


def _bool(entry: _Entry, key: str, diags: list[Diagnostic]) -> bool | None:
    v = entry.value
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    diags.append(_error("P702", f"`{key}` must be true or false, found `{v}`", entry.span, "not a boolean"))
    return None


def _strategy(entry: _Entry, key: str, diags: list[Diagnostic]) -> str | None:
    v = entry.value
    if isinstance(v, int) and not isinstance(v, bool) or isinstance(v, str) and v.strip().isdigit():
        n = int(v)
        if 1 <= n <= len(STRATEGIES):
            return STRATEGIES[n - 1]
        diags.append(_error("P702", f"`{key}` number {n} is not a sharding strategy", entry.span, "not 1-5",
                            ("1 FULL_SHARD, 2 SHARD_GRAD_OP, 3 NO_SHARD, 4 HYBRID_SHARD, 5 HYBRID_SHARD_ZERO2",)))
        return None
    word = str(v).strip().upper().lstrip("_")
    if word in STRATEGIES:
        return word
    diags.append(_error("P702", f"unknown sharding strategy `{v}`", entry.span, "not a strategy",
                        suggestion(str(v), STRATEGIES) or ("strategies are " + ", ".join(STRATEGIES),)))
    return None


def _class_names(entry: _Entry) -> list[tuple[str, Span]]:
    """Class names from a comma-separated string or a YAML list, each with its own span."""
    import yaml
    node, cfg_file = entry.node, entry.span.file
    if isinstance(node, yaml.SequenceNode):
        items = []
        for item in node.value:
            s = item.start_mark
            items.append((str(item.value).strip(), Span(cfg_file, s.line + 1, s.column + 1, s.line + 1,
                                                        s.column + 1 + len(str(item.value)))))
        return [i for i in items if i[0]]
    text = str(entry.value)
    start = node.start_mark
    offset = 1 if getattr(node, "style", None) in ("'", '"') else 0
    one_line = node.end_mark.line == start.line
    out, pos = [], 0
    for part in text.split(","):
        name = part.strip()
        col = pos + part.index(name) if name else pos
        pos += len(part) + 1
        if not name:
            continue
        if one_line:
            c = start.column + offset + col + 1
            out.append((name, Span(cfg_file, start.line + 1, c, start.line + 1, c + len(name))))
        else:
            out.append((name, entry.span))
    return out


def _quantity(n: int) -> str:
    for suffix, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{suffix}"
    return str(n)


def translate(source: str, file: str = "<config>", *, graph: ModelGraph | None = None,
              model_ref: str | None = None) -> tuple[str | None, list[Diagnostic]]:
    """Translate accelerate config text into plan text.

    Args:
        source: the YAML text of an accelerate config.
        file: its path, for diagnostic spans.
        graph: the model, to check class names (did-you-mean) and to read `_no_split_modules`
            when the config names no classes (as accelerate does).
        model_ref: written as the plan's `model` line.

    Returns:
        The plan text (None when the file is not an accelerate FSDP config) and the
        diagnostics, errors included. A plan with errors is still written where possible.
    """
    import yaml

    diags: list[Diagnostic] = []
    try:
        root = yaml.compose(source)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        span = Span.point(file, mark.line + 1, mark.column + 1) if mark else Span.point(file)
        return None, [_error("P701", f"not valid YAML: {getattr(err, 'problem', None) or err}", span, "here")]
    cfg = _Config(file, root)
    top = cfg.mapping(root)
    if "fsdp_config" not in top:
        kind = cfg.entry(top["distributed_type"][1]).value if "distributed_type" in top else None
        return None, [_error("P701", "no `fsdp_config` section", Span.point(file), "",
                             (f"`distributed_type` is `{kind}`; planc imports FSDP configs" if kind else
                              "run `accelerate config` and choose FSDP, or write an `fsdp_config:` mapping",))]
    fsdp = {k: (cfg.span(kn), cfg.entry(vn)) for k, (kn, vn) in cfg.mapping(top["fsdp_config"][1]).items()}
    get = {k: e for k, (_, e) in fsdp.items()}
    draft = _Draft(model=model_ref)
    draft.header = [f"Imported from the accelerate config `{os.path.basename(file)}` by `planc import`."]

    if "distributed_type" in top:
        kind = cfg.entry(top["distributed_type"][1])
        if str(kind.value).upper() != "FSDP":
            diags.append(_error("P701", f"`distributed_type` is `{kind.value}`, not `FSDP`", kind.span,
                                "accelerate ignores fsdp_config", ("the plan below is what FSDP would do",),
                                severity="warning"))

    # --- unknown and script-only keys
    for key, (key_span, _entry) in fsdp.items():
        if key in SCRIPT_KEYS:
            diags.append(_error("P705", f"`{key}` is not part of a plan", key_span, "left to the script",
                                (SCRIPT_KEYS[key],), severity="note"))
        elif key not in KNOWN_KEYS:
            diags.append(_error("P706", f"unknown fsdp_config key `{key}`", key_span, "accelerate ignores it",
                                suggestion(key, KNOWN_KEYS), severity="warning"))

    version = get["fsdp_version"].value if "fsdp_version" in get else 1
    if version not in (1, 2, "1", "2"):
        diags.append(_error("P702", f"unknown fsdp_version `{version}`", get["fsdp_version"].span, "not 1 or 2"))

    _sharding(cfg, top, get, draft, diags)

    if "mixed_precision" in top:
        _precision(cfg.entry(top["mixed_precision"][1]), draft, diags)

    _offload_and_prefetch(get, draft, diags)

    # --- auto wrap policy: the units
    selector = _wrap_selector(get, graph, diags, draft, file)
    if selector:
        draft.units.append(st.UnitStmt(span=_NOWHERE, target=selector, block=None))
    if "fsdp_activation_checkpointing" in get:
        entry = get["fsdp_activation_checkpointing"]
        if _bool(entry, "fsdp_activation_checkpointing", diags):
            if selector:
                # accelerate checkpoints exactly the modules its wrap policy wraps
                draft.checkpoints.append(st.CheckpointStmt(
                    span=_NOWHERE, selector=selector, mode=st.Name(span=_NOWHERE, value="full")))
            else:
                diags.append(_error("P704", "activation checkpointing without a wrap policy", entry.span,
                                    "checkpoints nothing", ("accelerate checkpoints the modules its auto wrap "
                                                            "policy picks; with none it checkpoints nothing",),
                                    severity="warning"))
    if not model_ref:
        draft.header.append("No `model` line: add one, or check with `planc check PLAN --model MODULE:CALLABLE`.")
    from planc.diagnostics import sort_diagnostics
    return draft.text(), sort_diagnostics(diags)


def _sharding(cfg: _Config, top: dict, get: dict[str, _Entry], draft: _Draft, diags: list[Diagnostic]) -> None:
    """The sharding strategy as the plan's mesh and `reshard after_forward` default."""
    strategy, reshard = "FULL_SHARD", None
    if "fsdp_sharding_strategy" in get:
        strategy = _strategy(get["fsdp_sharding_strategy"], "fsdp_sharding_strategy", diags) or strategy
    if "fsdp_reshard_after_forward" in get:  # accelerate >= 1.6: bool (FSDP2) or a strategy (FSDP1)
        entry = get["fsdp_reshard_after_forward"]
        if isinstance(entry.value, bool) or str(entry.value).lower() in ("true", "false"):
            reshard = _bool(entry, "fsdp_reshard_after_forward", diags)
        else:
            strategy = _strategy(entry, "fsdp_reshard_after_forward", diags) or strategy
    if reshard is None and strategy != "NO_SHARD":
        reshard = strategy in ("FULL_SHARD", "HYBRID_SHARD")
    if strategy == "NO_SHARD":
        draft.mesh = _mesh(None, 1)
    elif strategy.startswith("HYBRID"):
        procs = top.get("num_processes")
        machines = top.get("num_machines")
        p = cfg.entry(procs[1]).value if procs else None
        m = cfg.entry(machines[1]).value if machines else None
        if isinstance(p, int) and isinstance(m, int) and m >= 1 and p % m == 0:
            # FSDP1 hybrid sharding shards within a machine and replicates across machines
            draft.mesh = _mesh(None, p // m)
        else:
            draft.mesh = _mesh(None, 8)
            where = (get.get("fsdp_sharding_strategy") or get.get("fsdp_reshard_after_forward")).span
            diags.append(_error("P704", "hybrid sharding without `num_processes` and `num_machines`", where,
                                "shard group size unknown", ("assumed 8 ranks per machine; edit the `mesh` line",),
                                severity="warning"))
    if reshard is not None:
        draft.defaults.append(_option("reshard", after_forward="true" if reshard else "false"))


def _precision(mp: _Entry, draft: _Draft, diags: list[Diagnostic]) -> None:
    """Top-level `mixed_precision`: accelerate uses MixedPrecision(dtype, dtype, dtype)."""
    word = str(mp.value).lower()
    if word not in PRECISIONS:
        diags.append(_error("P702", f"unknown mixed_precision `{mp.value}`", mp.span, "not a precision",
                            suggestion(word, PRECISIONS) or ("write no, bf16, fp16 or fp8",)))
    elif word == "fp8":
        diags.append(_error("P704", "fp8 training is not a sharding setting", mp.span, "not translated",
                            ("FSDP2 all-gathers fp8 weights through torchao's float8 training, set up in "
                             "the script; the plan keeps fp32 parameters",), severity="warning"))
    elif PRECISIONS[word]:
        dt = PRECISIONS[word]
        draft.defaults.insert(0, _option("precision", param=dt, reduce=dt))
        draft.header.append(f"accelerate reduces gradients in {dt}; torchtitan reduces in fp32 "
                            "(`reduce = fp32`), which is safer for long runs.")


def _offload_and_prefetch(get: dict[str, _Entry], draft: _Draft, diags: list[Diagnostic]) -> None:
    """CPU offload and FSDP1's prefetch keys, as defaults or warnings where FSDP2 has no equivalent."""
    if "fsdp_offload_params" in get and _bool(get["fsdp_offload_params"], "fsdp_offload_params", diags):
        draft.defaults.append(_option("offload", "cpu"))
    if "fsdp_forward_prefetch" in get and _bool(get["fsdp_forward_prefetch"], "fsdp_forward_prefetch", diags):
        draft.defaults.append(_option("prefetch", forward=1))  # FSDP1: prefetch the next all-gather in forward
    for key in ("fsdp_backward_prefetch", "fsdp_backward_prefetch_policy"):
        if key in get:
            entry = get[key]
            word = str(entry.value).upper()
            if word not in BACKWARD_PREFETCH:
                diags.append(_error("P702", f"unknown backward prefetch `{entry.value}`", entry.span, "",
                                    suggestion(word, BACKWARD_PREFETCH)))
            elif word != "BACKWARD_PRE":  # FSDP2's implicit backward prefetch is BACKWARD_PRE
                diags.append(_error("P704", f"`{word}` has no FSDP2 equivalent", entry.span, "not translated",
                                    ("FSDP2 always prefetches the next unit in backward (like BACKWARD_PRE); "
                                     "explicit lists are `prefetch backward = [...]`",), severity="warning"))


def _wrap_selector(get: dict[str, _Entry], graph: ModelGraph | None, diags: list[Diagnostic],
                   draft: _Draft, file: str) -> st.Selector | None:
    """The selector accelerate's auto wrap policy amounts to, or None for no units but the root."""
    policy_entry = get.get("fsdp_auto_wrap_policy")
    policy = str(policy_entry.value).upper() if policy_entry else "NO_WRAP"
    if policy_entry and policy not in WRAP_POLICIES:
        diags.append(_error("P702", f"unknown auto wrap policy `{policy_entry.value}`", policy_entry.span,
                            "not a policy", suggestion(policy, WRAP_POLICIES) or
                            ("policies are " + ", ".join(WRAP_POLICIES),)))
        return None
    if policy == "TRANSFORMER_BASED_WRAP":
        entry = get.get("fsdp_transformer_layer_cls_to_wrap")
        names = _class_names(entry) if entry and entry.value else []
        if not names:
            no_split = sorted(getattr(graph.model, "_no_split_modules", None) or []) if graph else []
            if not no_split:
                diags.append(_error("P702", "TRANSFORMER_BASED_WRAP without class names", policy_entry.span,
                                    "wraps what?", ("set `fsdp_transformer_layer_cls_to_wrap`, or pass "
                                                    "`--model` to use the model's `_no_split_modules` as "
                                                    "accelerate does",)))
                return None
            draft.header.append("Classes from the model's `_no_split_modules`, as accelerate does when "
                                "`fsdp_transformer_layer_cls_to_wrap` is unset.")
            names = [(n, policy_entry.span) for n in no_split]
        if graph is not None:
            for name, span in names:
                if name not in graph.class_names:
                    diags.append(_error("P703", f"no module of the model is a `{name}`", span, "unknown class",
                                        suggestion(name, graph.class_names) or
                                        ("run `planc tree --model ...` to see the classes",)))
        # torch's transformer_auto_wrap_policy wraps every instance, at any depth
        return _everywhere(classes=tuple(dict.fromkeys(n for n, _ in names)))
    if policy == "SIZE_BASED_WRAP":
        entry = get.get("fsdp_min_num_params")
        n = entry.value if entry else 0
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            diags.append(_error("P702", f"`fsdp_min_num_params` must be a whole number, found `{n}`",
                                entry.span, "not a count"))
            return None
        if n == 0:
            diags.append(_error("P704", "SIZE_BASED_WRAP without `fsdp_min_num_params`", policy_entry.span,
                                "wraps nothing", ("accelerate applies no size policy when the minimum is 0 or "
                                                  "unset; set `fsdp_min_num_params`",), severity="warning"))
            return None
        if graph is not None and "MultiheadAttention" in graph.class_names:
            diags.append(_error("P704", "the model has `nn.MultiheadAttention` modules", entry.span,
                                "FSDP1 treats them as leaves", (
                                    "FSDP1's size policy never wraps a MultiheadAttention nor anything in "
                                    "it; the plan may make one a unit: compare with `planc explain`",),
                                severity="warning"))
        return _everywhere(min_size=_quantity(n))
    return None
