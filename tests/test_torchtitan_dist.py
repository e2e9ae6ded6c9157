"""torchtitan parity on 2 gloo ranks: the shipped plans through `planc.apply` alone give the
units, placements and hex-identical losses of torchtitan's own `apply_fsdp_to_decoder`.

Needs the `torchtitan` extra (`pip install 'planc[torchtitan]'`); skipped without it.
One launch of 2 ranks runs all eight cases (fp32/bf16 x tied/untied x eager/meta flow).
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("torchtitan")

from tests.distributed import run  # noqa: E402
from tests.torchtitan_workers import parity  # noqa: E402

CASES = list(itertools.product((False, True), ("fp32", "bf16"), ("eager", "meta")))


@pytest.fixture(scope="module")
def results():
    ranks = run(parity, 2, CASES, timeout=900)
    return {tuple(row["case"]): (row, ranks[1][k]) for k, row in enumerate(ranks[0])}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(["tied" if c[0] else "untied", c[1], c[2]]))
def test_units_and_losses_match_torchtitan(results, case):
    for row in results[case]:  # each rank
        ours, theirs = row["planc"], row["torchtitan"]
        assert ours["units"] == theirs["units"]
        assert ours["losses"] == theirs["losses"]  # hex: bit-identical
    assert len(set(results[case][0]["planc"]["losses"])) == 3  # it trained: the loss moved


def test_the_units_are_torchtitans_recipe(results):
    (row, _) = results[(False, "bf16", "meta")]
    groups = [u["modules"] for u in row["torchtitan"]["units"]]
    assert ["lm_head", "norm"] in groups and ["tok_embeddings"] in groups and [""] in groups
    assert len(groups) == 9  # tok_embeddings, 6 blocks, [norm, lm_head], the root
    assert all(u["divide"] == 1.0 for u in row["planc"]["units"] if u["params"])  # torchtitan's loss convention
    (tied, _) = results[(True, "bf16", "meta")]
    assert ["lm_head", "norm", "tok_embeddings"] in [u["modules"] for u in tied["planc"]["units"]]


def test_without_the_reduction_line_the_losses_drift():
    """What the plan's `reduction divide_factor = 1.0` is for: without it FSDP averages
    gradients that torchtitan's loss already divides by the global token count."""
    (row,), _ = run(parity, 2, [(False, "fp32", "eager")], False, timeout=600)
    assert row["planc"]["units"] != row["torchtitan"]["units"]  # the divide factor differs
    ours, theirs = row["planc"]["losses"], row["torchtitan"]["losses"]
    assert ours[0] == theirs[0] and ours[1:] != theirs[1:]  # same first step, then apart
