"""`tova`: Token Omission Via Attention, the newest query's attention (kvpress's TOVAPress).

Paper: Oren, Hassid, Yarden, Adi and Schwartz, "Transformers are Multi-State RNNs" (EMNLP
2024), https://arxiv.org/abs/2401.06104; reference code schwartz-lab-NLP/TOVA
(`tova_cache.py`). The cache keeps the tokens the *newest* query attends to most: softmax of
q·kᵀ/√d over the row's resident tokens (the newest included), averaged over every query head
of the layer, so all KV heads keep the same tokens (`heads: layer`, the paper's and kvpress's
rule). `heads: group` averages over the g query heads of each KV head instead, so that each KV
head keeps its own tokens.

kvpress: `TOVAPress` (the last query's attention over all keys, the last key dropped and
re-added with the maximum score + 1, so the newest token is always kept: kvflow's
`window: 1`, the default here). The tutorial's example plugin (plugins/kvflow-example-tova,
`kind: tova-example`) is the same method written as a third-party plugin. Budget convention:
kvflow's (METHODS §0). Cadence: every `buffer` tokens; `buffer: 1` is the paper's
one-token-per-step policy.

Shapes: keys [rows, kv_heads, N, head_dim], queries [rows, q_heads, 1, head_dim] (the query
of each row's newest cached token) -> scores [rows, kv_heads, N] float32. GQA: `heads` above;
keys are never expanded (queries viewed as [rows, kv_heads, g, head_dim]).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from kvflow._lazy import torch
from kvflow.components.base import Evictor, EvictorParams
from kvflow_builtin.evictors._common import valid_slots


class TOVAParams(EvictorParams):
    window: int = Field(1, ge=0, description="Most recent tokens always kept (kvpress keeps the newest).")
    heads: Literal["layer", "group"] = Field(
        "layer", description="Average the newest query's attention over all query heads of the layer (the paper, "
                             "kvpress) or over each KV head's own group.")


class TOVAEvictor(Evictor):
    """TOVA: keep the tokens the newest query attends to most (Oren et al. 2024)."""

    Params = TOVAParams
    layer_invariant = True  # scores from the rows' tensors alone (Evictor.select_layers stacks layers)

    @property
    def query_window(self) -> int:
        return 1

    def score(self, keys, values, queries, *, layer_idx, lengths, generators, **kwargs):
        rows, kv_heads, n, d = keys.shape
        g = queries.shape[1] // kv_heads
        newest = queries[:, :, -1].float().reshape(rows, kv_heads, g, d)
        logits = torch.matmul(newest, keys.float().transpose(-1, -2)) / math.sqrt(d)  # [rows, kv_heads, g, N]
        resident = valid_slots(lengths, n, keys.device)[:, None, None, :]
        attention = logits.masked_fill(~resident, float("-inf")).softmax(dim=-1)
        if self.params.heads == "layer":
            return attention.mean(dim=(1, 2))[:, None, :].expand(rows, kv_heads, n)
        return attention.mean(dim=2)
