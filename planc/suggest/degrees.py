"""The degrees `planc suggest` searches beside FSDP: tensor x context x expert combinations.

Each combination (`Degrees`) is one search of planc/suggest/search.py (`_suggest_one`) with the
mesh gaining an axis per degree above 1 and that axis's `parallel` rules added: the tensor rules
of `--tensor-parallel`, the `context` statements of `--context-parallel`, the `expert`
statements of `--expert-parallel`. Rules come from a plan file (its statements of that style) or
`auto` (`auto_rules`: every module the style fits, as planc's checks decide it). Which
combinations planc accepts is not decided here: each is compiled and a combination the checks
reject (P482 experts not dividing, P495 a sequence that does not cut into 2 x context
chunks, ...) is skipped with its code. Context and expert combine: the expert axis borrows
shard x context x tensor ranks (a context rank's tokens are its own sequence shard).

What a degree does to the input (`--input-shape BxS`, per rank at degree 1): a tensor group of
T ranks shares one input of (T·B)xS (every degree trains world·B sequences a step); a context
group of C ranks shares the B sequences of S tokens, each rank holding B x S/C of them (the
sequence is the user's: context parallelism is for sequences one rank cannot hold), so the
world trains world·B/C sequences a step and combinations are compared per world·B sequences
(`per_sequences`: the step time x C); the expert axis borrows shard x context x tensor ranks
and changes no input.

By default context degrees are tried only when the sequence is long enough to matter: when no
combination without a context axis fits the budget (else they are skipped as `NOT_TRIED`); `--context C,...` given
explicitly tries them always.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

AXES = ("tensor", "context", "expert")
NOT_TRIED = "not tried: a plan without a context axis fits (docs/suggest.md)"  # the default rule's skip


@dataclass(frozen=True)
class Degrees:
    """One combination of degrees (1: no such axis)."""

    tensor: int = 1
    context: int = 1
    expert: int = 1

    def describe(self, axes=AXES) -> str:
        """`tensor 2, context 4` over the axes searched (all of them at 1: `tensor 1`)."""
        shown = [f"{a} {getattr(self, a)}" for a in AXES if a in axes]
        return ", ".join(shown) or "1-D"

    def rules(self, rules: dict) -> tuple[str, ...]:
        """The `parallel` statements of the axes above 1 (`rules`: axis -> statements)."""
        return tuple(s for a in AXES if getattr(self, a) > 1 for s in rules.get(a, ()))

    def group_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The input one tensor x context group shares: a tensor group takes T times the batch; a
        context group cuts the same sequences (so the batch is not scaled for it)."""
        return (shape[0] * self.tensor, *shape[1:])

    def per_sequences(self, seconds: float) -> float:
        """Seconds per world·B sequences (what degree 1 trains a step): the step time x context."""
        return seconds * self.context


def default_context(world: int) -> list[int]:
    """The context degrees tried by default: 1, 2, 4, 8 dividing the world (they may span nodes)."""
    return [c for c in (1, 2, 4, 8) if world % c == 0]


def default_expert(world: int) -> list[int]:
    """The expert degrees tried by default: 1, 2, 4, 8 dividing the world (planc's checks refuse those
    the experts count does not divide, P482)."""
    return [e for e in (1, 2, 4, 8) if world % e == 0]


def combinations(tensors: list[int], contexts: list[int], experts: list[int]) -> list[Degrees]:
    """Every (tensor, context, expert) of the lists, fewest ranks per group first."""
    out = [Degrees(t, c, e) for t, c, e in itertools.product(sorted(set(tensors)), sorted(set(contexts)),
                                                              sorted(set(experts)))]
    return sorted(out, key=lambda d: (d.context, d.tensor * d.expert, d.tensor, d.expert))


def does_not_fill(d: Degrees, world: int) -> str | None:
    """Why `d` cannot lay out `world` ranks before any check runs (tensor x context must divide it)."""
    if world % (d.tensor * d.context):
        return f"tensor x context = {d.tensor * d.context} does not divide {world} ranks"
    return None


def fits(style: str):
    """The predicate of the modules a `parallel ... STYLE` statement fits, as planc's checks decide it."""
    if style == "expert":
        from planc.resolve.experts import layout

        def is_experts(module) -> bool:
            try:
                layout(module)
            except ValueError:
                return False
            return True
        return is_experts
    from planc.checks.context_parallel import supports_context
    return lambda module: supports_context(type(module))


def auto_rules(graph, style: str) -> tuple[str, ...]:
    """`parallel SELECTOR STYLE` for every module of `graph`'s model the style fits, one statement per
    path with list indices as `*` (`layers.*.moe.experts`); empty when none fits."""
    ok = fits(style)
    paths = [path for path, module in graph.model.named_modules() if path and ok(module)]
    selectors = dict.fromkeys(".".join("*" if part.isdigit() else part for part in p.split(".")) for p in paths)
    return tuple(f"parallel {s} {style}" for s in selectors)


def input_text(ev, shown: str, base: tuple[int, ...], optimizer: str) -> str:
    """The header's input sentence for a search at `ev`'s degrees (`base`: the BxS per rank asked for)."""
    b, s = base
    if ev.context > 1:
        group = ev.tensor * ev.context
        kind = "context group" if ev.tensor == 1 else "tensor x context group"
        return (f"input {shown} per {kind} of {group} ranks (the {b}x{s} asked for: a context group of {ev.context} "
                f"shares its sequences, each rank holding {ev.tensor * b}x{s // ev.context} tokens of them; the world "
                f"trains {ev.world * b // ev.context} sequences a step, so degrees are compared per {ev.world * b} "
                f"sequences: the step time x {ev.context}), {optimizer},")
    return (f"input {shown} per tensor group of {ev.tensor} ranks (the {b}x{s} per rank asked for: "
            f"every degree trains {ev.world * b} sequences a step), {optimizer},")


def axis_lines(ev) -> list[str]:
    """The header's line per parallel axis of the plan."""
    lines = []
    if ev.tensor > 1:
        lines.append(f"  tensor parallelism: tensor = {ev.tensor}, the `parallel` statements below")
    if ev.context > 1:
        lines.append(f"  context parallelism: context = {ev.context}, the `parallel ... context` statements below: "
                     f"each batch is cut along the sequence (2 x {ev.context} chunks, head-tail); the training loop "
                     "feeds `applied.shard_batch(tokens, labels)` (plans/zoo-llama-context.plan)")
    if ev.expert > 1:
        from planc.estimate.expert_local import ROUTING
        lent = "shard x context" if ev.context > 1 else "shard"
        lines.append(f"  expert parallelism: expert = {ev.expert} (borrowed from {lent}: each expert rank keeps 1 / "
                     f"{ev.expert} of the experts, FSDP-sharded over {lent} / {ev.expert} ranks), the `parallel ... "
                     f"expert` statements below; estimated with {ROUTING}")
    return lines
