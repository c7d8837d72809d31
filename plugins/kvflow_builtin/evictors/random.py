"""`random`: Random Attention's eviction (Salesforce 2026).

Paper: "Random Attention" (Salesforce AI Research, 2026). Reference behaviour (its engine's
`random_pp`): every cached token gets an independent Uniform(0, 1) draw per (row, layer, KV
head), re-drawn at every compaction; the prompt is protected; the top scores survive. No
attention is computed, so it is the cheapest method.

Budget convention: kvflow's (METHODS §0): after a compaction exactly `budget` tokens per
(layer, KV head) remain, the most recent `window` always among them; compaction fires at
`budget + buffer`. The reference's `token_budget = K + r` with r = 64 recent tokens and a
compaction every 64 steps corresponds to `budget = K + 64, window = 64, buffer = 64`.

Shapes: keys [rows, kv_heads, N, head_dim] -> scores [rows, kv_heads, N]. GQA: scores are
drawn per KV head, so no reduction over query heads is needed. Cadence: every `buffer`
tokens. Draws come from one generator per row, seeded from (run seed, problem, proposer,
candidate) and the row's compaction count, and each row draws only over its own resident
length, so a row gives the same result alone or in any batch.
"""

from __future__ import annotations

from pydantic import Field

from kvflow._lazy import torch
from kvflow.components.base import Evictor, EvictorParams


class RandomParams(EvictorParams):
    protect_prompt: bool = Field(True, description="Keep the prompt (the paper's random_pp).")


class RandomEvictor(Evictor):
    """Uniform random scores per (row, layer, KV head, token), prompt protected by default."""

    Params = RandomParams

    def score(self, keys, values, queries, *, layer_idx, lengths, generators, **kwargs):
        rows, kv_heads, n, _ = keys.shape
        scores = torch.zeros(rows, kv_heads, n, dtype=torch.float32)
        for r, (length, gen) in enumerate(zip(lengths.tolist(), generators)):
            scores[r, :, :length] = torch.rand(kv_heads, length, generator=gen)
        return scores.to(keys.device)
