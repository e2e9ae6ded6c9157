"""What tests/test_suggest_cp.py and tests/test_suggest_ep.py check of a plan `planc suggest` wrote
over context or expert degrees: it checks clean, `planc explain` of the plan as written gives the
header's peak and step time, and it trains like one process (`check --verify`, gloo)."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib

import planc
from planc import cli
from planc.analysis import verify
from planc.compiler import CompiledPlan
from planc.model.build import build_model


def write(text: str, tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "suggested.plan"
    path.write_text(text)
    return path


def checks_clean(path: pathlib.Path, graph, world: int) -> None:
    """No error and no warning from `planc check` (the `expect memory.peak` line included), also
    without a world size on the command line (the expect line's `at world = N` then lowers it)."""
    for at in (world, None):
        compiled = CompiledPlan(planc.load(path), graph, at)
        assert not [d for d in compiled.diagnostics if d.severity in ("error", "warning")], \
            [f"{d.code} {d.message}" for d in compiled.diagnostics]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(["check", str(path)])
    assert code == 0, out.getvalue()


def explained(path: pathlib.Path, world: int, shape: tuple[int, int]) -> tuple[int, float]:
    """(peak bytes, step seconds) of `planc explain PATH --world-size N --input-shape BxS --format json`."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["explain", str(path), "--world-size", str(world), "--input-shape", "x".join(map(str, shape)),
                         "--format", "json"])
    assert code == 0
    found = json.loads(out.getvalue())
    return found["memory"]["peak_bytes"], found["time"]["totals"]["step_s"]


def verified(path: pathlib.Path):
    """`planc check --verify`: trained on local gloo processes, equal to one process; the verdict."""
    plan = planc.load(path)
    compiled = planc.compile(plan, build_model(plan.model_ref, device="meta", base=path.parent))
    verdict = verify.verify(compiled, base=str(path.parent))
    assert verdict.ok, [d.message for d in verify.diagnostics(compiled, verdict)]
    assert verdict.compared > 10
    return verdict


def tight_budget(searched) -> int:
    """A budget below every plan's peak without the axis (`searched(budget, (1,))`) and above its
    degree 2's smallest (`searched(budget, (2,))`), in whole KiB: only the axis fits it."""
    smallest_1d = searched(1024, (1,)).smallest.peak
    smallest_2 = searched(1024, (2,)).smallest.peak
    assert smallest_2 < smallest_1d, (smallest_2, smallest_1d)
    return (smallest_1d + smallest_2) // 2 // 1024 * 1024
