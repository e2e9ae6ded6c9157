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
from planc.resolve.mesh import Mesh
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
    parallel: dict[str, Setting] = field(default_factory=dict)             # module -> TensorStyle (tensor parallel)
    context: dict[str, Setting] = field(default_factory=dict)              # module -> the `context` style
    experts: dict[str, Setting] = field(default_factory=dict)              # module -> the `expert` style
    prefetch_forward: dict[str, tuple[str, ...]] = field(default_factory=dict)   # unit name -> unit names
    prefetch_backward: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unit_of_module: dict[str, int] = field(default_factory=dict)           # module -> index in units
    rule_effects: dict[int, int] = field(default_factory=dict)             # statement index -> effects
    conflicted: set[int] = field(default_factory=set)                      # rules dropped by P203
    broken: set[int] = field(default_factory=set)                          # rules with a bad option
    step: Setting | None = None                                            # `step`: an Accumulation
    pipeline: Any = None                        # `pipeline`/`stage` lines: a `planc.resolve.pipeline.Pipeline`

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
