"""`h2o`: Heavy-Hitter Oracle, accumulated attention + recent tokens (Zhang et al., NeurIPS 2023).

Paper: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models" (NeurIPS 2023). Reference code: FMInference/H2O (`h2o_hf`,
`H2OKVCache_LayerWise`): every cached token accumulates the attention it receives from
every query (the prompt's queries at prefill, then one query per decode step); the cache
keeps the `heavy` tokens with the largest accumulated score plus the `recent` newest.

kvflow: `observe()` runs inside kvflow's attention function at every forward (prefill
chunks, ingested text and decode steps alike) and adds, for each cached token, the softmax
attention it receives from each real new query (padding queries excluded), summed over the
g query heads of its KV head and over the new queries. The sums live in the cache's
per-layer statistic [rows, kv_heads, capacity] float32, which is gathered with the kept
slots at every compaction (a kept token keeps its history) and copied with forked rows.
A new token starts at 0 and first gets the attention its own forward pays to it. The
attention is recomputed from the queries in float32 with the model's softmax scale, next
to (not instead of) the model's own sdpa call, so outputs are unchanged.

Budget convention: kvflow's (METHODS §0): exactly `budget` tokens per (layer, KV head)
after a compaction: the `window` newest (H2O's recent tokens) and the `budget - window`
heaviest older ones (its heavy hitters); the reference's `heavy_ratio`/`recent_ratio` of
the sequence become absolute counts. Cadence: the reference evicts one token per decode
step once full (`buffer: 1` here reproduces that); the default evicts every `buffer` tokens.

Shapes: observe: query [rows, q_heads, T, head_dim], keys [rows, kv_heads, span, head_dim]
-> stats[:, :, :span] += [rows, kv_heads, span]; score = stats [rows, kv_heads, N].
GQA: sum over the g query heads of a KV head (the reference is MHA, per head); keys are
never expanded. Cost: one extra QKᵀ per layer per forward (O(T·span) per head).
"""

from __future__ import annotations

from kvflow._lazy import torch
from kvflow.components.base import Evictor, EvictorParams


class H2OParams(EvictorParams):
    pass


class H2OEvictor(Evictor):
    """H2O: keep the tokens with the most accumulated attention, plus the most recent ones."""

    Params = H2OParams
    layer_invariant = True  # scores from the rows' tensors alone (Evictor.select_layers stacks layers)
    observes_attention = True
    observed_statistic = "accumulated_attention"  # engines' decode graphs compute it themselves

    def observe(self, stats, query, keys, mask, *, layer_idx, scaling):
        rows, q_heads, t, d = query.shape
        kv_heads, span = keys.shape[1], keys.shape[2]
        g = q_heads // kv_heads
        q = query.float().reshape(rows, kv_heads, g * t, d)
        logits = torch.matmul(q, keys.float().transpose(-1, -2)).mul_(scaling)  # [rows, kv, g*T, span]
        allowed = mask[:, None, None] if mask.dim() == 3 else mask[:, :, None]  # [rows, 1 or kv, 1, T, span]
        logits = logits.view(rows, kv_heads, g, t, span).masked_fill_(~allowed, float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # padding queries: all -inf -> 0
        stats.add_(probs.sum(dim=(2, 3)))

    def score(self, keys, values, queries, *, layer_idx, lengths, generators, stats=None, **kwargs):
        return stats
