"""Evictors composed from a built-in scorer and an allocation mixin, for tests and as
examples of composition (kvflow.components.allocation): H2O's accumulated attention under
Ada-KV's head allocation and under PyramidKV's layer budgets. Importable by module path, so
SGLang's scheduler (kvflow's plugin) can load them as it loads any evictor."""

from __future__ import annotations

from kvflow.components.allocation import AdaptiveHeads, AdaptiveParams, PyramidLayers, PyramidParams
from kvflow_builtin.evictors.h2o import H2OEvictor, H2OParams


class AdaH2OParams(AdaptiveParams, H2OParams):
    pass


class AdaH2O(AdaptiveHeads, H2OEvictor):
    """H2O's accumulated attention, Ada-KV's allocation across the heads of a layer."""

    Params = AdaH2OParams


class PyramidH2OParams(PyramidParams, H2OParams):
    pass


class PyramidH2O(PyramidLayers, H2OEvictor):
    """H2O's accumulated attention, PyramidKV's layer budgets."""

    Params = PyramidH2OParams
