"""`planc explain`: the resolved plan as people read it, with the per-rank memory estimate.

Prints the module tree folded to units, one table row per unit (modules, parameters, bytes
per rank sharded and unsharded, precision, offload, reshard, prefetch) and, for every
setting, the plan line that set it; then the memory of one training step per rank: the
peak, its breakdown and moment, the lower bound and the unsharded (DDP-like) baseline.
`--simulate` adds one step measured in a fake process group next to the estimate;
`--plot FILE` draws memory over the step. Text or JSON; colour only on a terminal. A plan
whose `expect` lines fail is still explained (P502 sends people here for the breakdown):
the failures go to stderr and the exit status is 1.
"""

from __future__ import annotations

import json
from typing import Any

from planc.estimate.memory import CATEGORIES, Estimate
from planc.lower.job import EXPERT, FORWARD, FULL_BACKWARD, LossParallel, Reader, ShardBatch
from planc.lower.program import (
    AttendOverContext,
    Checkpoint,
    Compile,
    DispatchExperts,
    FullyShard,
    Parallelize,
    Policy,
    SetPrefetch,
    UnitMethod,
)
from planc.quantities import show_bytes, show_count
from planc.resolve.experts import expert_degrees
from planc.resolve.ir import Unit
from planc.resolve.mesh import Role
from planc.resolve.options import show_value
from planc.resolve.styles import OWN, STYLES, SUBTREE

LABELS = {"sharded_params": "sharded params", "sharded_grads": "sharded grads", "optimizer_state": "optimizer state",
          "unsharded_params": "unsharded params", "all_gather": "all-gather buffers",
          "reduce_scatter": "reduce-scatter buffers", "unsharded_grads": "unsharded grads",
          "activations": "activations", "optimizer_temp": "optimizer temporaries", "inputs": "inputs",
          "buffers": "module buffers"}
SHOWN_SETTINGS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_inputs", "reshard_after_forward",
                  "offload", "prefetch_forward", "prefetch_backward", "checkpoint", "compile")






# ===================================================================== placements per mesh axis


def placement_text(placement) -> str:
    """A torch placement as `explain` writes it: `Shard(0)`, `Replicate()`, `_StridedShard(0, sf=2)`, `Partial()`."""
    name = type(placement).__name__
    if name == "_StridedShard":
        return f"_StridedShard({placement.dim}, sf={placement.split_factor})"
    if name == "Shard":
        return f"Shard({placement.dim})"
    return f"{name}()"


def parameter_placements(compiled, world: int) -> dict[str, dict[str, str]]:
    """Canonical parameter -> {mesh axis name: placement} as `planc.apply` leaves it, from the program.

    The tensor axis (`Parallelize` ops): colwise and rowwise shard the dims of
    `planc.lower.lowering.tensor_dims`, their other own parameters (a rowwise bias) are
    replicated; `replicate` and `sequence` replicate every parameter below their module
    (torch's `distribute_module` visits the subtree); `prepare_*` styles move none. The
    data-parallel axes (`FullyShard` ops): `Replicate()` on a replicate axis; on the shard axis
    (with a context axis: shard x context flattened, under its flattened name) `Shard(d)` (d = 0,
    or the `place` dim), `_StridedShard(d, sf=tp)` when tensor parallelism
    already shards d. A parameter no unit manages (ignored) has no data-parallel axis; one no
    style touches, no tensor axis (it is then a DTensor on the data-parallel submesh only).
    """
    from planc.lower.lowering import tensor_dims

    program, graph, mesh = compiled.program, compiled.graph, compiled.mesh
    sizes = mesh.sizes(world) or {}
    tensor_axis, tp = mesh.axis_name(Role.TENSOR), sizes.get(Role.TENSOR, 1)
    on_tensor: dict[str, int | None] = {}  # parameter -> tensor-parallel dim (None: replicated on the tensor axis)
    if tensor_axis is not None:
        dims = tensor_dims(program, graph)
        for op in program.of_type(Parallelize):
            if STYLES[op.style.kind].places == OWN:  # colwise, rowwise
                for _, canonical in graph.own_params(op.module):
                    on_tensor[canonical] = dims.get(canonical)
            elif STYLES[op.style.kind].places == SUBTREE:  # replicate, sequence
                for canonical in graph.subtree_params(op.module):
                    on_tensor.setdefault(canonical, None)
    out: dict[str, dict[str, str]] = {name: {} for name in graph.params}
    flat = {joined[0]: name for name, joined in mesh.flattened.items()}  # shard -> shard_context
    for op in program.units:
        placed = dict(op.placements)
        for name in op.params:
            dim = placed.get(name, 0)
            for axis in mesh.dp_axes:
                shown = flat.get(axis.name, axis.name)
                if axis.role == "replicate":
                    out[name][shown] = "Replicate()"
                elif name in on_tensor and on_tensor[name] == dim and tp > 1:
                    out[name][shown] = f"_StridedShard({dim}, sf={tp})"
                else:
                    out[name][shown] = f"Shard({dim})"
    for name, dim in on_tensor.items():
        out[name][tensor_axis] = "Replicate()" if dim is None else f"Shard({dim})"  # type: ignore[index]
    return out


