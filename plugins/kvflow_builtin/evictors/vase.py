"""`vase`: Value-aware Stochastic Eviction (USC 2026).

Paper: "VaSE: Value-aware Stochastic Eviction" (USC, 2026); its engine is the one the
Random Attention paper uses. kvflow follows the paper's description as restated in
the paper's description (no public reference code was available to us). Per (row, layer, KV head),
with candidates = every resident token except the last `window` (r) and the protected
prompt:

1. value range of a token = max − min of its value vector over the head dim; the first
   `n_sink` (4) cache slots get +inf; the `n_large` candidates with the largest range are
   kept. Default n_large = K // 4 with K = budget − window (the paper's budget/4, its
   budget being K).
2. the attention signal (mean over the last r queries of the per-query-head softmax, avg-pool
   5, mean over the GQA group; same code as `snapkv` with gqa mean) is zeroed at the kept
   large-value tokens, and the remaining K − n_large slots are **sampled without
   replacement in proportion to it** (Gumbel-top-k: the top of log(signal) + Gumbel noise is
   an exact draw of successive sampling without replacement). Candidates with zero signal are
   only drawn, uniformly, once every positive-signal candidate is in.
3. keep = large ∪ sampled, plus the last r (and the protected prompt), in time order.

With `protect_prompt` the prompt takes budget slots first: K becomes budget − window −
protected and n_large is capped at that K.

Budget convention: the paper's `token_budget = K + r` (r = 64 recent tokens) is kvflow's
`budget` with `window = r`; the paper's setting is `window: 64, buffer: 64,
budget: K + 64`. Defaults here follow kvflow's (window 8, buffer 128) so that methods
compare at equal settings; set them explicitly to reproduce the paper.

Randomness: one generator per row, seeded from (run seed, problem, proposer, candidate) and
the row's compaction count (the cache does this); each row draws [kv_heads, L] uniforms
per layer, so a row gives the same result alone or in any batch.

Shapes: keys/values [rows, kv_heads, N, head_dim], queries [rows, q_heads, W, head_dim] ->
scores [rows, kv_heads, N]: large tokens 1e35, sampled keys log(signal) + Gumbel, zero-signal
candidates below -1e30. GQA: mean over the g query heads after pooling; value ranges and
draws are per KV head; keys are never expanded. Cadence: every `buffer` tokens.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator

from kvflow._lazy import torch
from kvflow.components.base import Evictor, EvictorParams
from kvflow_builtin.evictors._common import attention_signal, odd_kernel, row_uniforms

LARGE = 1e35
ZERO_SIGNAL = -1e30


class VaSEParams(EvictorParams):
    window: int = Field(8, ge=1, description="Recent tokens kept (r) and queries of the attention signal; paper: 64.")
    n_large: Optional[int] = Field(None, ge=0, description="Largest-value-range tokens kept; default (budget - window) // 4.")
    n_sink: int = Field(4, ge=0, description="First cache slots whose value range counts as +inf.")
    kernel: int = Field(5, ge=1, description="Avg-pool kernel of the attention signal (odd).")
    pooling: Literal["max", "avg", "none"] = Field("avg", description="Pooling of the attention signal.")
    gqa: Literal["max", "mean"] = Field("mean", description="GQA reduction of the attention signal.")
    softmax_keys: Literal["older", "causal"] = Field(
        "causal", description="Softmax over all tokens with a causal window (SnapKV) or over the older ones only.")

    _odd_kernel = field_validator("kernel")(odd_kernel)


def value_range(values, n_sink: int):
    """max − min over the head dim, +inf on the first n_sink slots: [rows, kv_heads, N] float32."""
    v = values.float()
    rng = v.amax(dim=-1) - v.amin(dim=-1)
    sink = torch.arange(v.shape[2], device=v.device) < n_sink
    return rng.masked_fill(sink, float("inf"))


class VaSEEvictor(Evictor):
    """VaSE: keep large-value tokens, sample the rest in proportion to recent attention."""

    Params = VaSEParams

    @property
    def query_window(self) -> int:
        return self.params.window

    @property
    def n_large(self) -> int:
        p = self.params
        return p.n_large if p.n_large is not None else (p.budget - p.window) // 4

    def score(self, keys, values, queries, *, layer_idx, lengths, n_protected, generators, **kwargs):
        p = self.params
        rows, kv_heads, n, _ = keys.shape
        dev = keys.device
        lengths_d, protected = lengths.to(dev), n_protected.to(dev)
        slot = torch.arange(n, device=dev)[None, :]
        cand = (slot >= protected[:, None]) & (slot < (lengths_d - p.window)[:, None])  # [rows, N]
        # 1. large-value tokens: the top n_large candidates by value range (ties: earlier slot first)
        rng = value_range(values, p.n_sink).masked_fill(~cand[:, None, :], float("-inf"))
        order = rng.argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=dev).expand_as(order))
        room = (p.budget - p.window - protected).clamp(min=0)  # K per row
        n_large = room.clamp(max=self.n_large)
        large = (rank < n_large[:, None, None]) & cand[:, None, :]
        # 2. sample the rest without replacement in proportion to the attention signal
        signal = attention_signal(keys, queries, lengths, gqa=p.gqa, softmax_keys=p.softmax_keys,
                                  pooling=p.pooling, kernel=p.kernel)
        signal = signal.masked_fill(large | ~cand[:, None, :], 0.0)
        u = row_uniforms(generators, lengths, kv_heads, n, dev)
        tiny = torch.finfo(torch.float32).tiny
        gumbel = -torch.log(-torch.log(u.clamp(min=tiny, max=1.0 - 1e-7)))
        keyed = torch.where(signal > 0, torch.log(signal.clamp(min=tiny)) + gumbel, ZERO_SIGNAL * (2.0 - u))
        return torch.where(large, torch.full_like(keyed, LARGE), keyed)
