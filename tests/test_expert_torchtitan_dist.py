"""Expert parallelism against torchtitan 0.3.0 by hand: the same plan, the same placements, the
same losses bit for bit (tests/expert_torchtitan_workers.py says how each side is built).

torchtitan's side runs its `AllToAllTokenDispatcher` (through its own `RoutedExperts.forward`),
its `ParallelDims` meshes and its `apply_fsdp_to_decoder` with the expert `shard_placement_fn`;
planc's side `planc.apply` with a plan of torchtitan's units and reduction convention. 2 ranks
(expert 2, efsdp 1) and 4 ranks (expert 2 x efsdp 2; with 4 experts on dim 0, with 2 experts on
dim 1 as torchtitan's rule says), fp32, 3 AdamW steps, the routing uneven (the experts of
layers.0 run on different row counts per rank under torchtitan's dispatcher).

What it caught: with `reduction divide_factor = 1.0` planc still scaled the experts' gradients
by 1 / expert (right only when FSDP averages): every expert gradient was half torchtitan's,
and AdamW (nearly scale-invariant) hid it until the third step's loss, 1 ulp off. The gradients
after the first backward are compared too, bit for bit.

Needs the `torchtitan` extra; skipped without it. One launch per world size, under the gloo lock.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")

from tests.distributed import run  # noqa: E402
from tests.expert_torchtitan_workers import parity  # noqa: E402

pytestmark = pytest.mark.dist

CASES = {2: [4], 4: [4, 2]}  # world -> expert counts


@pytest.mark.parametrize("world", sorted(CASES))
def test_placements_gradients_and_losses_equal_torchtitans(world):
    ranks = run(parity, world, CASES[world], timeout=900)
    for rows in ranks:
        for row in rows:
            ours, theirs = row["planc"], row["torchtitan"]
            assert ours["placements"] == theirs["placements"]  # mesh ranks, Shard dims, local shapes
            assert row["grads_differ"] == {}  # every gradient shard bit for bit
            assert ours["losses"] == theirs["losses"]  # hex: bit for bit
            assert len(set(ours["losses"])) == len(ours["losses"])  # it trained
    for k, experts in enumerate(CASES[world]):
        placed = ranks[0][k]["planc"]["placements"]
        dim = 1 if world // 2 * 2 > experts else 0
        assert f"Shard(dim={dim})" in placed["layers.0.moe.experts.w1"][1]
        assert placed["layers.0.moe.experts.w1"][0] != placed["layers.0.moe.router.gate.weight"][0]  # two meshes
        rows = [r[k]["torchtitan"]["rows"] for r in ranks]
        if experts > 2:  # (top-2 of 2 experts sends every token to both: even by construction)
            assert len({tuple(r) for r in rows}) > 1  # uneven: expert ranks received different row counts
