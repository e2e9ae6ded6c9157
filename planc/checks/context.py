"""What every check reads (`Context`), what it declares it needs (`Check`), and shared helpers.

A check is a plain function `Context -> Iterable[Diagnostic]`. It declares the inputs it
needs (`MODEL`, `WORLD`, `MEMORY`); the driver (`planc/checks/validate.py`) runs it only
when the compile has them, so no check tests `graph is None` itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from planc.diagnostics import Diagnostic
from planc.lang import syntax as st
from planc.model.graph import ModelGraph
from planc.resolve.ir import Resolution, Unit

MODEL = "model"      # a model graph (`planc check` with a `model` line or `--model`)
WORLD = "world"      # a world size (`--world-size`, `compile(world_size=...)`)
MEMORY = "metrics"  # the memory model, for a plan with no errors so far (`check_memory=True`)
NEEDS = frozenset({MODEL, WORLD, MEMORY})


@dataclass(frozen=True)
class Context:
    """The inputs of one validation: the plan, its resolution, and what else is known."""

    plan: st.Plan
    graph: ModelGraph | None
    res: Resolution
    world_size: int | None
    # memory metrics, if any: (metric, world, input shape) -> bytes; raises `TraceError` when
    # the model cannot run on that input
    metrics: Callable[[str, int | None, tuple[int, ...] | None], float | None] | None = None
    # the memory estimate behind `metrics`, (world, input shape) -> `planc.estimate.memory.Estimate`
    # (cached: the same one `metrics` read), to say where a bound fails (a pipeline's binding rank)
    memory: Callable[[int | None, tuple[int, ...] | None], Any] | None = None
    # what several checks derive from the same inputs, computed once per context (see `memo`);
    # `dataclasses.replace` starts a fresh one
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def memo(self, key: str, build: Callable[[], Any]) -> Any:
        """`build()` once per context under `key`: a value several checks read (they never mutate it)."""
        memo = self._memo
        if key not in memo:
            memo[key] = build()
        return memo[key]

    @property
    def mesh_sizes(self) -> tuple[int, int] | None:
        return self.res.mesh.dp_sizes(self.world_size)

    def inner_units(self) -> Iterator[Unit]:
        return (u for u in self.res.units if not u.is_root)

    @property
    def available(self) -> frozenset[str]:
        """The `NEEDS` this context can meet."""
        return frozenset(name for name, have in ((MODEL, self.graph is not None),
                                                  (WORLD, self.world_size is not None),
                                                  (MEMORY, self.metrics is not None)) if have)


@dataclass(frozen=True)
class Check:
    """One registered check: the function and the inputs it needs to run at all."""

    fn: Callable[[Context], Iterable[Diagnostic]]
    needs: frozenset[str] = frozenset()
    # True for checks of the plan's own `expect` lines: a failed expectation does not make
    # the plan invalid, so it does not stop the memory model from running for later lines
    about_expectations: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.needs) - NEEDS
        if unknown:
            raise ValueError(f"{self.fn.__name__} needs unknown inputs {sorted(unknown)}")

    @property
    def name(self) -> str:
        return self.fn.__name__

    def runs_with(self, available: frozenset[str]) -> bool:
        return self.needs <= available


def err(code, message, span, label="", help_=(), related=(), severity="error") -> Diagnostic:
    """A diagnostic in one call (checks build many)."""
    return Diagnostic(code=code, severity=severity, message=message, span=span, label=label,
                      help=tuple(help_), related=tuple(related))


def listed(items: list[str], limit: int = 3) -> str:
    """`a`, `a` and `b`, or `a`, `b`, `c` and 4 more: a list of names for one message."""
    shown = [f"`{n}`" for n in items[:limit]]
    if len(items) > limit:
        return ", ".join(shown) + f" and {len(items) - limit} more"
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]


def by_key(findings) -> dict:
    """Group (key, item) pairs by key, keeping first-seen order: one diagnostic per rule, not
    per parameter or unit a wildcard matched."""
    groups: dict = {}
    for key, item in findings:
        groups.setdefault(key, []).append(item)
    return groups
