"""kvflow's part of vLLM's attention under (a proxy for) CUDA-graph replay (`in_worker/replay.py`).

On a GPU vLLM captures its decode forwards at engine start, with no kvflow request in the batch,
and replays them afterwards: whatever kvflow decides in Python inside the attention forward is
frozen as it was at capture. `KVFLOW_VLLM_REPLAY_PROXY=1` does the same on a CPU. Here:

- the proxy's own guarantee, without vLLM: a hook that decides in Python is replayed stale;
- the ring write (`blocks.InBlocks.write_ring`, the only kvflow op inside vLLM's forward for
  uniform budgets) replayed on new token maps gives what it gives eagerly, every bucket padded;
- H2O's statistic (`statistic.StatTable.accumulate`, the other kvflow op inside the forward)
  replayed on new entries gives H2O's own `observe()`, over both of vLLM's KV layouts;
- a vLLM engine under the proxy decodes R-KV's and H2O's greedy steps, log-probabilities, kept
  keys (and H2O's statistic) as `hf` does (the ring and the statistic replayed, never re-traced
  for a new batch), and refuses an evictor that observes attention with its own `observe()`
  (per-row Python would not run on a replay).
"""

from __future__ import annotations

import pytest
import torch

from conftest import require_vllm


def test_the_proxy_replays_a_hooks_python_decisions_as_they_were_at_capture():
    from kvflow.backends.vllm.in_worker.replay import ReplayProxy

    rows: list = []  # Python state: empty at capture, as vLLM's capture batches have no kvflow request
    seen = torch.zeros(8)

    def per_row(q):
        for r in rows:
            seen[r] += q[0, 0]
        return q * 2

    proxy = ReplayProxy()
    proxy.run(0, per_row, torch.ones(3, 4))  # traced (bucket 4)
    rows.append(2)
    out = proxy.run(0, per_row, torch.ones(3, 4))
    assert out[:3].eq(2).all() and seen.eq(0).all(), "the replay ran the hook's Python again"
    assert (proxy.captures, proxy.replays) == (1, 2)
    per_row(torch.ones(3, 4))  # eagerly, the same hook does its Python work: the contrast
    assert seen[2] == 1


@pytest.mark.parametrize("tokens", [1, 3, 8, 13])
def test_the_ring_write_replayed_on_new_token_maps_equals_eager(tokens):
    from kvflow.backends.vllm.in_worker.blocks import InBlocks
    from kvflow.backends.vllm.in_worker.replay import ReplayProxy

    g = torch.Generator().manual_seed(tokens)
    q_heads, d, layers = 3, 4, 2

    def fresh():
        b = InBlocks(window=4, rows=5)
        b.ensure_tables(layers, q_heads, 1, d, torch.float32, torch.device("cpu"))
        return b

    eager, replayed = fresh(), fresh()
    replayed.proxy = ReplayProxy()
    replayed.table.fixed = True  # as `evict.Runtime` sets it under the proxy: the ring written at every forward
    for _ in range(3):  # new token maps each step, as `prepared` writes them between forwards
        place = torch.randperm(6 * 4, generator=g)[:tokens]  # one token per (row, position), as `prepared` maps
        rows, pos = place // 4, place % 4
        q = torch.randn(tokens, q_heads * d, generator=g)
        for b in (eager, replayed):
            b.tok_row.zero_()
            b.tok_row[:tokens], b.tok_pos[:tokens] = rows, pos
        for lid in range(layers):
            eager.write_ring(lid, q)
            replayed.attended(None, lid, q, layers)
    assert replayed.proxy.captures == layers and replayed.proxy.replays == 3 * layers
    for a, b in zip(eager.ring, replayed.ring):
        assert torch.equal(a[1:], b[1:])  # row 0 is the sink padded tokens write into


