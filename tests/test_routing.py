"""A routing histogram's format, its reading by the estimates, and its diagnostics (one process).

The oracle for the estimates: a histogram that routes exactly as balanced routing does gives the
balanced estimate byte for byte, and a batch scaled by the histogram's own rule gives what the
histogram recorded at that batch; the real step's measurements are in tests/test_routing_dist.py.
"""

from __future__ import annotations

import io
import json
import pathlib
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch

import planc
from planc import cli, zoo
from planc.analysis.routing import record_routing
from planc.estimate import collectives, memory
from planc.estimate.routing import Layer, Routing, RoutingError, parse_routing, scale
from planc.zoo import ROUTED_MOE_TINY_CONFIG as CONFIG

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLAN = (ROOT / "plans" / "routed-moe-ep.plan").read_text()
NAMES = [f"layers.{i}.moe.experts" for i in range(CONFIG.n_layers)]


def _routing(rows: list[list[int]], batch=(2, 16), **kw) -> Routing:
    return Routing(tuple(Layer(n, tuple(map(tuple, rows))) for n in NAMES), batch, 2, **kw)


SKEWED = _routing([[20, 17, 14, 13], [22, 14, 16, 12]])  # expert rank 0 receives 73 rows, rank 1 55


def _compiled(routing=None, world=2):
    with torch.device("meta"):
        model = zoo.routed_moe_tiny()
    return planc.compile(planc.loads(PLAN), model, world, routing=routing)


def test_scale_keeps_each_ranks_rows():
    assert scale((20, 17, 14, 13), 64) == [20, 17, 14, 13]  # the same batch: an exact copy
    assert scale((20, 17, 14, 13), 128) == [40, 34, 28, 26]
    assert scale((3, 1), 5) == [4, 1]  # 3.75, 1.25: the remainder to the largest fraction
    assert scale((1, 1, 1), 4) == [2, 1, 1]  # ties: the lower expert
    for rows in (1, 7, 63, 1000):
        assert sum(scale((20, 17, 14, 13), rows)) == rows


def test_received_rows_per_expert_rank():
    assert SKEWED.received(NAMES[0], 2, 64) == [[20, 17], [22, 14]]  # the binding rank: 0
    assert SKEWED.at_rank(1).received(NAMES[0], 2, 64) == [[14, 13], [16, 12]]
    dense = Routing((Layer(NAMES[0], ((20, 17, 14, 13),)),), (2, 16))  # every rank routes as the one recorded
    assert dense.received(NAMES[0], 2, 64) == [[20, 17], [20, 17]]
    assert dense.at_rank(1).received(NAMES[0], 2, 128) == [[28, 26], [28, 26]]
    four = Routing((Layer(NAMES[0], ((2, 2, 2, 2), (2, 2, 2, 2), (1, 1, 5, 1), (1, 1, 5, 1))),), (1, 4))
    assert four.received(NAMES[0], 2, 8) == [[5, 1], [5, 1]]  # group 1 (ranks 2, 3), expert rank 1
    assert four.at_rank(2).received(NAMES[0], 2, 8) == [[1, 1], [1, 1]]
    assert SKEWED.imbalance(2) == pytest.approx(73 / 64)
    with pytest.raises(ValueError, match="rank 2 is not a rank"):
        SKEWED.at_rank(2).received(NAMES[0], 2, 64)


def test_the_file_round_trips():
    text = SKEWED.to_json()
    assert json.loads(text)["layers"][1]["counts"] == [[20, 17, 14, 13], [22, 14, 16, 12]]
    assert parse_routing(text) == SKEWED


