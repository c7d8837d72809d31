"""Components written the way a plugin author would write them, outside `kvflow_builtin`,
that kvflow's contract suites must pass (tests/test_evictor_contract.py runs them).
Importable by module path, so SGLang's scheduler (kvflow's plugin) loads them as it loads
any evictor.

- `KeyNormEvictor`: keeps the keys with the smallest L2 norm (Devoto et al. 2024, "A Simple
  and Effective L2 Norm-Based Strategy for KV Cache Compression", arXiv 2406.11430; kvpress's
  `KnormPress`). Its scores tie in exact arithmetic wherever one token repeats: RoPE rotates
  the token's key without changing its norm, so the norms differ only by rounding, and the
  rounding differs between a row decoded alone and in a batch (the float32 forward is not
  batch-invariant on a CPU). The evictor contract must not blame the evictor for that
  (`EvictorContract.test_batched_equals_alone`; docs/components.md, "Ties").
- `OwnObserveH2O`: an evictor that observes attention with its own `observe()` (here H2O's
  arithmetic through a subclass), which SGLang's decode graph does not keep: on an engine
  without decode graphs kvflow observes its rows eagerly (tests/test_sglang_evicted.py).
"""

from __future__ import annotations

from kvflow.components.base import Evictor, EvictorParams
from kvflow_builtin.evictors.h2o import H2OEvictor


class KeyNormEvictor(Evictor):
    """Keeps the cached keys with the smallest L2 norm (score = -||k||)."""

    Params = EvictorParams

    def score(self, keys, values, queries, **kwargs):
        return -keys.float().norm(dim=-1)  # [rows, kv_heads, N]



class OwnObserveH2O(H2OEvictor):
    """H2O's statistic through its own `observe()` (not the class the decode graph keeps)."""

    def observe(self, stats, query, keys, mask, *, layer_idx, scaling):
        return super().observe(stats, query, keys, mask, layer_idx=layer_idx, scaling=scaling)
