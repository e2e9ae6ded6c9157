"""Run every benchmark in this folder and write their figures to benchmarks/RESULTS.md.

Each benchmark script prints a JSON object as its last line; this script runs them one
after another (they compete for the CPU otherwise), keeps that object, and renders one
section per benchmark with the exact command that produced it.

    python benchmarks/run_all.py            # full runs (several minutes on 2 cores)
    python benchmarks/run_all.py --quick    # each benchmark's --quick mode
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (script, what it measures, the figures to show as (JSON key, label)), in run order.
BENCHMARKS = [
    ("compile_bench.py", "parse + resolve + validate time (graph building shown apart)", [
        ("llama405b_compile_ms", "Llama-3-405B-shaped model, torchtitan plan: compile (ms)"),
        ("llama405b_graph_ms", "the same: building the model graph (ms)"),
        ("growth", "growth vs modules (time ratio / module ratio; 1.0 = linear)"),
    ]),
    ("apply_bench.py", "`planc.apply` vs the hand-written `fully_shard` loop (405B-shaped, meta, 2 ranks)", [
        ("cpu_ratio_median", "apply / by hand, CPU time, median of per-repetition ratios (target <= 1.10)"),
        ("cpu_ratio_best", "apply / by hand, CPU time, best repetition of each"),
        ("ratio_median", "apply / by hand, wall clock, median"),
        ("planc_apply_cpu_ms_median", "planc.apply CPU (ms)"),
        ("hand_written_cpu_ms_median", "hand-written loop CPU (ms)"),
        ("compile_cpu_ms_median", "of which compiling the plan (ms)"),
        ("precompiled_cpu_ratio_median", "apply of a plan compiled beforehand / by hand, CPU time, median"),
        ("precompiled_cpu_ratio_best", "the same, best repetition of each"),
    ]),
    ("apply_tp_bench.py", "`planc.apply` of a 2-D plan (FSDP x TP, sequence + loss parallel) vs torchtitan's "
     "`apply_tp` + `apply_fsdp` by hand (405B-shaped, meta, 2 x 2 ranks)", [
        ("cpu_ratio_median", "apply / by hand, CPU time, median of per-repetition ratios (target <= 1.05)"),
        ("cpu_ratio_best", "apply / by hand, CPU time, best repetition of each"),
        ("ratio_median", "apply / by hand, wall clock, median"),
        ("planc_apply_cpu_ms_median", "planc.apply CPU (ms)"),
        ("hand_written_cpu_ms_median", "hand-written calls CPU (ms)"),
        ("compile_cpu_ms_median", "of which compiling the plan (ms)"),
        ("precompiled_cpu_ratio_median", "apply of a plan compiled beforehand / by hand, CPU time, median"),
        ("same_placements", "both sides build the same placements"),
    ]),
    ("step_bench.py", "training step time, plan-applied vs hand-written torchtitan sharding (2 ranks)", [
        ("ratio_median", "per-step ratio, median (target 1.00 +- noise)"),
        ("cpu_ratio_median", "CPU-time ratio, median"),
        ("planc_step_ms_median", "planc step (ms)"),
        ("hand_written_step_ms_median", "hand-written step (ms)"),
        ("losses_bitwise_equal", "losses bitwise equal"),
    ]),
    ("simulate_bench.py", "`planc explain --simulate`: the brief's 24-layer transformer at world size 64", [
        ("simulate_seconds", "simulation time (s; target < 60)"),
        ("estimated_peak_bytes", "analytic peak (bytes)"),
        ("simulated_peak_bytes", "simulated peak (bytes)"),
        ("estimate_over_simulated", "analytic / simulated"),
    ]),
    ("simulate_tp_bench.py", "`planc check --simulate` of a 2-D plan: 405B-shaped model, world 512, tp 8", [
        ("total_cpu_seconds", "compile + simulation, CPU time (s; target < 20)"),
        ("total_seconds", "compile + simulation, wall clock (s; noisy on a shared machine)"),
        ("compile_seconds", "of which compile, model built on meta included (s, wall)"),
        ("simulate_seconds", "of which the simulated step (s, wall)"),
        ("simulation_diagnostics", "diagnostics (none: the plan runs)"),
    ]),
    ("suggest_bench.py", "`planc suggest` on the 405B-shaped model at 64 ranks (1 x 8192, 120GiB, h200)", [
        ("search_seconds", "search: trace + linear models + MILPs (s, wall; target < 10)"),
        ("verify_seconds", "verification: the winner re-traced with its checkpointing (s, wall)"),
        ("search_cpu_seconds", "search, CPU time (s)"),
        ("verify_cpu_seconds", "verification, CPU time (s)"),
        ("load_average", "machine load average during the run"),
        ("choice", "the suggested plan"),
    ]),
    ("suggest_405b.py", "`planc suggest --pipeline` on the 405B shape at 512 ranks (PP x TP x FSDP, 256 x 8192, 80GiB)", [
        ("total_cpu_seconds", "the search with the winner's verification, CPU time (s; target < 30)"),
        ("total_seconds", "the same, wall clock (s)"),
        ("profile_cpu_seconds", "of which the profiles per tensor degree (s, CPU)"),
        ("choice", "the suggested plan"),
        ("step_seconds", "its step time, role estimators (s)"),
        ("peak_bytes", "its peak, role estimators (bytes)"),
        ("recipe_step_seconds", "torchtitan's recipe, the search's analytic model (s)"),
        ("load_average", "machine load average during the run"),
    ]),
    ("sac_compare.py", "activation checkpointing alone: planc suggest vs torch's sac_milp", [
        ("budgets_bytes", "budgets (bytes per rank)"),
    ]),
    ("memory_accuracy.py", "analytic peak vs FSDPMemTracker on the faithful step (loss head, optimizer, clipping)", [
        ("worst_ratio_error", "worst |analytic / measured - 1| (target <= 0.03)"),
        ("within_3_percent", "every case within 3%"),
    ]),
    ("context_memory.py", "context parallelism's activation reduction, estimated and measured (zoo Llama tiny)", [
        ("activation_ratio_estimated", "activations with context 2 / without, estimated (2 x 64 per rank)"),
        ("activation_ratio_measured", "the same, measured (FSDPMemTracker, real gloo ranks)"),
        ("cpu_path_trace_equals_measured", "the CPU path's trace equals the measured peak, byte for byte"),
        ("long_sequence_estimates", "estimates at 2 x 2048, 8 ranks, context 1 / 2 / 4 / 8"),
    ]),
    ("context_kv_bytes.py", "context parallelism's K/V bytes per attention layer, Llama 3 8B long-context plan (estimates)", [
        ("collectives", "bytes on the context axis per layer and rank, by phase and kind"),
        ("gather_buffers_bytes", "the gather's buffers in forward (bytes)"),
        ("comm_s", "modelled time of those collectives on H100 (s)"),
    ]),
    ("time_validation.py", "step-time model: collective bytes per unit vs a fake-process-group step, FLOPs vs FlopCounterMode", [
        ("plans", "shipped plans checked (tiny configs, rank 0 of 8)"),
        ("plans_equal", "plans whose collectives equal the model's, per unit, kind, phase, bytes and ranks"),
        ("flop_models", "tiny models whose FLOPs were counted"),
        ("flop_models_equal", "of which the fake trace's FLOPs equal FlopCounterMode on the real CPU step"),
        ("wall_s", "wall clock (s)"),
    ]),
    ("time_model.py", "step-time estimate vs published torchtitan throughput (estimate / published, nothing fitted)", [
        ("ratio_min", "smallest estimate / published"),
        ("ratio_max", "largest estimate / published"),
        ("estimate_ms_max", "slowest estimate_step_time call, trace reused (ms)"),
    ]),
]


def run_one(script: str, quick: bool) -> tuple[str, dict | None, str]:
    """Run one benchmark; returns (command, its JSON result or None, error text)."""
    cmd = [sys.executable, f"benchmarks/{script}"] + (["--quick"] if quick else [])
    shown = "python " + " ".join(cmd[1:])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        return shown, None, (proc.stderr or proc.stdout)[-2000:]
    try:
        return shown, json.loads(lines[-1]), ""
    except json.JSONDecodeError:
        return shown, None, lines[-1][:2000]


def _cpu() -> str:
    """The CPU's model name and how much slower a bf16 matmul runs than an fp32 one on it:
    without native bf16 instructions (AVX512-BF16, AMX) bf16 steps are many times slower, so
    absolute step times from two machines are not comparable; ratios between sides are."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    import time
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.ones(256, 512, dtype=dtype), torch.ones(512, 512, dtype=dtype)
        a @ b  # warm-up
        start = time.perf_counter()
        for _ in range(3):
            a @ b
        seconds[dtype] = time.perf_counter() - start
    torch.set_num_threads(threads)
    return f"{model} (a bf16 matmul takes {seconds[torch.bfloat16] / seconds[torch.float32]:.2g}x the time of an fp32 one)"


