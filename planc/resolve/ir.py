"""The IR: what a plan means for one model: units, their settings, and where each came from.

The syntax tree (`planc/syntax.py`) is what was written; this is the result of resolving it
against a model graph. Every setting carries the span and rule that set it, so `explain`
and diagnostics can always answer "why is this unit like this?".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from planc.diagnostics import Span
from planc.resolve.options import SETTING_DEFAULTS, show_value


@dataclass(frozen=True, slots=True)
class Setting:
    """A resolved value and its provenance (`span` None: planc's built-in default)."""

    value: Any
    span: Span | None = None
    rule: str = "default"
    order: int = -1  # statement index of the rule that set it; defaults < rules

    def show(self) -> str:
        return show_value(self.value)

    @property
    def origin(self) -> str:
        return f"{self.rule} ({self.span.file}:{self.span.line})" if self.span else "default"


DEFAULT_SETTINGS: Mapping[str, Setting] = MappingProxyType({k: Setting(v) for k, v in SETTING_DEFAULTS.items()})


@dataclass(frozen=True)
class Unit:
    """One `fully_shard` call: its modules, settings and the parameters it will manage."""

    modules: tuple[str, ...]
    settings: Mapping[str, Setting]
    params: tuple[str, ...] = ()
    is_root: bool = False
    span: Span | None = None
    rule: str = ""

    @property
    def name(self) -> str:
        if self.is_root:
            return "<root>"
        return self.modules[0] if len(self.modules) == 1 else "[" + ", ".join(self.modules) + "]"

    @property
    def is_group(self) -> bool:
        return len(self.modules) > 1

    def __getitem__(self, key: str) -> Any:
        return self.settings[key].value

    @property
    def reshard_after_forward(self) -> bool | int:
        """What FSDP2 will do: `None` in the plan means True for inner units, False for the root."""
        value = self["reshard_after_forward"]
        return (not self.is_root) if value is None else value


@dataclass(frozen=True)
class Mesh:
    """The device mesh: 1-D (`replicate` 1) or HSDP (replicate x shard); None sizes are `*`."""

    replicate: int | None = 1
    shard: int | None = None
    span: Span | None = None

    def sizes(self, world: int | None) -> tuple[int, int] | None:
        """(replicate, shard) for a world size, or None if it cannot be known."""
        r, s = self.replicate, self.shard
        if r is not None and s is not None:
            return r, s  # fixed; whether it fits the world is P401's business
        if world is None or world < 1 or (r is None and s is None):
            return None
        fixed = s if r is None else r
        if not fixed or world % fixed:
            return None  # `*` cannot fill the world (P401)
        return (world // fixed, fixed) if r is None else (fixed, world // fixed)

    @property
    def fixed_world(self) -> int | None:
        if self.replicate is not None and self.shard is not None:
            return self.replicate * self.shard
        return None

    @property
    def is_hsdp(self) -> bool:
        return self.replicate != 1

    def __str__(self) -> str:
        def show(v):
            return "*" if v is None else str(v)
        return f"(replicate = {show(self.replicate)}, shard = {show(self.shard)})"


@dataclass
class Resolution:
    """Everything resolved from a plan for one model (units in application order)."""

    units: list[Unit] = field(default_factory=list)
    mesh: Mesh = field(default_factory=Mesh)
    root_disabled: bool = False
    ignored: dict[str, Span] = field(default_factory=dict)                 # canonical param -> rule
    placements: dict[str, tuple[int, Span]] = field(default_factory=dict)  # canonical param -> Shard dim
    checkpoint: dict[str, Setting] = field(default_factory=dict)           # module -> mode
    compile: dict[str, Setting] = field(default_factory=dict)              # module -> torch.compile kwargs
    prefetch_forward: dict[str, tuple[str, ...]] = field(default_factory=dict)   # unit name -> unit names
    prefetch_backward: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unit_of_module: dict[str, int] = field(default_factory=dict)           # module -> index in units
    rule_effects: dict[int, int] = field(default_factory=dict)             # statement index -> effects
    conflicted: set[int] = field(default_factory=set)                      # rules dropped by P203
    broken: set[int] = field(default_factory=set)                          # rules with a bad option

    def unit(self, name: str) -> Unit:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)

    def enclosing(self, path: str, graph) -> Unit | None:
        """The unit that manages `path`'s own parameters: its own or its nearest ancestor's."""
        for p in [path, *graph.ancestors(path)] if path else [""]:
            if p in self.unit_of_module:
                return self.units[self.unit_of_module[p]]
        return None
