"""Activation checkpointing alone: `planc suggest`'s choice next to torch's `sac_milp`.

torch/distributed/_tools/sac_ilp.py decides, for each activation-checkpointing unit, the
fraction of its activation memory to discard (selective AC), minimising recomputation time
under a memory budget, from MemTracker (memory), RuntimeEstimator and SACEstimator
(operator benchmarks) run under FakeTensorMode. planc's search here is restricted to the
same decision: one checkpoint mode per block (none / selective / full), the rest of the plan
fixed (one unit per block, reshard true, one replica, no offload, implicit prefetch), with
planc's memory model and its step-time model.

Both run on the same model (the seed transformer in a small CPU-sized config) and the same
byte budgets; each uses its own memory model, so the report gives each tool's baseline
peak (nothing checkpointed) and the peak it claims for its choice.

    python benchmarks/sac_compare.py        # needs pulp and pwlf (torch's sac_ilp imports them)
"""

from __future__ import annotations

import contextlib
import json
import sys
import warnings

import torch

from planc import zoo
from planc.estimate.hardware import hardware
from planc.model.graph import ModelGraph
from planc.suggest.cost import context
from planc.suggest.evaluate import Evaluator
from planc.suggest.search import exact_peak
from planc.suggest.solve import Global, build, solve

CONFIG = zoo.SeedConfig(vocab_size=512, dim=256, n_layers=4, n_heads=4)
BATCH, SEQ, WORLD = 4, 1024, 8


def build_model():
    return zoo.seed_transformer(CONFIG)


@contextlib.contextmanager
def _h100_roofline():
    """torch's roofline cost model asks CUDA for the device's peak FLOPs and DRAM bandwidth;
    on this CPU-only machine, answer with an H100 SXM's (989 dense bf16 TFLOP/s, 3.35 TB/s),
    the peak numbers of planc's h100 profile, so both sides price compute alike."""
    from unittest import mock

    import torch.utils._runtime_estimation as est
    with mock.patch.object(torch.cuda, "is_available", lambda: True), \
            mock.patch.object(est, "get_device_tflops", lambda dtype: 989.0 if dtype != torch.float32 else 494.5), \
            mock.patch.object(est, "get_gpu_dram_gbps", lambda: 3350.0):
        yield


def torch_sac(budgets_gib):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.ilp_utils import aggregate_stats, get_peak_memory_runtime_baseline, parse_module_info
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator
    from torch.distributed._tools.sac_ilp import sac_milp
    dev = torch.device("cpu")
    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)  # planc's plans compute in bf16 too
        try:
            model = build_model()
        finally:
            torch.set_default_dtype(torch.float32)
        optim = torch.optim.AdamW(model.parameters(), foreach=True)
        inp = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), device=dev)
        mem = MemTracker()
        mem.track_external(model, optim)
        with mem:  # one step (MemTracker measures one iteration)
            model(inp).float().sum().backward()
            optim.step()
            optim.zero_grad()
        with _h100_roofline():
            rt = RuntimeEstimator()
            with rt("operator-level-cost-model"):
                model(inp).float().sum().backward()
            sac = SACEstimator()
            with sac("operator-level-cost-model"):
                model(inp).float().sum().backward()
    info = aggregate_stats(model, mem, rt, sac, dev)
    graph = parse_module_info(info)
    peak, runtime = get_peak_memory_runtime_baseline(graph)
    blocks = [f"SeedTransformer.transformer_layers.{i}" for i in range(len(model.transformer_layers))]
    out = {"baseline_peak_bytes": int(peak), "baseline_runtime_ms": runtime, "decisions": {}}
    for b in budgets_gib:
        decisions, recompute, bound = sac_milp(graph, memory_budget=b, world_size=WORLD, ac_units=blocks)
        out["decisions"][str(b)] = {"discard_fraction": {k.rsplit(".", 1)[-1]: round(v, 3) for k, v in decisions.items()},
                                    "recompute_ms": recompute, "peak_bound_bytes": bound}
    return out


def planc_ckpt_only(budgets_bytes):
    warnings.simplefilter("ignore")
    graph = ModelGraph.from_module(build_model())
    ev = Evaluator(graph, "benchmarks.sac_compare:build_model", max(WORLD, 1), (BATCH, SEQ))
    ctx = context(graph, WORLD, (BATCH, SEQ), hardware("h100"))
    sp = build(ev, Global(1, 1, 0, False), ctx)
    keep = [i for i, (m, r) in enumerate(sp.combos) if r is True]
    import numpy as np
    sp.combos = [sp.combos[i] for i in keep]
    sp.time, sp.d_kept = sp.time[:, keep], sp.d_kept[:, keep]
    sp.d_local = {k: v[:, keep] for k, v in sp.d_local.items()}
    base = exact_peak(ev, sp.candidate([0] * sp.n_units))[0]
    out = {"baseline_peak_bytes": base, "decisions": {}}
    for b in budgets_bytes:
        choice = solve(sp, b)
        if choice is None:
            out["decisions"][str(b)] = None
            continue
        c = sp.candidate(choice)
        out["decisions"][str(b)] = {"modes": list(c.checkpoint), "peak_bytes": exact_peak(ev, c)[0],
                                    "recompute_s": float(sp.seconds(choice) - sp.base_time)}
    del np
    return out


def main():
    planc_side = planc_ckpt_only([])
    base = planc_side["baseline_peak_bytes"]
    fractions = (1.0, 0.8, 0.6, 0.45)
    budgets = [int(base * f) for f in fractions]
    planc_side = planc_ckpt_only(budgets)
    try:
        torch_side = torch_sac([b / 2**30 for b in budgets])
    except Exception as err:  # pulp/pwlf missing, or the estimators refused this machine
        torch_side = {"error": f"{type(err).__name__}: {err}"}
    print(json.dumps({"benchmark": "sac_compare", "budgets_bytes": budgets, "planc": planc_side, "torch_sac_milp": torch_side},
                     default=str))


if __name__ == "__main__":
    sys.exit(main())
