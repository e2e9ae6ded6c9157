"""Benchmark: `planc check --verify` on every shipped plan: wall time and what it compared.

For each plan in plans/: the command as a user runs it (a fresh process: imports, the model's
compile, the one-process reference, the 2 or 4 gloo ranks), its wall time, the twin it ran, the
world and mesh, and how many losses, gradients and parameters it compared. Target: under 60 s a
plan on the 2-core development machine. Prints a markdown table, then one JSON line.

    python benchmarks/verify_bench.py
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def one(path: pathlib.Path) -> dict:
    t0 = time.perf_counter()
    cli = "import sys; from planc.cli.main import main; sys.exit(main())"
    run = subprocess.run([sys.executable, "-c", cli, "check", str(path.relative_to(ROOT)), "--verify",
                          "--format", "json"], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    doc = json.loads(run.stdout)
    entry = doc["plans"][0]
    verified = entry.get("verified", "")
    m = re.search(r"verified at (\d+) ranks \((.*?)\) against one process on `(.*?)`: \d+ AdamW steps, (\d+) ", verified)
    return {"plan": path.name, "ok": run.returncode == 0 and bool(m), "wall_s": round(wall, 1),
            "world": int(m.group(1)) if m else None, "mesh": m.group(2) if m else None,
            "twin": m.group(3) if m else None, "compared": int(m.group(4)) if m else None,
            "errors": [d["code"] for d in doc["diagnostics"] if d["severity"] == "error"]}


def main() -> int:
    rows = [one(p) for p in sorted((ROOT / "plans").glob("*.plan"))]
    print("| plan | verified | wall (s) | ranks (mesh) | twin | tensors compared |")
    print("| --- | --- | ---: | --- | --- | ---: |")
    for r in rows:
        print(f"| {r['plan']} | {'yes' if r['ok'] else 'NO ' + ','.join(r['errors'])} | {r['wall_s']} | "
              f"{r['world']} ({r['mesh']}) | `{r['twin']}` | {r['compared']} |")
    summary = {"benchmark": "verify", "plans": rows, "all_ok": all(r["ok"] for r in rows),
               "max_wall_s": max(r["wall_s"] for r in rows)}
    print(json.dumps(summary))
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
