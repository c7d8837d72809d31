"""`tova`: Token Omission Via Attention, a KV eviction method as a kvflow plugin.

Paper: Oren, Hassid, Yarden, Adi and Schwartz, "Transformers are Multi-State RNNs"
(EMNLP 2024), https://arxiv.org/abs/2401.06104. TOVA keeps the cached tokens that the
*newest* query attends to most: when the cache is full, the token with the lowest
softmax-normalised attention from the current query (averaged over heads) is dropped.
Unlike SnapKV or H2O, no window of recent queries and no accumulated history is used.

In kvflow a compaction keeps exactly `budget` tokens per (layer, KV head) once `budget +
buffer` are resident, so `buffer: 1` is the paper's one-token-per-step policy and a larger
buffer evicts several tokens at once, all by the attention of the newest query. The paper
drops tokens per layer, from the attention averaged over all of a layer's heads; kvflow's
cache keeps a budget per KV head, so by default (`heads: group`) each KV head keeps the
tokens its own group of query heads (the heads that share it under GQA) attends to most,
and `heads: layer` averages over every head of the layer, so that all KV heads keep the same
tokens, as in the paper.

Shapes:
    keys:    [rows, kv_heads, N, head_dim] post-RoPE; slots >= lengths[row] are padding
    queries: [rows, q_heads, W, head_dim] with W = query_window = 1: the query of each
             row's newest cached token (q_heads = g * kv_heads; query head h reads KV head h // g)
    scores:  [rows, kv_heads, N] float32, softmax(q · kᵀ / √head_dim) over the row's
             resident tokens, averaged over the g heads of a KV group (or over all heads)
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from kvflow._lazy import torch
from kvflow.components import Evictor, EvictorParams


class TovaParams(EvictorParams):
    buffer: int = Field(1, ge=1, description="Tokens appended between compactions; 1 is the paper's "
                                             "one-eviction-per-step policy.")
    window: int = Field(0, ge=0, description="Most recent tokens always kept (the paper keeps none).")
    heads: Literal["group", "layer"] = Field(
        "group", description="Average the attention over the query heads of each KV group (per-KV-head "
                             "budget), or over all heads of the layer (the paper's layer-wise policy).")


class TovaEvictor(Evictor):
    """TOVA: keep the tokens the newest query attends to most (Oren et al. 2024)."""

    Params = TovaParams

    @property
    def query_window(self) -> int:
        return 1  # only the newest query

    # --8<-- [start:score]
    def score(self, keys, values, queries, *, lengths, **kwargs):
        rows, kv_heads, n, d = keys.shape
        g = queries.shape[1] // kv_heads
        newest = queries[:, :, -1].float().reshape(rows, kv_heads, g, d)  # [rows, kv_heads, g, d]
        logits = torch.matmul(newest, keys.float().transpose(-1, -2)) / math.sqrt(d)  # [rows, kv_heads, g, N]
        resident = torch.arange(n, device=keys.device)[None, :] < lengths.to(keys.device)[:, None]  # [rows, N]
        attention = logits.masked_fill(~resident[:, None, None, :], float("-inf")).softmax(dim=-1)
        if self.params.heads == "layer":
            return attention.mean(dim=(1, 2))[:, None, :].expand(rows, kv_heads, n)
        return attention.mean(dim=2)
    # --8<-- [end:score]
