"""kvflow's SGLang hooks under (a proxy for) CUDA-graph replay.

A replayed decode graph runs the kernels its capture launched, on its static buffers, and none
of the Python that launched them; SGLang captures at engine start, with no kvflow request in
the batch. `kvflow.backends.sglang.in_worker.replay.ReplayProxy` does the same on a CPU (trace once per
batch-size bucket with kvflow's Python state as at capture, replay the trace afterwards); the
SGLang tests run every engine under it (`KVFLOW_SGLANG_REPLAY_PROXY=1`, set in conftest). Here:

- the proxy's own guarantees, without SGLang: a hook that decides in Python which rows are
  kvflow's is replayed stale; a hook that is a pure function of tensors (`graph.decode_step`)
  gives, replayed on new table contents, what it gives eagerly;
- on the session's engine: the capturable hooks were captured and replayed, and decode hf's
  greedy tokens with every kind of per-token state (query window, H2O statistic, per-head
  holes), ending with hf's statistic and query window;
- today's per-row hooks (`KVFLOW_SGLANG_HOOKS=eager`) under the proxy stop the engine with the
  tripwire (what a GPU replaying graphs with them would have done silently wrong).
"""

from __future__ import annotations

import pytest
import torch

from conftest import require_sglang


def test_the_proxy_replays_a_hooks_python_decisions_as_they_were_at_capture():
    from kvflow.backends.sglang.in_worker.replay import ReplayProxy

    rows: list = []  # Python state: empty at capture, as SGLang's capture batch has no kvflow rows
    seen = torch.zeros(8, dtype=torch.int64)

    def per_row(q, out, rpi, seq_lens):
        for r in rows:
            seen[r] += 1
        return out

    proxy = ReplayProxy()
    q, out = torch.zeros(3, 4), torch.zeros(3, 4)
    rpi, lens = torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7])
    proxy.run(0, per_row, q, out, rpi, lens, _nothing)  # capture (bucket 4) and replay
    rows[:] = [1, 2]
    proxy.run(0, per_row, q, out, rpi, lens, _nothing)
    assert proxy.captures == 1 and proxy.replays == 2
    assert seen.sum() == 0  # the replay ran none of it
    per_row(q, out, rpi, lens)
    assert seen.sum() == 2  # eagerly it would have


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def _tables(layers=2, q_heads=4, kv_heads=2, d=8, pool=64, slots=6, ctx=40):
    from kvflow.backends.sglang.in_worker import graph

    req_to_token = torch.zeros(slots, ctx, dtype=torch.int32)
    t = graph.Tables(req_to_token, layers, graph.Profile.general())
    for lid in range(layers):
        t.ensure(lid, q_heads, kv_heads, d, torch.float32)
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(pool, kv_heads, d, generator=g) for _ in range(layers)]
    v = [torch.randn(pool, kv_heads, d, generator=g) for _ in range(layers)]
    return t, req_to_token, k, v


def test_the_decode_step_replayed_on_new_tables_equals_it_run_eagerly():
    """Captured with no kvflow row (all-zero inputs), replayed on a batch of kvflow rows (one
    observing with a hole in one head, one plain) and a full-context row: the tables and the
    output equal an eager run on a copy of the same state."""
    import copy

    from kvflow.backends.sglang.in_worker.graph import decode_step
    from kvflow.backends.sglang.in_worker.replay import ReplayProxy

    layers, q_heads, kv_heads, d = 2, 4, 2, 8
    t, req_to_token, k, v = _tables(layers, q_heads, kv_heads, d)
    proxy = ReplayProxy()

    def step(tables, lid):
        shapes = dict(lid=lid, scaling=d ** -0.5, q_heads=q_heads, kv_heads=kv_heads, head_dim=d, v_dim=d)
        return lambda q, out, rpi, lens: decode_step(tables, q, out, k[lid], v[lid], req_to_token, rpi, lens, **shapes)

    g = torch.Generator().manual_seed(1)
    q, out = torch.randn(3, q_heads * d, generator=g), torch.randn(3, q_heads * d, generator=g)
    rpi = torch.tensor([1, 2, 3])
    for lid in range(layers):  # capture, as SGLang does at engine start: no kvflow row yet
        proxy.run(lid, step(t, lid), q, out, rpi, torch.tensor([1, 1, 1]), _nothing)
    # now the host admits two kvflow requests (pool slots 1 and 3) and a plain one sits in slot 2
    req_to_token[1:4, :20] = torch.arange(1, 61, dtype=torch.int32).view(3, 20)
    a, b = t.assign(observing=True), t.assign(observing=False)
    t.row_of[1], t.row_of[3] = a, b
    t.set_holes(a, torch.tensor([[3, 5], [5, 5]]), 5)  # layer 0, head 0: slots [3, 5) evicted
    lens = torch.tensor([12, 20, 9])
    eager = copy.deepcopy(t)
    for lid in range(layers):
        got = proxy.run(lid, step(t, lid), q, out, rpi, lens, _nothing)
        want = step(eager, lid)(q, out, rpi, lens)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert proxy.captures == layers
    for name in ("seen", "tokens"):
        assert torch.equal(getattr(t, name), getattr(eager, name)), name
    assert t.seen[a] == layers and t.seen[b] == layers and t.tokens[a] == 1
    for lid in range(layers):
        assert torch.equal(t.stats[lid][1:], eager.stats[lid][1:]) and torch.equal(t.queries[lid][1:],
                                                                                   eager.queries[lid][1:])
        assert t.stats[lid][a, :, :12].sum() > 0 and t.stats[lid][b].abs().sum() == 0  # only the observing row
    assert t.stats[0][a, 0, 3:5].abs().sum() == 0 and t.stats[0][a, 1, 3:5].sum() > 0  # the hole: no attention
    # the hole changed row a's output in layer 0 only; row b and the plain row kept the backend's
    got = proxy.run(0, step(t, 0), q, out, rpi, lens, _nothing)
    assert not torch.equal(got[0], out[0]) and torch.equal(got[1:], out[1:])