def render(results: list[tuple[str, str, list, str, dict | None, str]], quick: bool) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        "# Benchmark results",
        "",
        f"Generated by `python benchmarks/run_all.py{' --quick' if quick else ''}` on {now}: "
        f"{os.cpu_count()} CPU cores, {_cpu()}, {platform.python_implementation()} {platform.python_version()}, "
        f"torch {torch.__version__}, no GPU. The machine is shared, so wall-clock figures are noisy; "
        "where a benchmark reports CPU-time ratios they are the robust ones.",
        "",
    ]
    for script, what, figures, command, data, error in results:
        out += [f"## {script}: {what}", "", f"Command: `{command}`", ""]
        if data is None:
            out += ["Failed:", "", "```", error.strip(), "```", ""]
            continue
        if "cases" in data and data["cases"] and "ratio" in data["cases"][0]:  # a ratio table
            out += ["| model | plan | ranks | input | optimizer | analytic (GiB) | measured (GiB) | ratio |",
                    "| --- | --- | --- | --- | --- | --- | --- | --- |"]
            out += [f"| {c['model']} | {c['plan']} | {c['world_size']} | {'x'.join(map(str, c['input_shape']))} | "
                    f"{c['optimizer']} | {c['estimated_peak_bytes'] / 2**30:.2f} | {c['measured_peak_bytes'] / 2**30:.2f} | "
                    f"{c['ratio']:.4f} |" for c in data["cases"]]
            out += [f"| {f['model']} | | {f['world_size']} | | | failed: {f['error']} | | |" for f in data.get("failed", [])]
            out.append("")
        if "markdown" in data:  # a benchmark's own table
            out += [data["markdown"], ""]
        out += ["| figure | value |", "| --- | --- |"]
        for key, label in figures:
            value = data.get(key, "n/a")
            out.append(f"| {label} | {json.dumps(value) if isinstance(value, (dict, list, bool)) else value} |")
        out += ["", "<details><summary>full result</summary>", "", "```json", json.dumps(data, indent=2),
                "```", "", "</details>", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="run each benchmark's --quick mode")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    args = parser.parse_args(argv)
    results = []
    for script, what, figures in BENCHMARKS:
        print(f"running {script} ...", flush=True)
        command, data, error = run_one(script, args.quick)
        results.append((script, what, figures, command, data, error))
    pathlib.Path(args.output).write_text(render(results, args.quick), encoding="utf-8")
    print(f"wrote {args.output}")
    return 0 if all(r[4] is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
