"""The attention function kvflow registers with transformers' `AttentionInterface`.

It is sdpa with two differences (three for a decode step, a `DecodeBatch`, which writes and
attends once per layer and row pool: `kvflow.backends.hf.decode_batch`): the mask comes from the `BudgetedCache` write plan (per-row
valid lengths, right padding) instead of transformers' mask builders, and the post-RoPE
queries are handed to the cache, which keeps the last W for attention-based evictors and,
for evictors that observe attention (H2O), lets them update a per-token statistic. Caches of
other evictors do no extra work here.
Because "kvflow" is not registered as a mask function, transformers passes our 4D mask
(or None) through untouched. In batch-invariant mode (`run.deterministic`) attention and the
observed statistic run row by row (`kvflow.backends.hf.invariant`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvflow.backends.hf import invariant

NAME = "kvflow"


def kvflow_attention(module, query, key, value, attention_mask, **kwargs):
    cache = kwargs.pop("kvflow_cache", None)
    if hasattr(cache, "attend"):  # a DecodeBatch: one attention call per layer and row pool
        return cache.attend(sdpa_attention_forward, module, query, key, value, **kwargs)
    if cache is not None and invariant.enabled():
        return _attend_rows(cache, module, query, key, value, **kwargs), None
    if cache is not None:
        if cache.varies:  # each layer has its own lengths and per-head holes
            attention_mask = cache.attention_mask(module.layer_idx, query.shape[1])
        if cache.query_window:
            cache.layers[module.layer_idx].record_queries(query)
        if cache.observes:  # e.g. H2O: the attention every cached key receives from the new queries
            cache.layers[module.layer_idx].observe(query, key, _scaling(module, query, kwargs), module.layer_idx)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _attend_rows(cache, module, query, key, value, **kwargs):
    """`kvflow_attention` in batch-invariant mode: each row over its own keys and real queries
    (query: [rows, heads, T, D]; key, value: [rows, kv_heads, span, D]) -> [rows, T, heads, D]."""
    layer_idx = module.layer_idx
    queries, mask, ends = cache.row_extents(layer_idx, query.shape[1])
    if cache.query_window:
        cache.layers[layer_idx].record_queries(query)
    if cache.observes:
        invariant.observe_rows(cache, layer_idx, query, key, queries, ends, _scaling(module, query, kwargs))
    return invariant.attend_rows(sdpa_attention_forward, module, query, key, value, queries, mask, ends, **kwargs)


def _scaling(module, query, kwargs) -> float:
    return kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5


AttentionInterface.register(NAME, kvflow_attention)


@contextlib.contextmanager
def kvflow_attention_enabled(model: torch.nn.Module) -> Iterator[None]:
    """Route the model's attention through kvflow for the duration of one forward, so the
    same model object still works with plain `generate` outside."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
