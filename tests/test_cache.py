"""BudgetedCache bookkeeping: the query buffer and the per-token statistic of observing evictors."""

from __future__ import annotations

import pytest
import torch

from kvflow.backends.hf.cache import BudgetedCache
from kvflow.testing import tiny_runner
from kvflow_builtin.evictors.h2o import H2OEvictor
from kvflow_builtin.evictors.none import NoEviction
from kvflow_builtin.evictors.snapkv import SnapKVEvictor


class _FullWithQueries(NoEviction):
    """Full KV that still buffers the last 4 queries (to test the buffer without eviction)."""

    @property
    def query_window(self) -> int:
        return 4


def _capture_queries(cache, seen):
    """Wrap every layer's record_queries to log (real queries per row) of each forward."""
    for i, layer in enumerate(cache.layers):
        orig = layer.record_queries

        def rec(query, _orig=orig, _i=i):
            seen[_i].append(query.detach().clone())
            return _orig(query)

        layer.record_queries = rec


@pytest.mark.parametrize("evictor", ["full", "snapkv"])
def test_query_buffer_keeps_last_w_real_queries(evictor):
    runner = tiny_runner("qwen2")
    ev = _FullWithQueries(NoEviction.Params()) if evictor == "full" else \
        SnapKVEvictor(SnapKVEvictor.Params(budget=20, buffer=12, window=4))
    w = ev.query_window
    cache = runner.new_cache(ev, 3)
    seen = {i: [] for i in range(len(cache.layers))}
    _capture_queries(cache, seen)
    # rows advance by different step lengths, with right padding and rows that add nothing
    plan = [[5, 2, 0], [1, 3, 2], [0, 1, 1], [2, 0, 3], [1, 1, 1], [3, 0, 2]]
    step_lens = []
    for lens in plan:
        ids = [[7 + (r * 13 + k) % 50 for k in range(n)] for r, n in enumerate(lens)]
        runner.forward(cache, ids, logits="none")
        step_lens.append(lens)
    for i, layer in enumerate(cache.layers):
        for r in range(3):
            real = torch.cat([q[r, :, : lens[r]] for q, lens in zip(seen[i], step_lens)], dim=1)  # [heads, total, d]
            n_valid = min(w, real.shape[1])
            assert int(cache.rows.n_queries[r]) == n_valid
            got = layer.queries[r, :, w - n_valid:]
            torch.testing.assert_close(got, real[:, real.shape[1] - n_valid:], rtol=0, atol=0)
            assert (layer.queries[r, :, : w - n_valid] == 0).all()


def test_query_buffer_rejects_window_beyond_trigger():
    class Wide(SnapKVEvictor):
        @property
        def query_window(self):
            return 40

    with pytest.raises(ValueError):
        tiny_runner("qwen2").new_cache(Wide(SnapKVEvictor.Params(budget=16, buffer=8, window=4)), 1)


def _eager_column_sums(runner, ids):
    """Attention each token receives from every later-or-equal query, summed over the query
    heads of its KV head, per layer: [layers][kv_heads, T], from transformers' eager attention."""
    model = runner.model
    prev = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True)
    finally:
        model.config._attn_implementation = prev
    kv = model.config.num_key_value_heads
    sums = []
    for att in out.attentions:  # [1, q_heads, T, T]
        a = att[0].float().sum(dim=1)  # [q_heads, T] over queries
        sums.append(a.view(kv, -1, a.shape[-1]).sum(dim=1))
    return sums


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_observed_attention_matches_eager_attention(arch):
    """H2O's accumulated statistic equals the column sums of the model's own attention
    matrices (eager attention, output_attentions) over a mix of batched prefill and decode."""
    runner = tiny_runner(arch)
    ev = H2OEvictor(H2OEvictor.Params(budget=60, buffer=20, window=2))
    prompts = [list(range(5, 17)), list(range(30, 35))]
    cache = runner.new_cache(ev, 2)
    pending = runner.prefill(cache, prompts)
    seqs = [p[:-1] for p in prompts]
    for _ in range(6):
        for r, t in enumerate(pending.tolist()):
            seqs[r].append(t)
        pending = runner.forward(cache, pending[:, None]).argmax(-1).cpu()
    for r, seq in enumerate(seqs):
        ref = _eager_column_sums(runner, seq)
        assert int(cache.rows.lengths[r]) == len(seq)
        for layer, expected in zip(cache.layers, ref):
            torch.testing.assert_close(layer.stats[r, :, : len(seq)], expected, rtol=1e-4, atol=1e-4)
            assert (layer.stats[r, :, len(seq):] == 0).all()


def test_stats_follow_kept_slots_and_rows():
    runner = tiny_runner("qwen2")
    ev = H2OEvictor(H2OEvictor.Params(budget=8, buffer=4, window=2))
    cache = runner.new_cache(ev, 2)
    pending = runner.prefill(cache, [list(range(5, 14)), list(range(20, 24))])  # 8 and 3 cached
    keep_calls = []
    orig = ev.select_layers

    def spy(*a, **kw):  # each layer's statistic as compaction read it, and its kept slots
        for layer, keep, read in orig(*a, **kw):
            keep_calls.append((read[3].clone(), keep))
            yield layer, keep, read

    ev.select_layers = spy
    for _ in range(4):  # row 0 reaches 12 = budget + buffer and is compacted
        pending = runner.forward(cache, pending[:, None]).argmax(-1).cpu()
    assert cache.rows.compactions.tolist() == [1, 0] and len(keep_calls) == len(cache.layers)
    for layer, (stats_in, keep) in zip(cache.layers, keep_calls):
        # the compacted row's statistic is the pre-compaction one gathered at the kept slots;
        # the freed slots start from zero again; the other row is untouched
        assert torch.equal(layer.stats[0, :, :8], stats_in[0].gather(1, keep[0]))
        assert (layer.stats[0, :, 8:] == 0).all()
        assert layer.stats[1, :, :7].gt(0).all() and (layer.stats[1, :, 7:] == 0).all()
    # forks and joins copy the statistic with the row
    fork = BudgetedCache.cat([cache.select([1]), cache.select([0, 0])])
    for a, b in zip(fork.layers, cache.layers):
        assert torch.equal(a.stats[0], b.stats[1]) and torch.equal(a.stats[1], b.stats[0])
        assert torch.equal(a.stats[2], b.stats[0])
