"""`snapkv`: SnapKV's observation-window attention, applied at decode time (Li et al., NeurIPS 2024).

Paper: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation"
(NeurIPS 2024). The original compresses only the prompt, once, at prefill: the last W
queries vote for the older tokens, s = pool(Σ_W softmax(q·kᵀ/√d)), and the top
`budget - W` plus the last W survive (W = 32, avg-pool 5; LongBench configs max-pool 7).
Reasoning papers apply it repeatedly while decoding, in two flavours, both available here:

- **default, R-KV's SnapKV baseline** (Zefan-Cai/R-KV: R-KV without the redundancy term):
  `window: 8`, `gqa: max` (max over the g query heads of a KV head on the raw logits, before
  the softmax), `softmax_keys: older` (softmax over the L - W older tokens only), mean over
  the W queries, `pooling: max`, `kernel: 7`. With these defaults snapkv equals
  `rkv` with `mix_lambda: 1`, which makes it the clean ablation of R-KV's redundancy term.
- **the VaSE / Random Attention engine's SnapKV**: `window: 64, gqa: mean,
  softmax_keys: causal, pooling: avg, kernel: 5` (per-query-head softmax over all keys with
  a causal mask inside the window, mean over the W queries, avg-pool 5, then the mean over
  the GQA group; the engine keeps `token_budget = K + 64`, i.e. `budget = K + 64`).

Budget convention: kvflow's (METHODS §0): exactly `budget` tokens per (layer, KV head)
after a compaction, the last `window` among them (R-KV's budget includes its window of 8,
as here). The observation window is the recent window: the cache buffers the last
`window` post-RoPE queries per layer.

Shapes: keys [rows, kv_heads, N, head_dim], queries [rows, q_heads, W, head_dim] ->
scores [rows, kv_heads, N] (zero on the window, which the base class keeps anyway).
GQA: `gqa` above; keys are never expanded to query heads (queries are viewed as
[rows, kv_heads, g * W, head_dim]). Cadence: every `buffer` tokens (R-KV: buffer 128).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from kvflow.components.base import Evictor, EvictorParams
from kvflow_builtin.evictors._common import attention_signal, odd_kernel


class SnapKVParams(EvictorParams):
    window: int = Field(8, ge=1, description="Observation window: the last W queries score the older tokens; "
                                             "the last W tokens are always kept.")
    kernel: int = Field(7, ge=1, description="Pooling kernel along the tokens (odd; 1 = no pooling).")
    pooling: Literal["max", "avg", "none"] = Field("max", description="Pooling of the scores (R-KV: max; VaSE engine: avg).")
    gqa: Literal["max", "mean"] = Field("max", description="GQA reduction: max = max over the group's raw logits before "
                                                           "softmax (R-KV); mean = per-head softmax, mean after pooling.")
    softmax_keys: Literal["older", "causal"] = Field(
        "older", description="Softmax over the older tokens only (R-KV) or over all tokens with a causal window (SnapKV).")

    _odd_kernel = field_validator("kernel")(odd_kernel)


class SnapKVEvictor(Evictor):
    """Decode-time SnapKV: recent queries' attention, pooled, picks the kept tokens."""

    Params = SnapKVParams
    layer_invariant = True  # scores from the rows' tensors alone (Evictor.select_layers stacks layers)

    @property
    def query_window(self) -> int:
        return self.params.window

    def score(self, keys, values, queries, *, layer_idx, lengths, generators, **kwargs):
        p = self.params
        return attention_signal(keys, queries, lengths, gqa=p.gqa, softmax_keys=p.softmax_keys,
                                pooling=p.pooling, kernel=p.kernel)
