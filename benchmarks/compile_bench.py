"""Benchmark planc's compile pipeline: graph building, then parse + resolve + validate.

Two workloads, both on the meta device (no memory, no GPU):

* a Llama-3-405B-shaped model (`benchmarks/_llama405b.py`, 126 blocks, ~1.4k modules) with a
  torchtitan-style plan (`tok_embeddings`, `layers.*`, `[norm, output]`, root);
* synthetic trees of 1k, 10k and 100k modules with plans of 1, 4 and 16 rules, to show how
  compile time grows with modules x rules (target: no worse than linear).

Graph building (`ModelGraph.from_module`) is timed apart from compiling, since a CLI run
pays it once per model and an editor integration can cache it. Compile is timed on a fresh
graph each repeat (cold caches), which is what one `planc check` pays.

Usage (from the repository root):

    python benchmarks/compile_bench.py            # full run
    python benchmarks/compile_bench.py --quick    # 1k and 10k trees, fewer repeats

Prints a table and, last, one JSON line with every median (milliseconds).
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import planc  # noqa: E402
from planc.compiler import CompiledPlan  # noqa: E402
from planc.model.graph import ModelGraph  # noqa: E402

# Rules for the synthetic tree, in the order plans of 1, 4 and 16 rules take them. Together
# they use every selector form: `*`, `**`, slices, alternation, globs, class guards, regexes,
# `where size`, `except`, groups, `optional`, and parameter selectors.
SYNTHETIC_RULES = [
    "unit blocks.*",
    "unit blocks.*.mlp : MLP",
    "checkpoint blocks.* except blocks[-1]",
    "unit [norm, output] { reshard after_forward = false }",
    "defaults { precision param = bf16, reduce = fp32 }",
    "unit blocks[-2:] { reshard after_forward = false }",
    "compile blocks.*",
    "unit blocks.*.attn : Attention | Other",
    "optional unit **.experts",
    'unit re"blocks\\.\\d+\\.attn" { prefetch forward = 1 }',
    "ignore **.norm.bias",
    "unit blocks.*.mlp where size >= 1",
    "expect unit blocks.*",
    "expect units >= 1",
    "unit blocks.{0,1}.n*",
    "place blocks.*.mlp.{w1,w3}.weight Shard(0)",
]


class Leaf(nn.Module):
    """A parameterised leaf, as cheap to build as a module can be."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 8))
        if bias:
            self.bias = nn.Parameter(torch.empty(8))

    def forward(self, x):
        return x @ self.weight


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = Leaf(), Leaf(), Leaf(), Leaf()

    def forward(self, x):
        return self.wo(self.wq(x) + self.wk(x) + self.wv(x))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = Leaf(), Leaf(), Leaf()

    def forward(self, x):
        return self.w2(self.w1(x) * self.w3(x))


class Block(nn.Module):
    """12 modules: itself, two norms, attention (itself + 4), MLP (itself + 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = Leaf(bias=True)
        self.attn = Attention()
        self.norm2 = Leaf(bias=True)
        self.mlp = MLP()

    def forward(self, x):
        return x + self.mlp(self.norm2(x + self.attn(self.norm1(x))))


MODULES_PER_BLOCK = 12


class Tree(nn.Module):
    """`blocks` of `Block`s between an embedding-like leaf and a `[norm, output]` tail."""

    def __init__(self, n_blocks: int) -> None:
        super().__init__()
        self.embed = Leaf()
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.norm = Leaf(bias=True)
        self.output = Leaf()

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.output(self.norm(x))


def synthetic(n_modules: int) -> nn.Module:
    with torch.device("meta"):
        return Tree(max(2, (n_modules - 5) // MODULES_PER_BLOCK))


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median wall time of `fn()` in ms over `repeats` runs, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), result


def compile_once(text: str, model: nn.Module, world: int) -> CompiledPlan:
    """Parse + resolve + validate on a fresh graph; graph building is timed separately."""
    plan = planc.loads(text)
    c = CompiledPlan(plan, GRAPH_CACHE[id(model)].fresh(), world)
    c.diagnostics  # noqa: B018  (forces resolve + validate)
    return c


class _Graphs:
    """Holds one built graph per model; `fresh()` copies it with cold caches."""

    def __init__(self, graph: ModelGraph):
        self.graph = graph

    def fresh(self) -> ModelGraph:
        clone = copy.copy(self.graph)
        for name, attr in vars(ModelGraph).items():  # drop lazily computed results
            if isinstance(attr, functools.cached_property):
                clone.__dict__.pop(name, None)
        return clone


GRAPH_CACHE: dict[int, _Graphs] = {}


def bench_model(name: str, model: nn.Module, plans: dict[str, str], world: int, repeats: int) -> list[dict]:
    graph_ms, graph = timed(lambda: ModelGraph.from_module(model), max(1, repeats // 2))
    GRAPH_CACHE[id(model)] = _Graphs(graph)
    rows = []
    for label, text in plans.items():
        ms, compiled = timed(lambda: compile_once(text, model, world), repeats)
        rows.append({"model": name, "modules": len(graph), "plan": label, "graph_ms": round(graph_ms, 2),
                     "compile_ms": round(ms, 2), "units": len(compiled.units),
                     "errors": len(compiled.errors)})
    return rows


def synthetic_plan(n_rules: int) -> str:
    return "\n".join(SYNTHETIC_RULES[:n_rules]) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1k and 10k trees only, fewer repeats")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 7)
    sizes = (1_000, 10_000) if args.quick else (1_000, 10_000, 100_000)

    from benchmarks._llama405b import TORCHTITAN_PLAN, llama405b
    t0 = time.perf_counter()
    with torch.device("meta"):
        llama = llama405b()
    build_ms = (time.perf_counter() - t0) * 1e3
    rows = bench_model("llama405b", llama, {"torchtitan": TORCHTITAN_PLAN}, 64, repeats)
    del llama
    for n in sizes:
        model = synthetic(n)
        reps = repeats if n < 100_000 else max(3, repeats // 2)
        rows += bench_model(f"tree{n // 1000}k", model, {f"{k} rules": synthetic_plan(k) for k in (1, 4, 16)},
                            64, reps)
        del model
        GRAPH_CACHE.clear()

    print(f"llama405b built on meta in {build_ms:.0f} ms")
    header = (f"{'model':<10} {'modules':>8} {'plan':<11} {'graph ms':>9} {'compile ms':>11} {'us/module':>10} "
              f"{'units':>6} {'errors':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        per = r["compile_ms"] * 1e3 / r["modules"]
        print(f"{r['model']:<10} {r['modules']:>8} {r['plan']:<11} {r['graph_ms']:>9.1f} {r['compile_ms']:>11.1f} "
              f"{per:>10.1f} {r['units']:>6} {r['errors']:>6}")
    growth = {}
    for k in (1, 4, 16):
        pts = [r for r in rows if r["plan"] == f"{k} rules"]
        if len(pts) >= 2:
            a, b = pts[0], pts[-1]
            growth[f"{k} rules"] = round((b["compile_ms"] / a["compile_ms"]) / (b["modules"] / a["modules"]), 2)
    print("growth (time ratio / module ratio, smallest to largest tree; 1.0 = linear): "
          + ", ".join(f"{k}: {v}" for k, v in growth.items()))
    llama_row = rows[0]
    print(json.dumps({"benchmark": "compile", "llama405b_compile_ms": llama_row["compile_ms"],
                      "llama405b_graph_ms": llama_row["graph_ms"], "llama405b_build_ms": round(build_ms, 1),
                      "rows": rows, "growth": growth}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
