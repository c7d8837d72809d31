"""`streaming`: StreamingLLM's attention sinks + recent tokens (Xiao et al., ICLR 2024).

Paper: Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024).
Reference code: mit-han-lab/streaming-llm (`StartRecentKVCache`): keep the first
`start_size` = 4 tokens and the most recent `recent_size`, drop the middle. No scores.

Budget convention: kvflow's (METHODS §0): after a compaction exactly `budget` tokens per
(layer, KV head) remain: the first `n_sink` slots and the newest `budget - n_sink` (which
contain the `window`). The reference's cache size `start_size + recent_size` is `budget`.
With `protect_prompt` the prompt is kept as well (inside the budget) and the recent part
shrinks accordingly. Difference from the reference: StreamingLLM re-assigns positions
inside the cache ("pos-shift", RoPE applied at read time); kvflow stores keys after RoPE
and keeps the logical positions, so the kept keys are exactly the ones the model wrote.

Shapes: keys [rows, kv_heads, N, head_dim] -> scores [rows, kv_heads, N] (the slot index,
sinks lifted above every other slot). GQA: not applicable, every KV head keeps the same
slots. Cadence: every `buffer` tokens (compaction at `budget + buffer`); `buffer: 1` gives
the reference's evict-every-token behaviour.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from kvflow._lazy import torch
from kvflow.components.base import Evictor, EvictorParams


class StreamingParams(EvictorParams):
    n_sink: int = Field(4, ge=0, description="Leading cache slots always kept (attention sinks); the reference's start_size.")

    @model_validator(mode="after")
    def _sinks_fit(self):
        if self.budget_bytes is None and self.n_sink + self.window > self.budget:
            raise ValueError(f"n_sink + window ({self.n_sink} + {self.window}) must not exceed budget ({self.budget})")
        return self


class StreamingEvictor(Evictor):
    """StreamingLLM: keep the first n_sink tokens (attention sinks) and the most recent ones."""

    Params = StreamingParams
    layer_invariant = True  # scores from the rows' tensors alone (Evictor.select_layers stacks layers)

    def score(self, keys, values, queries, *, layer_idx, lengths, generators, **kwargs):
        rows, kv_heads, n, _ = keys.shape
        slot = torch.arange(n, device=keys.device, dtype=torch.float32)
        score = torch.where(slot < self.params.n_sink, slot + 2.0 * n, slot)  # sinks first, then the newest
        return score.expand(rows, kv_heads, n)
