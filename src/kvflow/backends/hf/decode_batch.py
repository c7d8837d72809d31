"""One decode forward over the live rows of several budgeted caches of one model.

`HFRunner.decode_step` builds a `DecodeBatch` from the live rows of every running proposal
(`kvflow.backends.hf.cache.BudgetedCache` parts) and passes it to the model as its cache;
kvflow's attention function calls `attend()`, which attends part by part.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvflow.backends.hf.cache import BudgetedCache


class DecodeBatch(Cache):
    """One decode forward over the live rows of several caches of one model ("parts": the
    candidate rows of every proposal being decoded, whatever proposer they belong to).

    The model runs on the live rows only ([L, 1] tokens, L = live rows of all parts); each
    part keeps its own storage, evictor and bookkeeping, and attention runs part by part over
    that part's own span (`attend()`, called by kvflow's attention function), so nothing is
    padded to another part's length or copied into a joint tensor. A part's rows that have
    ended stay where they are (their state is kept for adoption): their pending write goes to
    the part's scratch slot and their attention output is dropped.
    """

    def __init__(self, parts: Sequence[tuple[BudgetedCache, torch.Tensor]]) -> None:
        # parts: (cache, live rows of that cache [k] int64, ascending)
        self.parts = []
        for cache, live in parts:
            full = len(live) == cache.n_rows
            step_lens = torch.zeros(cache.n_rows, dtype=torch.long)
            step_lens[live] = 1
            cache.begin_forward(step_lens, 1)
            self.parts.append((cache, live.to(cache.device), full, step_lens))
        self.counts = [len(live) for _, live in parts]
        super().__init__(layers=[_DecodeLayer() for _ in range(len(parts[0][0].layers))])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states  # written part by part in attend()

    def attend(self, attention, module, query, key, value, **kwargs):
        """Write each part's new keys and values and attend over the part's own slots.

        query: [L, q_heads, 1, D]; key, value: [L, kv_heads, 1, D] (post-RoPE, live rows in
        part order); attention: the sdpa forward; returns ([L, 1, q_heads, D], None)."""
        layer_idx = module.layer_idx
        scaling = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        outs = []
        for (cache, live, full, _), q, k, v in zip(self.parts, query.split(self.counts), key.split(self.counts),
                                                   value.split(self.counts)):
            if not full:  # ended rows get zeros: a scratch-slot write and an output that is dropped
                q, k, v = (x.new_zeros(cache.n_rows, *x.shape[1:]).index_copy_(0, live, x) for x in (q, k, v))
            layer = cache.layers[layer_idx]
            keys, values = layer.update(k, v)
            if cache.query_window:
                layer.record_queries(q)
            if cache.observes:
                layer.observe(q, keys, scaling, layer_idx)
            out, _ = attention(module, q, keys, values, cache.attention_mask(layer_idx, q.shape[1]), **kwargs)  # [rows, 1, heads, D]
            outs.append(out if full else out.index_select(0, live))
        return torch.cat(outs), None

    def end_forward(self) -> None:
        for cache, _, _, step_lens in self.parts:
            cache.end_forward(step_lens)


class _DecodeLayer(CacheLayerMixin):
    """Placeholder layer: storage lives in the parts of the DecodeBatch."""

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return 1, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1