@pytest.mark.parametrize("layout", ["split", "cpu"])
def test_h2o_statistic_replayed_on_new_entries_is_h2o_s_observe(layout):
    """The table's op, traced once per layer and replayed on three steps' entries (rows, lengths,
    blocks rewritten in place between them, as `prepared` does), adds what H2O's own `observe()`
    adds over each row's slots."""
    from kvflow.backends.vllm.in_worker.blocks import Paged
    from kvflow.backends.vllm.in_worker.replay import ReplayProxy
    from kvflow.backends.vllm.in_worker.statistic import StatTable
    from kvflow.registry import get_registry

    g = torch.Generator().manual_seed(3)
    layers, kv_heads, q_heads, d, bs, blocks, rows, span = 2, 2, 4, 8, 4, 12, 5, 12
    caches = [torch.randn(blocks, kv_heads, bs, 2 * d, generator=g) for _ in range(layers)]
    maps = (torch.randperm(bs * d, generator=g).view(bs, d), torch.randperm(bs * d, generator=g).view(bs, d))
    paged = Paged(caches, layout, bs, maps if layout == "cpu" else None)
    cls = get_registry().get("evictors", "h2o")
    h2o = cls(cls.Params(budget=8, buffer=4, window=2))
    replayed, proxy = StatTable(rows, span), ReplayProxy()
    replayed.make(layers, kv_heads, torch.device("cpu"))
    replayed.fixed = True
    want = [torch.zeros(rows + 1, kv_heads, span) for _ in range(layers)]

    def keys_of(layer, held, n):
        j = torch.arange(n)
        k, _ = paged.read(layer, torch.tensor(held)[j // bs], j % bs)  # [Hkv, n, D]
        return k

    for step in range(3):
        tokens = 5 + step  # one bucket (8): traced once per layer
        q = torch.randn(tokens, q_heads * d, generator=g)
        entries = []
        for e, row in enumerate(torch.randperm(rows, generator=g)[: 2 + step].tolist()):
            held = torch.randperm(blocks, generator=g)[: span // bs].tolist()
            entries.append((e, row + 1, int(torch.randint(1, span + 1, (1,), generator=g)), held))
        replayed.fill(entries, bs)
        for layer in range(layers):
            proxy.run(("stat", layer), lambda x: replayed.accumulate(layer, x, paged, q_heads, d ** -0.5), q,
                      replayed.as_at_capture)
            for token, row, n, held in entries:
                h2o.observe(want[layer][row : row + 1, :, :n], q[token].view(1, q_heads, 1, d),
                            keys_of(layer, held, n)[None], torch.ones(1, 1, n, dtype=torch.bool), layer_idx=layer,
                            scaling=d ** -0.5)
    assert proxy.captures == layers and proxy.replays == 3 * layers
    for layer in range(layers):
        torch.testing.assert_close(replayed.stats[layer][1:], want[layer][1:], rtol=1e-6, atol=1e-6)


def test_a_vllm_engine_under_the_replay_proxy_decodes_as_hf_and_refuses_an_own_observe(monkeypatch):
    require_vllm()
    from kvflow.backends.vllm import VLLMBackend
    from kvflow.config.schema import ModelConfig
    from kvflow.errors import EngineError
    from kvflow.registry import get_registry
    from kvflow.testing.engine_parity import backend_model_dir, greedy_steps, load_engine
    from kvflow.testing.third_party import OwnObserveH2O

    monkeypatch.setenv("KVFLOW_VLLM_REPLAY_PROXY", "1")
    monkeypatch.setenv("KVFLOW_VLLM_EVICTED_ROWS", "8")  # the fixed-shape statistic reads every row
    engine = VLLMBackend.load(ModelConfig(backend="vllm", id=str(backend_model_dir("vllm")), dtype="float32",
                                          device="cpu", engine={"max_num_seqs": 7}))  # an engine of its own
    hf = load_engine("hf", backend_model_dir("vllm"))
    try:
        cls = get_registry().get("evictors", "rkv")
        rkv = cls(cls.Params(budget=16, buffer=8, window=4))
        (got, got_state), (want, want_state) = greedy_steps(engine, rkv), greedy_steps(hf, rkv)
        for step_got, step_want in zip(got, want, strict=True):
            for (tokens_a, _, lps_a), (tokens_b, _, lps_b) in zip(step_got, step_want, strict=True):
                assert tokens_a == tokens_b
                assert max(abs(a - b) for a, b in zip(lps_a, lps_b)) < 1e-4
        (keys_a, _, compactions_a), (keys_b, _, compactions_b) = engine.kept_kv(got_state), hf.kept_kv(want_state)
        assert compactions_a == compactions_b > 0
        assert max((x - y).abs().max().item() for la, lb in zip(keys_a, keys_b) for x, y in zip(la, lb)) < 1e-4
        engine.drain()
        assert engine.stats()["ring_replays"] > 0, "no ring write was replayed"
        cls = get_registry().get("evictors", "h2o")
        h2o = cls(cls.Params(budget=16, buffer=8, window=4))
        (got, got_state), (want, want_state) = greedy_steps(engine, h2o), greedy_steps(hf, h2o)
        assert [[c[0] for c in step] for step in got] == [[c[0] for c in step] for step in want]
        for a, b in zip(engine.kept_statistic(got_state), hf.kept_statistic(want_state), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        with pytest.raises(EngineError, match="observe"):
            greedy_steps(engine, OwnObserveH2O(OwnObserveH2O.Params(budget=16, buffer=8)))
    finally:
        engine.worker.close()
