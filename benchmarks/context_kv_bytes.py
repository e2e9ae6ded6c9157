"""Benchmark: the bytes context parallelism moves and holds per attention layer, Llama 3 8B (32 heads, 8 KV heads).

`plans/llama3-8b-long-context.plan` (131072 tokens, `mesh (shard = *, context = 8, tensor = 8)`, bf16)
at 64 ranks: the step-time model's collectives on the context axis for `layers.0.attention`
(`planc.estimate.collectives.context_collectives`, held to a fake-process-group step by
tests/test_time_context.py), their modelled time on H100 links, and the K/V one rank's gather
buffers hold (the gathered keys and values in order, and their `(cp, ...)` receive buffers).
Run it on two planc trees to compare them: before gathering ahead of the grouped-query repeat
and after.

    python benchmarks/context_kv_bytes.py                              # this tree
    PYTHONPATH=/path/to/other/tree python benchmarks/context_kv_bytes.py   # another one
"""

from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after PYTHONPATH: another tree given there is the one imported

import torch  # noqa: E402

import planc  # noqa: E402
from planc.estimate.collectives import collective_s  # noqa: E402
from planc.estimate.hardware import hardware  # noqa: E402
from planc.estimate.time import estimate_step_time  # noqa: E402
from planc.zoo import llama3  # noqa: E402

PLAN = ROOT / "plans/llama3-8b-long-context.plan"
WORLD, SHAPE, LAYER = 64, (1, 131072), "layers.0.attention"


def main() -> None:
    with torch.device("meta"):
        model = llama3.llama3_8b()
    compiled = planc.compile(planc.load(PLAN), model, WORLD)
    st = estimate_step_time(compiled, world=WORLD, input_shape=SHAPE)
    hw = hardware("h100")
    cs = [c for u in st.per_unit for c in u.collectives if c.axis == "context" and c.what == LAYER]
    out = {"benchmark": "context_kv_bytes", "planc": planc.__file__, "plan": PLAN.name, "world": WORLD,
           "shape": list(SHAPE), "layer": LAYER, "collectives": {}, "comm_s": 0.0}
    for c in cs:
        key = f"{c.phase} {c.kind}"
        out["collectives"][key] = out["collectives"].get(key, 0) + c.bytes * c.times
        out["comm_s"] += collective_s(c, hw) * c.times
    gathered = out["collectives"].get("forward all_gather", 0)  # K and V, the whole sequence each
    out["gather_buffers_bytes"] = 2 * gathered  # the (cp, ...) receive buffers, then the ordered copy
    out["comm_s"] = round(out["comm_s"], 6)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