def _unit_placements(unit: Unit, table: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    """A unit's parameters grouped by placement, names relative to the unit's module (first group: most)."""
    prefix = "" if unit.is_root or len(unit.modules) != 1 else unit.modules[0] + "."
    groups: dict[str, dict[str, Any]] = {}
    for name in unit.params:
        axes = table.get(name, {})
        key = json.dumps(axes, sort_keys=False)
        groups.setdefault(key, {"axes": axes, "params": []})["params"].append(
            name[len(prefix):] if prefix and name.startswith(prefix) else name)
    return list(groups.values())


# ===================================================================== the report as data


def _setting(unit: Unit, key: str, policy: Policy) -> dict[str, Any]:
    s = unit.settings[key]
    value = policy.reshard_after_forward if key == "reshard_after_forward" else s.value
    return {"value": show_value(value) if not isinstance(value, dict) else str(value),
            "set_by": s.rule, "line": f"{s.span.file}:{s.span.line}" if s.span else None}


def _sig(x: float | None) -> float | None:
    """Seconds to 9 significant digits: estimates, and stable across float summation orders."""
    return None if x is None else float(f"{x:.9g}")


def time_report(st) -> dict[str, Any]:
    """The step-time estimate (`planc.estimate.time.StepTime`) as JSON-ready data (seconds, bytes per rank)."""
    hw = st.hardware
    units = []
    for u in st.per_unit:
        units.append({
            "name": u.name,
            "collectives": [{"kind": c.kind, "axis": c.axis, "ranks": c.ranks, "bytes": c.bytes, "phase": c.phase,
                             "what": c.what, **({"times": c.times} if c.times != 1 else {})}
                            for c in u.collectives],
            "forward_flops": u.forward_flops, "backward_flops": u.backward_flops,
            "recompute_flops": u.recompute_flops, "compute_dtype": u.compute_dtype,
            "forward_s": _sig(u.forward_s), "backward_s": _sig(u.backward_s), "comm_s": _sig(u.comm_s),
            "exposed_s": _sig(u.exposed_s),
        })
    return {
        "estimate": True,
        "hardware": {"name": hw.name, "bf16_flops": hw.bf16_flops, "fp32_flops": hw.fp32_flops, "hbm_bw": hw.hbm_bw,
                     "gpus_per_node": hw.gpus_per_node,
                     "intra": {"alpha_s": hw.intra.alpha_s, "busbw": hw.intra.busbw},
                     "inter": {"alpha_s": hw.inter.alpha_s, "busbw": hw.inter.busbw},
                     "host_bw": hw.host_bw, "host_optimizer_bw": hw.host_optimizer_bw, "source": hw.source},
        "efficiency": st.efficiency,
        "units": units,
        "totals": {"bytes": st.totals(), "flops": sum(u.flops for u in st.per_unit), "model_flops": st.model_flops,
                   "compute_s": _sig(st.compute_s), "comm_s": _sig(st.comm_s), "exposed_comm_s": _sig(st.exposed_comm_s),
                   "optimizer_s": _sig(st.optimizer_s), "step_s": _sig(st.total_s), "tokens": st.tokens,
                   "tokens_per_s": _sig(st.tokens_per_s), "mfu": _sig(st.mfu)},
        "assumptions": list(st.assumptions),
    }


def _mesh(compiled, est: Estimate) -> dict[str, Any]:
    """`replicate` and `shard` sizes (as before), `tensor` when the mesh has a tensor axis, and
    `axes`: every `DeviceMesh` axis planc builds (`axis`: its name; "dim" is only a tensor dimension),
    outermost first, with its role and size."""
    out: dict[str, Any] = {"replicate": est.replicate, "shard": est.shard}
    sizes = compiled.mesh.sizes(est.world) or {}
    if compiled.mesh.axis(Role.TENSOR) is not None:
        out["tensor"] = sizes.get("tensor")
    if compiled.mesh.axis(Role.CONTEXT) is not None:
        out["context"] = sizes.get("context")
    degrees = expert_degrees(compiled.mesh, sizes) if compiled.mesh.axis(Role.EXPERT) is not None else None
    if degrees is not None:  # the expert view: expert ranks x the experts' FSDP ranks (efsdp)
        view = [a for v in compiled.job.views if v.name == EXPERT for a in v.axes]
        out["expert"] = {"expert": degrees[0], "efsdp": degrees[1], "mesh": [{"axis": a.name, "size": a.size} for a in view]}
    out["axes"] = [{"axis": a.name, "role": a.role, "size": sizes.get(a.role)} for a in compiled.mesh.device_axes]
    for name, (shard, context) in compiled.mesh.flattened.items():  # FSDP's one axis: shard x context
        joined = [a for a in out["axes"] if a["axis"] in (shard, context)]
        size = (joined[0]["size"] or 0) * (joined[1]["size"] or 0) or None
        at = out["axes"].index(joined[0])
        out["axes"] = [a for a in out["axes"] if a not in joined]
        out["axes"].insert(at, {"axis": name, "role": "shard x context", "size": size})
    return out


# What explain shows: per unit its FSDP settings, prefetch lists and unit methods (from the
# resolution the ops were lowered from), each parameter's placement per axis (`Parallelize`,
# `FullyShard`), checkpointing and compile as settings; the one step's estimates (a context plan's
# `AttendOverContext` and `ShardBatch` are in them: one context rank's step; `DispatchExperts`: one
# expert rank's step, balanced routing).
READER = Reader("explain", (FullyShard, Parallelize, AttendOverContext, DispatchExperts, Checkpoint, Compile, SetPrefetch,
                            UnitMethod),
                (FORWARD, FULL_BACKWARD), (LossParallel, ShardBatch))


def report(compiled, est: Estimate, measured=None, model_ref: str | None = None, step_time=None) -> dict[str, Any]:
    """Everything `explain` shows, as JSON-ready data (bytes are per rank)."""
    if est.roles:  # a pipeline job: a table per stage and the binding rank (planc/analysis/stages.py)
        from planc.analysis import role_report as stages
        return stages.report(compiled, est, model_ref, step_time)
    READER.compiled(compiled)
    res = compiled.resolution
    table = parameter_placements(compiled, est.world)
    prefetch = {(op.unit, op.direction): list(op.targets) for op in compiled.program.of_type(SetPrefetch)}  # expert
    units = []  # plans' automatic prefetch lists included
    for u, m in zip(compiled.units, est.units):
        units.append({
            "name": u.name, "modules": list(u.modules) if not u.is_root else [""], "root": u.is_root,
            "params": m.params, "sharded_bytes": m.sharded, "unsharded_bytes": m.unsharded,
            "grad_bytes": m.grads, "optimizer_bytes": m.optimizer, "offload": m.offload,
            "prefetch_forward": prefetch.get((u.name, "forward"), []),
            "prefetch_backward": prefetch.get((u.name, "backward"), []),
            "settings": {k: _setting(u, k, compiled.program.unit(u.name).policy) for k in SHOWN_SETTINGS},
            "defined_by": u.rule or None, "line": f"{u.span.file}:{u.span.line}" if u.span else None,
            "placements": _unit_placements(u, table),
        })
    peak = est.peak
    out: dict[str, Any] = {
        "plan": compiled.plan.file, "model": model_ref or compiled.plan.model_ref,
        "world_size": est.world, "mesh": _mesh(compiled, est),
        "optimizer": est.optimizer, "input_shape": list(est.input_shape) if est.input_shape else None,
        "units": units,
        "totals": {"params": sum(p.numel for p in compiled.graph.params.values()),
                   "units": len(compiled.units),
                   "sharded_state_bytes": est.sharded_state, "host_bytes": est.host,
                   "replicated_param_bytes": est.replicated,
                   "ignored": sorted(res.ignored)},
        "memory": {
            "peak_bytes": peak.total, "moment": peak.label, "phase": peak.phase,
            "breakdown": {k: v for k, v in peak.bytes.items() if v},
            "activations_bytes": est.activations, "activations_from": est.source,
            "lower_bound_bytes": est.lower_bound, "ratio_to_lower_bound": round(est.ratio_to_lower_bound, 3),
            "unsharded_baseline_bytes": est.unsharded_peak_baseline,
            "notes": est.notes,
        },
    }
    if res.step is not None:  # the plan's `step` line (without one: one microbatch, nothing shown)
        acc = res.step.value
        out["step"] = {"microbatches": acc.microbatches, "gradient_sync": acc.sync, "text": acc.show(),
                       "line": f"{res.step.span.file}:{res.step.span.line}"}
    if step_time is not None:
        out["time"] = time_report(step_time)
    if measured is not None:
        out["simulated"] = {"rank": measured.rank, "peak_bytes": measured.peak, "moment": measured.moment,
                            "breakdown": measured.breakdown,
                            "estimate_over_measured": round(peak.total / measured.peak, 3) if measured.peak else None}
    return out


# ===================================================================== text


class _Style:
    def __init__(self, color: bool):
        self.color = color

    def __call__(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text

    def bold(self, t: str) -> str:
        return self(t, "1")

    def dim(self, t: str) -> str:
        return self(t, "2")


def _table(rows: list[list[str]], header: list[str], style: _Style) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) if c[:1].isdigit() else c.ljust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return [style.bold(line(header))] + [line(r) for r in rows]


def _tree(compiled, style: _Style) -> list[str]:
    """The module tree folded to units: only unit modules and their ancestors are shown."""
    g = compiled.graph
    unit_mods = {m: u for u in compiled.units if not u.is_root for m in u.modules}
    keep = set()
    for m in unit_mods:
        keep.add(m)
        keep.update(g.ancestors(m))
    root = next((u for u in compiled.units if u.is_root), None)
    lines = [f"<root>  {g.cls('')}" + (f"  {style.bold('unit <root>')}" if root else "  (no root unit)")]

    def walk(path: str, prefix: str) -> None:
        kids = [k for k in g.children(path) if k in keep]
        names = g.child_names(path)
        kid_names = {c: n for c, n in zip(g.children(path), names)}
        i = 0
        while i < len(kids):
            j = i  # fold runs of numbered siblings that are units of the same class and size
            while (j + 1 < len(kids) and kid_names[kids[j + 1]].isdigit() and kid_names[kids[i]].isdigit()
                   and g.cls(kids[j + 1]) == g.cls(kids[i]) and kids[j + 1] in unit_mods and kids[i] in unit_mods
                   and g.subtree_numel[kids[j + 1]] == g.subtree_numel[kids[i]]
                   and not any(k in keep for k in g.children(kids[i]))):
                j += 1
            last = j == len(kids) - 1
            branch, cont = ("└── ", "    ") if last else ("├── ", "│   ")
            label = kid_names[kids[i]] if i == j else f"{kid_names[kids[i]]}..{kid_names[kids[j]]}"
            u = unit_mods.get(kids[i])
            tag = ""
            if u is not None:
                tag = "  " + style.bold(f"unit {u.name}" if i == j else f"{j - i + 1} units")
            lines.append(f"{prefix}{branch}{label}  {g.cls(kids[i])}  {show_count(g.subtree_numel[kids[i]])}"
                         f"{' each' if j > i else ''}{tag}")
            walk(kids[i], prefix + cont)
            i = j + 1

    walk("", "")
    return lines


def _runs(units: list[dict], key) -> list[list[dict]]:
    """Consecutive units with equal `key(unit)`, grouped (transformer_layers.0..23)."""
    groups: list[list[dict]] = []
    for u in units:
        if groups and key(groups[-1][-1]) == key(u) and not u["root"]:
            groups[-1].append(u)
        else:
            groups.append([u])
    return groups


def _run_name(group: list[dict]) -> str:
    if len(group) == 1:
        return group[0]["name"]
    first, last = group[0]["name"], group[-1]["name"]
    prefix, _, _ = first.rpartition(".")
    tail = last[len(prefix) + 1:] if prefix and last.startswith(prefix + ".") else last
    return f"{first}..{tail} ({len(group)} units)"


def _own_settings(u: dict) -> list[str]:
    """Settings a unit got from rules other than `defaults`, with their lines."""
    return [f"{k}={s['value']} ({s['set_by']}, {s['line']})" if s["set_by"] != u["defined_by"] else
            f"{k}={s['value']}" for k, s in u["settings"].items() if s["line"] and s["set_by"] != "defaults"]


def _prefetch_cell(group: list[dict], key: str) -> str:
    """A run's prefetch list: the list when every unit has the same, else `N each` (each unit its
    own N targets: `per unit (N)`; expert parallelism's explicit prefetch)."""
    lists = {tuple(u[key]) for u in group}
    if len(lists) == 1:
        return ",".join(lists.pop()) or "-"
    sizes = {len(t) for t in lists}
    return f"per unit ({sizes.pop()})" if len(sizes) == 1 else "per unit"


def _row_key(u: dict) -> tuple:
    return (u["defined_by"], u["params"], u["sharded_bytes"], u["unsharded_bytes"], u["offload"],
            json.dumps(u["settings"], sort_keys=True), tuple(u["prefetch_backward"]) == ())


def _origin_key(u: dict) -> tuple:
    return (u["defined_by"], tuple(_own_settings(u)))


def _placement_lines(data: dict[str, Any], dims: list[str]) -> list[str]:
    """One line per placement of each run of units: `(shard: Shard(0), tensor: Shard(1))  o_proj.weight, ...`."""
    def text(axes: dict[str, str]) -> str:
        return "(" + ", ".join(f"{d}: {axes.get(d, '-')}" for d in dims) + ")"

    runs = _runs(data["units"], lambda u: (u["defined_by"], json.dumps(u["placements"])))
    width = max((len(_run_name(g)) for g in runs), default=0)
    cell = max((len(text(p["axes"])) for g in runs for p in g[0]["placements"]), default=0)
    lines = []
    for group in runs:
        for k, p in enumerate(group[0]["placements"]):
            names = p["params"]
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            lines.append(f"  {_run_name(group) if k == 0 else '':<{width}}  {text(p['axes']):<{cell}}  {shown}".rstrip())
    return lines


def _dtype_note(data: dict[str, Any], compiled) -> list[str]:
    """Why `sharded/rank` and `unsharded` can read the same (world 2, fp32 kept, bf16 gathered)."""
    stored = {str(p.dtype).removeprefix("torch.") for p in compiled.graph.params.values()}
    gathered = {u["settings"]["param_dtype"]["value"] for u in data["units"] if u["params"]}
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    stored = {short.get(d, d) for d in stored}
    if len(stored) != 1 or gathered <= stored | {None, "none", "-"}:
        return []
    return [f"  sharded/rank is the shard each rank keeps, in {stored.pop()}; unsharded is the whole unit as "
            f"all-gathered for compute, in {'/'.join(sorted(str(g) for g in gathered))}"]


def render_text(data: dict[str, Any], compiled, color: bool = False) -> str:
    if "pipeline" in data:
        from planc.analysis import role_report as stages
        return stages.render_text(data, color)
    style = _Style(color)
    mem = data["memory"]
    mesh = data["mesh"]
    tensor = f" x tensor {mesh['tensor']}" if mesh.get("tensor") is not None else ""
    if mesh.get("context") is not None:  # FSDP shards over shard x context, flattened
        tensor = f" (shard x context {mesh['context']}, flattened; one context rank's step)" + tensor
    if mesh.get("expert") is not None:
        e = mesh["expert"]
        view = " x ".join(f"{a['axis']} {a['size']}" for a in e["mesh"])
        tensor += (f"; experts: expert {e['expert']} x efsdp {e['efsdp']} on the expert mesh ({view}), "
                   f"one expert rank's step")
    out = [style.bold(f"plan {data['plan']}") + f"  model {data['model'] or '(given)'}  "
           f"world {data['world_size']} (replicate {mesh['replicate']} x shard {mesh['shard']}{tensor})  "
           f"optimizer {data['optimizer']}", ""]
    if "step" in data:
        out[-1:-1] = [f"step: {data['step']['text']} ({data['step']['line']})"]
    out += _tree(compiled, style) + [""]
    rows = []
    for group in _runs(data["units"], _row_key):
        u = group[0]
        s = u["settings"]
        pf, pb = _prefetch_cell(group, "prefetch_forward"), _prefetch_cell(group, "prefetch_backward")
        each = " each" if len(group) > 1 else ""
        rows.append([_run_name(group), show_count(u["params"]) + each, show_bytes(u["sharded_bytes"]),
                     show_bytes(u["unsharded_bytes"]),
                     f"{s['param_dtype']['value']}/{s['reduce_dtype']['value']}", s["reshard_after_forward"]["value"],
                     "cpu" if u["offload"] else "-", f"{pf} / {pb}"])
    out += _table(rows, ["unit", "params", "sharded/rank", "unsharded", "param/reduce", "reshard", "offload",
                         "prefetch fwd / bwd"], style)
    out += _dtype_note(data, compiled)
    if tensor:
        out += ["", style.bold("placements per mesh axis (" + " x ".join(a["axis"] for a in mesh["axes"]) + ")")]
        out += _placement_lines(data, [a["axis"] for a in mesh["axes"]])
    out += ["", style.bold("where each setting comes from")]
    from_defaults: dict[str, str] = {}
    for u in data["units"]:
        for key, st in u["settings"].items():
            if st["set_by"] == "defaults":
                from_defaults.setdefault(f"{key}={st['value']}", st["line"])
    if from_defaults:
        out.append("  defaults: " + ", ".join(f"{k} ({line})" for k, line in from_defaults.items()))
    width = max(len(_run_name(g)) for g in _runs(data["units"], _origin_key))
    for group in _runs(data["units"], _origin_key):
        u = group[0]
        origin = f"{u['defined_by']} ({u['line']})" if u["line"] else "the root (no `root` line)"
        own = _own_settings(u)
        out.append(f"  {_run_name(group):<{width}}  {origin}" + (": " + ", ".join(own) if own else ""))
    t = data["totals"]
    out += ["", f"total: {show_count(t['params'])} params in {t['units']} units; per rank "
                f"{show_bytes(t['sharded_state_bytes'])} params+grads+optimizer state on the device"
                + (f", {show_bytes(t['host_bytes'])} on the host (offloaded)" if t["host_bytes"] else "")
                + (f"; {show_bytes(t['replicated_param_bytes'])} of parameters not sharded"
                   if t["replicated_param_bytes"] else ""),
            ""]
    out.append(style.bold(f"memory per rank, one training step: peak {show_bytes(mem['peak_bytes'])}") +
               f" at {mem['moment']}")
    for key in CATEGORIES:
        v = mem["breakdown"].get(key)
        if v:
            out.append(f"  {LABELS[key]:<22} {show_bytes(v):>12}")
    out.append(f"  {'lower bound':<22} {show_bytes(mem['lower_bound_bytes']):>12}  "
               "(state kept on the device, plus the largest of: "
               f"one module gathered, the activations, the sharded grads; peak is {mem['ratio_to_lower_bound']:.2f}x)")
    out.append(f"  {'unsharded (DDP-like)':<22} {show_bytes(mem['unsharded_baseline_bytes']):>12}  (the same model, no sharding)")
    out.append(style.dim(f"  activations from: {mem['activations_from']}"))
    out.append(style.dim("  tensor bytes only: no CUDA context, NCCL workspaces or allocator fragmentation; "
                         "leave headroom"))
    for note in mem["notes"]:
        out.append(style.dim(f"  note: {note}"))
    if data.get("time"):
        out += [""] + _time_text(data["time"], style)
    sim = data.get("simulated")
    if sim:
        out += ["", style.bold(f"simulated (fake process group, rank {sim['rank']} of {data['world_size']}): "
                               f"peak {show_bytes(sim['peak_bytes'])}") + f" at {sim['moment']}; estimate/measured "
                                                                   f"{sim['estimate_over_measured']}"]
        for key in CATEGORIES:
            a, m = mem["breakdown"].get(key, 0), sim["breakdown"].get(key, 0)
            if a or m:
                out.append(f"  {LABELS.get(key, key):<22} {show_bytes(a):>12} estimated {show_bytes(m):>12} measured")
    return "\n".join(out)


# ===================================================================== step time

_KIND = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce",
         "host_to_device": "host->device", "device_to_host": "device->host"}


