"""`knorm`: keep the tokens whose keys have the smallest L2 norm (kvpress's KnormPress).

Paper: Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression" (EMNLP 2024), https://arxiv.org/abs/2406.11430. Keys with a low L2 norm draw
high attention, so the score is the negative key norm: no queries, no attention.

kvpress: `KnormPress` scores `-keys.norm(dim=-1)` in the cache's dtype; kvflow computes the
norm in float32 (the ranking differs only where bfloat16 rounding ties or swaps two norms).
Budget convention: kvflow's (METHODS §0): exactly `budget` tokens per (layer, KV head)
after a compaction, the `window` newest among them (kvpress keeps nothing by force; `window: 0`
is its rule). Cadence: every `buffer` tokens (kvpress's `DecodingPress.compression_interval`).

Shapes: keys [rows, kv_heads, N, head_dim] -> scores [rows, kv_heads, N] float32. GQA: not
applicable (keys only, per KV head).
"""

from __future__ import annotations

from kvflow.components.base import Evictor, EvictorParams


class KnormParams(EvictorParams):
    pass


class KnormEvictor(Evictor):
    """Keep the tokens with the smallest key norms (Devoto et al. 2024)."""

    Params = KnormParams
    layer_invariant = True  # scores from the rows' tensors alone (Evictor.select_layers stacks layers)

    def score(self, keys, values, queries, *, layer_idx, lengths, generators, **kwargs):
        return -keys.float().norm(dim=-1)  # [rows, kv_heads, N]