def test_the_capturable_hooks_were_replayed_and_keep_hfs_tokens_and_state(sglang_engine, hf_engine, tmp_path):
    """Under the proxy (conftest), the session's engine replays kvflow's captured decode hook;
    an evicted request with H2O's statistic, a query window (SnapKV) or per-head holes (Ada-KV)
    decodes hf's greedy tokens, and ends with hf's state: the statistic and the query window
    themselves, not only what they selected (H2O keeps the same tokens on this tiny random
    model with or without decode-time statistics). All evictors: the contract's engine axis."""
    from kvflow.registry import get_registry
    from kvflow.testing.engine_parity import greedy_steps

    for kind in ("h2o", "snapkv", "ada-snapkv"):
        cls = get_registry().get("evictors", kind)
        ev = cls(cls.Params(budget=16, buffer=8, window=4))
        sglang_engine.dump_dir = str(tmp_path)
        try:
            got, state = greedy_steps(sglang_engine, ev)
        finally:
            sglang_engine.dump_dir = None
        want, hf_state = greedy_steps(hf_engine, ev)
        assert [[(i, f) for i, f, _ in s] for s in got] == [[(i, f) for i, f, _ in s] for s in want], kind
        snap = torch.load(tmp_path / f"{state.snap}.pt")
        cache = hf_state.cache
        assert snap["compactions"] == int(cache.rows.compactions[0]) >= 3, kind
        n = snap["keys"].shape[2]
        for layer, hf_layer in enumerate(cache.layers):
            if kind == "h2o":  # no holes: slot j of each head is the hf cache's slot j
                torch.testing.assert_close(snap["stats"][layer], hf_layer.stats[0, :, :n], rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"H2O statistic, layer {layer}: {m}")
            if kind == "snapkv":
                torch.testing.assert_close(snap["queries"][layer], hf_layer.queries[0], rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"query window, layer {layer}: {m}")
        sglang_engine.release([state])
    state = sglang_engine.server_state()
    assert state["hooks"] == "graph"
    assert state["replay_proxy"]["captures"] > 0 and state["replay_proxy"]["replays"] > 100, state["replay_proxy"]
    # the candidates' bucket was replayed many times with the host rewriting the tables between
    # replays: admissions (three evictors' requests), compactions, rows released and reused
    by_bucket = state["replay_proxy"]["replays_by_bucket"]
    assert max(by_bucket.values()) >= 10 and state["compactions"] >= 3, state


def test_the_proxy_buckets_are_sglangs_own_capture_sizes():
    """SGLang 0.5.23 captures 12 and 272..512 by 16 too (a 72B at tp 4 resolves max_bs 512):
    a batch of 12 or of 300 rows is replayed at its own bucket, not run eagerly."""
    from kvflow.backends.sglang.in_worker.replay import BUCKETS, bucket

    assert 12 in BUCKETS and bucket(9) == 12 and bucket(300) == 304 and bucket(512) == 512 and bucket(513) is None


def test_todays_per_row_hooks_under_the_replay_proxy_stop_the_engine(shared_tiny_qwen, monkeypatch):
    """The old hooks (Python per evicted row, reading which rows are kvflow's from Python
    state) captured with no kvflow row and replayed: none of their work runs, and the tripwire
    stops the engine at the first decode forward (on a GPU with graphs they would have
    compacted with stale query windows, silently)."""
    require_sglang()
    from kvflow.backends.sglang import SGLangBackend
    from kvflow.config.schema import ModelConfig
    from kvflow.registry import get_registry
    from kvflow.testing.engine_parity import greedy_steps

    monkeypatch.setenv("KVFLOW_SGLANG_HOOKS", "eager")
    monkeypatch.setenv("KVFLOW_SGLANG_REPLAY_PROXY", "1")
    # an engine of its own (a pool size that changes no token): the session's keeps its hooks
    engine = SGLangBackend.load(ModelConfig(backend="sglang", id=str(shared_tiny_qwen), dtype="float32",
                                            device="cpu", engine={"max_total_tokens": 60001}))
    try:
        cls = get_registry().get("evictors", "snapkv")
        with pytest.raises(Exception, match="kvflow tripwire"):
            greedy_steps(engine, cls(cls.Params(budget=16, buffer=8, window=4)))
    finally:
        engine.worker.close()