def seconds(s: float) -> str:
    """Seconds for people: s, ms, us."""
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} FLOP"


def _unit_bytes(u: dict, kind: str, phase: str | None = None, axis: str | None = None) -> int:
    """A unit's bytes of one collective kind per step (a collective run per microbatch counted each time)."""
    return sum(c["bytes"] * c.get("times", 1) for c in u["collectives"] if c["kind"] == kind
               and (phase is None or c["phase"] == phase) and (axis is None or c["axis"] == axis))


def _time_text(t: dict[str, Any], style: _Style) -> list[str]:
    tot = t["totals"]
    hw = t["hardware"]
    out = [style.bold(f"step time per rank, estimated: {seconds(tot['step_s'])}") +
           f" on {hw['name']} at {t['efficiency']:.0%} of peak FLOP/s (an estimate, not a measurement)"]
    if not tot["tokens_per_s"]:  # no input: the figure above is communication and the optimizer step only
        out[0] = (style.bold(f"step time per rank, estimated: {seconds(tot['step_s'])} of communication and optimizer "
                             "step only, no compute") + f" (no input shape; on {hw['name']}, an estimate)")
    rows = []

    def key(u: dict) -> tuple:
        return (u["forward_flops"], u["backward_flops"], u["recompute_flops"],
                tuple((c["kind"], c["phase"], c["bytes"], c["ranks"]) for c in u["collectives"]))

    for group in _runs([dict(u, root=u["name"] == "<root>") for u in t["units"]], key):
        u = group[0]
        each = " each" if len(group) > 1 else ""
        fsdp = [c for c in u["collectives"] if c["axis"] != "tensor"]
        rows.append([_run_name(group),
                     show_bytes(_unit_bytes(u, "all_gather", "forward", "shard")) + each,
                     show_bytes(_unit_bytes(u, "all_gather", "backward", "shard")),
                     show_bytes(_unit_bytes(u, "reduce_scatter", "backward", "shard")),
                     show_bytes(_unit_bytes(u, "all_reduce", "backward", "replicate")),
                     show_bytes(sum(c["bytes"] for c in u["collectives"] if c["axis"] == "tensor")),
                     flops(u["forward_flops"] + u["backward_flops"] + u["recompute_flops"]),
                     seconds(u["forward_s"] + u["backward_s"]),
                     seconds(u["comm_s"]) if fsdp or u["collectives"] else "-",
                     seconds(sum(g["exposed_s"] for g in group) / len(group))])
    out += _table(rows, ["unit", "all-gather fwd", "all-gather bwd", "reduce-scatter", "all-reduce (repl)",
                         "tensor axis", "FLOPs", "compute", "comm", "exposed"], style)
    by_kind = []
    for kind, axes in tot["bytes"].items():
        for axis, n in axes.items():
            by_kind.append(f"{_KIND.get(kind, kind)} {show_bytes(n)} ({axis})")
    out.append("  bytes per rank: " + (", ".join(by_kind) if by_kind else "none"))
    out.append(f"  compute {seconds(tot['compute_s'])} ({flops(tot['flops'])}), collectives busy {seconds(tot['comm_s'])}, "
               f"exposed {seconds(tot['exposed_comm_s'])}, optimizer step {seconds(tot['optimizer_s'])}")
    if tot["tokens_per_s"]:
        out.append(f"  {tot['tokens_per_s']:,.0f} tokens/s over the job, MFU {tot['mfu']:.1%} "
                   f"(model FLOPs {flops(tot['model_flops'])} per rank per step)")
    else:
        out.append("  FLOPs not counted: give an input shape (--input-shape BxS) for compute, tokens/s and MFU")
    for a in t["assumptions"]:
        out.append(style.dim(f"  assumes: {a}"))
    return out