@pytest.mark.parametrize("text,message", [
    ("[1, 2]", "not a planc routing histogram"),
    ('{"planc_routing": 2}', "not a planc routing histogram"),
    ('{"planc_routing": 1, "batch": [2, 0], "layers": []}', '"batch" must be'),
    ('{"planc_routing": 1, "batch": [2], "expert_degree": true, "layers": []}', '"expert_degree" must be'),
    ('{"planc_routing": 1, "batch": [2], "layers": []}', '"layers" must be a non-empty list'),
    ('{"planc_routing": 1, "batch": [2], "layers": [{"name": "a", "counts": [[1, true]]}]}', "non-negative integers"),
    ('{"planc_routing": 1, "batch": [2], "layers": [{"name": "a", "counts": [[1, 2], [1]]}]}', "a count for each"),
    ('{"planc_routing": 1, "batch": [2], "layers": [{"name": "a", "counts": [[0, 0]]}]}', "at least one row"),
    ('{"planc_routing": 1, "batch": [2], "layers": [{"name": "a", "counts": [[1]]}, {"name": "b", "counts": '
     '[[1], [1]]}]}', "the same ranks"),
])
def test_a_file_that_is_not_a_histogram_is_p437(text, message):
    with pytest.raises(RoutingError) as err:
        parse_routing(text, "r.json")
    assert err.value.diagnostic.code == "P437" and message in err.value.diagnostic.message
    assert err.value.diagnostic.span.file == "r.json"


def test_a_balanced_histogram_is_the_balanced_estimate():
    """Each rank sends 16 rows to each of the 4 experts: what balanced routing assumes, to the byte."""
    balanced = memory.estimate(_compiled(), 2, input_shape=(2, 16))
    even = memory.estimate(_compiled(_routing([[16] * 4, [16] * 4])), 2, input_shape=(2, 16))
    assert even.peak.total == balanced.peak.total and [m.total for m in even.timeline] == \
        [m.total for m in balanced.timeline]
    assert "routing measured in <routing>" in even.source and "1.00x the mean" in even.source
    skewed = memory.estimate(_compiled(SKEWED), 2, input_shape=(2, 16))
    assert skewed.peak.total > balanced.peak.total
    lighter = memory.estimate(_compiled(SKEWED.at_rank(1)), 2, input_shape=(2, 16))
    assert max(m.total for m in lighter.timeline if "backward" in m.label) < \
        max(m.total for m in balanced.timeline if "backward" in m.label)


def test_a_histogram_scales_to_the_estimated_batch():
    """Recorded at 2x16 and estimated at 4x16: the same as the doubled counts recorded at 4x16."""
    doubled = _routing([[40, 34, 28, 26], [44, 28, 32, 24]], batch=(4, 16))
    a = memory.estimate(_compiled(SKEWED), 2, input_shape=(4, 16))
    b = memory.estimate(_compiled(doubled), 2, input_shape=(4, 16))
    assert a.peak.total == b.peak.total and [m.total for m in a.timeline] == [m.total for m in b.timeline]


def test_all_to_all_bytes_follow_the_histogram():
    compiled = _compiled(SKEWED)
    rows = 32 * CONFIG.top_k
    item = CONFIG.dim * 2  # bf16 rows
    for routing, received in ((None, rows), (SKEWED, 73), (SKEWED.at_rank(1), 55)):
        per_layer = collectives.expert_collectives(compiled.program, compiled.graph, 2, 32, CONFIG.top_k, CONFIG.dim,
                                                   routing)
        for cs in per_layer.values():
            assert [(c.phase, c.bytes) for c in cs] == [("forward", rows * item), ("forward", received * item),
                                                        ("backward", rows * item), ("backward", received * item)]


def test_a_histogram_that_does_not_fit_is_p436():
    wrong = Routing((Layer("layers.0.moe.experts", ((8, 8, 8),)), Layer("layers.1.moe.router", ((8, 8, 8, 8),))),
                    (2, 16))
    with pytest.raises(planc.PlanError) as err:
        _compiled(wrong)
    found = [d for d in err.value.diagnostics if d.code == "P436"]
    assert len(found) == 3
    assert any("counts 3 experts, the model has 4" in d.message for d in found)
    assert any("no layer for `layers.1.moe.experts`" in d.message for d in found)
    assert any("does not make expert-parallel: `layers.1.moe.router`" in d.message for d in found)
    assert all(d.span is not None and d.span.line == 21 for d in found)  # the `parallel ... expert` line


