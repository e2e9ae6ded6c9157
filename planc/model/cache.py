"""One build per model reference and plan folder: the CLI's run and the language server's life share it."""

from __future__ import annotations

from planc.model.build import ModelLoadError, build_model
from planc.model.graph import ModelGraph


class ModelCache:
    """Builds each referenced model once per run (on meta) and remembers failures."""

    def __init__(self):
        self._graphs: dict[tuple[str, str | None], ModelGraph | ModelLoadError] = {}

    def graph(self, ref: str, base: str | None = None) -> ModelGraph:
        """`base`: the plan's folder, where a relative `hf:` config path starts."""
        key = (ref, base)
        if key not in self._graphs:
            try:
                self._graphs[key] = ModelGraph.from_module(build_model(ref, base=base))
            except ModelLoadError as err:
                self._graphs[key] = err
        result = self._graphs[key]
        if isinstance(result, ModelLoadError):
            raise result
        return result
