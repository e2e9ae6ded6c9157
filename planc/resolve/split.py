"""The automatic pipeline split: the model cut into contiguous stages of balanced weight.

As torchtitan's `_generate_llm_fqn_per_model_part` cuts a model: the repeated blocks (the
largest container whose children share one class, `layers` of a Llama) are the unit of the
cut; the modules before them (the input embedding) and after them (the final norm and the
head) go whole to the first and the last stage, each weighing as much as one block
(torchtitan's `pipeline_parallel_first_stage_less_layers = 1` and `..._last_stage_less_layers
= 1`). A block weighs its parameter count (`split = parameters`, the default) or its compute
(`split = compute`: forward and backward FLOPs per block from the step profile, passed in as
`weights`). The cut minimises the heaviest stage, then evens the stages out (least sum of
squares), earlier stages taking the extra where there is a tie: on equal blocks it is
torchtitan's even split.
"""

from __future__ import annotations

from typing import Sequence

from planc.model.graph import ModelGraph


class SplitError(ValueError):
    """The model cannot be cut automatically into that many stages."""


def block_list(graph: ModelGraph) -> str | None:
    """The container of the repeated blocks: the module with the most children, all of one class,
    each with modules of its own (a block, not a projection), holding parameters; the first in model
    order on a tie. None if there is none."""
    best, count = None, 0
    for path in graph.modules:
        kids = graph.children(path)
        if len(kids) > count and len({graph.cls(k) for k in kids}) == 1 and graph.subtree_numel[path] > 0 \
                and all(graph.children(k) for k in kids):
            best, count = path, len(kids)
    return best


def split_items(graph: ModelGraph, blocks: str) -> tuple[tuple[str, ...], list[str], tuple[str, ...]]:
    """(modules before the blocks, the blocks, modules after), each a list of subtrees in model order."""
    chain = [blocks, *graph.ancestors(blocks)]  # blocks up to the root
    before: list[str] = []
    after: list[str] = []
    for child, parent in zip(chain, chain[1:]):
        kids = graph.children(parent)
        at = kids.index(child)
        before[:0] = kids[:at]          # an outer level's modules come first
        after += kids[at + 1:]          # an inner level's modules come first
    return tuple(before), list(graph.children(blocks)), tuple(after)


def partition(weights: Sequence[float], stages: int) -> list[int]:
    """The sizes of `stages` contiguous non-empty groups of `weights`: the heaviest group as light as
    it can be, then the least sum of squared group weights, earlier groups larger on a tie."""
    n = len(weights)
    if not 1 <= stages <= n:
        raise SplitError(f"{n} pieces do not cut into {stages} stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def load(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    # the lightest possible heaviest stage
    worst = [[float("inf")] * (n + 1) for _ in range(stages + 1)]
    worst[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            worst[s][j] = min(max(worst[s - 1][i], load(i, j)) for i in range(s - 1, j))
    bound = worst[stages][n] * (1 + 1e-9)
    # among cuts within that bound, the most even, the earliest stages largest on a tie
    best: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {(0, 0): (0.0, ())}
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            options = [(best[(s - 1, i)][0] + load(i, j) ** 2, tuple(-x for x in best[(s - 1, i)][1]) + (i - j,))
                       for i in range(s - 1, j) if (s - 1, i) in best and load(i, j) <= bound]
            if options:
                cost, sizes = min(options)
                best[(s, j)] = (cost, tuple(-x for x in sizes))
    return list(best[(stages, n)][1])


def auto_split(graph: ModelGraph, stages: int, weights: dict[str, float] | None = None) -> list[tuple[str, ...]]:
    """The model cut into `stages` stages (stage -> its module subtrees); `weights` gives each
    block's weight (default: its parameter count)."""
    blocks = block_list(graph)
    if blocks is None:
        raise SplitError("the model has no list of repeated blocks to cut")
    before, items, after = split_items(graph, blocks)
    cost = [float(weights[b]) if weights else float(graph.subtree_numel[b]) for b in items]
    mean = sum(cost) / len(cost) if cost else 0.0
    groups: list[tuple[str, ...]] = [(b,) for b in items]
    if before:
        groups.insert(0, before)
        cost.insert(0, mean)
    if after:
        groups.append(after)
        cost.append(mean)
    if stages > len(groups):
        raise SplitError(f"the model cuts into at most {len(groups)} stages ({len(items)} blocks of `{blocks}`"
                         f"{', the modules before them' if before else ''}{', the modules after them' if after else ''})")
    out, at = [], 0
    for size in partition(cost, stages):
        out.append(tuple(m for g in groups[at:at + size] for m in g))
        at += size
    return out