def test_record_routing_in_one_process():
    torch.manual_seed(0)
    model = zoo.routed_moe_tiny()
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with record_routing(model) as recorded:
        with pytest.raises(ValueError, match="no forward was recorded"):
            recorded.routing()
        model(tokens).float().sum().backward()
    routing = recorded.routing()
    # the oracle: the router's own top-k, counted here by hand
    h = model.tok_embeddings(tokens)
    layer = model.layers[0]
    h = h + layer.attention(layer.attention_norm(h))
    ids, _ = layer.moe.router(layer.ffn_norm(h).reshape(-1, CONFIG.dim))
    assert routing.layer(NAMES[0]).counts == (tuple(torch.bincount(ids.reshape(-1), minlength=4).tolist()),)
    assert routing.batch == (2, 16) and routing.ranks == 1 and routing.expert_degree == 1
    with pytest.raises(ValueError, match="no experts container"):
        record_routing(torch.nn.Linear(2, 2))


def _cli(args: list[str]) -> tuple[str, int]:
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        code = cli.main(args)
    return out.getvalue(), code


def test_explain_states_the_routing(tmp_path):
    path = tmp_path / "routing.json"
    SKEWED.save(path)
    args = ["explain", str(ROOT / "plans" / "routed-moe-ep.plan"), "--model", "planc.zoo:routed_moe_tiny",
            "--world-size", "2", "--input-shape", "2x16"]
    text, code = _cli(args + ["--routing", str(path)])
    assert code == 0 and f"routing measured in {path}" in text and "1.14x the mean rows" in text
    plain, _ = _cli(args)
    assert "balanced routing" in plain and "routing measured" not in plain
    text, code = _cli(["check", str(ROOT / "plans" / "routed-moe-ep.plan"), "--routing", str(tmp_path / "none.json")])
    assert code == cli.EXIT_USAGE and "error[P437]" in text and "Traceback" not in text


def test_the_step_time_computes_the_binding_ranks_rows():
    """The experts' FLOPs of each layer's unit are the profile's times received / sent rows (73 / 64 on
    expert rank 0, 55 / 64 on rank 1); everything else is the balanced step's."""
    from planc.estimate import time
    from planc.estimate.flops import step_profile

    balanced = time.estimate_step_time(_compiled(), world=2, input_shape=(2, 16))
    profile = step_profile(_compiled().graph, None, input_shape=(2, 16))
    for routing, load in ((SKEWED, 73 / 64), (SKEWED.at_rank(1), 55 / 64)):
        step = time.estimate_step_time(_compiled(routing), world=2, input_shape=(2, 16))
        assert any("the experts' compute: routing measured" in n for n in step.assumptions)
        for a, b in zip(step.per_unit, balanced.per_unit):
            experts = sum(v for p, v in profile.forward.items() if p.startswith(f"{a.name}.moe.experts"))
            assert a.forward_flops - b.forward_flops == round(experts * load) - experts, a.name
        assert (step.total_s > balanced.total_s) == (load > 1)


def test_memory_expects_are_checked_with_the_routing(tmp_path):
    path = tmp_path / "routing.json"
    SKEWED.save(path)
    plan = str(ROOT / "tests" / "ui" / "expect_memory_expert.plan")
    balanced, _ = _cli(["check", plan, "--world-size", "2"])
    skewed, code = _cli(["check", plan, "--world-size", "2", "--routing", str(path)])
    assert code == cli.EXIT_ERRORS and "error[P502]" in skewed and "error[P502]" in balanced

    def figure(text: str) -> float:
        return float(text.split("activations included, is ")[1].split(" KiB")[0])

    assert figure(skewed) > figure(balanced)
