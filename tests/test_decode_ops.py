"""Operators per decode step of the hf engine, as a CPU proxy for GPU kernel launches
(issue 25): the decode forward dispatches the same aten operators however many proposals
(and rows) it carries, and a row pool's forks, growth and reuse keep decoding exact.

Counts come from a `TorchDispatchMode` (every aten call below autograd): deterministic on a
given torch build, unlike timings. bench/ops_per_step.py measures the same with the profiler.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvflow.testing import tiny_engine
from kvflow.testing.engine_contract import run_to_end

QUESTION = "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many?"


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _forward_ops(problems: int, evictor, n: int = 2) -> collections.Counter:
    """aten operators of the third decode forward of `problems` proposals of n candidates."""
    from kvflow.backends.hf.engine import HFRunner
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest

    engine = tiny_engine("qwen2", seed=1)
    engine.runner.eos_ids = set()
    # prompts of different lengths: rows of different lengths in one attention call
    states = engine.start([StartRequest(QUESTION + " x" * i, evictor, i) for i in range(problems)])
    spec = SamplingSpec(n, 0.7, 0.95, 8, "\x00\x01")
    engine.submit([ProposeRequest(s, "base", spec, i, 100) for i, s in enumerate(states)])
    counts = []
    original = HFRunner.decode_step

    def counted(self, parts, tokens):
        with _Count() as c:
            out = original(self, parts, tokens)
        counts.append(c.ops)
        return out

    HFRunner.decode_step = counted
    try:
        for _ in range(3):
            engine.step()
    finally:
        HFRunner.decode_step = original
    return counts[2]


def _evictors():
    from kvflow_builtin.evictors.none import NoEviction
    from kvflow_builtin.evictors.random import RandomEvictor
    from kvflow_builtin.evictors.rkv import RKVEvictor

    return {"none": NoEviction(NoEviction.Params()),
            "random": RandomEvictor(RandomEvictor.Params(budget=400, buffer=16)),
            "rkv": RKVEvictor(RKVEvictor.Params(budget=400, buffer=16, window=4))}  # a query window, no compaction


@pytest.mark.parametrize("kind", ["none", "random", "rkv"])
def test_decode_forward_ops_do_not_grow_with_proposals(kind):
    """2, 4 and 8 proposals (4, 8 and 16 rows of different lengths): the same operators, the
    same number of times (before row pools: ~18 more per proposal and layer)."""
    ev = _evictors()[kind]
    one, three, six = (_forward_ops(p, ev) for p in (2, 4, 8))
    assert one == three == six, (sum(one.values()), sum(three.values()), sum(six.values()))
    assert sum(v for k, v in one.items() if "scaled_dot_product" in k) == 2  # one attention call per layer


def test_one_attention_call_per_layer():
    """A decode step of 4 proposals of one evictor calls sdpa once per layer."""
    from kvflow.backends.hf.decode_batch import DecodeBatch

    calls = []
    original = DecodeBatch.attend

    def attend(self, attention, *args, **kwargs):
        def counted(*a, **k):
            calls.append(1)
            return attention(*a, **k)
        return original(self, counted, *args, **kwargs)

    DecodeBatch.attend = attend
    try:
        before = len(calls)
        _forward_ops(4, _evictors()["random"])
    finally:
        DecodeBatch.attend = original
    layers = 2  # tiny_engine's
    assert len(calls) - before == 3 * layers  # three steps


@pytest.mark.parametrize("kind", ["none", "rkv"])
def test_a_draining_pool_attends_over_its_live_rows_exactly(kind, monkeypatch):
    """A proposal decoded next to five that end after one token (their rows are handed back
    at once): from the second step its 2 rows are under a third of the pool's 12, so
    attention runs over copies of the live rows only. Its tokens equal those of the same batch
    attending over every row and those it gets alone, its logprobs within float noise (the
    attention's span differs: a GEMM over a longer, masked key axis rounds differently)."""
    from kvflow.backends.hf import decode_batch
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest

    ev = _evictors()[kind]
    gathered = []
    original = decode_batch._Part.__init__

    def init(self, *args):
        original(self, *args)
        gathered.append(self.gather is not None)

    monkeypatch.setattr(decode_batch._Part, "__init__", init)

    def decode(others: int):
        engine = tiny_engine("qwen2", seed=1)
        engine.runner.eos_ids = set()
        states = engine.start([StartRequest(QUESTION + " x" * i, ev, i) for i in range(others + 1)])
        main = ProposeRequest(states[0], "base", SamplingSpec(2, 0.7, 0.95, 10, "\x00\x01"), 0, 100)
        short = [ProposeRequest(s, "base", SamplingSpec(2, 0.7, 0.95, 1, "\x00\x01"), i + 1, 100)
                 for i, s in enumerate(states[1:])]
        engine.submit(short[:2] + [main] + short[2:])  # the main proposal's rows in the middle of the pool
        while engine.busy_rows():
            for p in engine.step():
                if p.request is main:
                    return [(c.token_ids, c.logprobs) for c in p.candidates]

    alone = decode(0)
    assert not any(gathered)
    together = decode(5)
    assert any(gathered)
    monkeypatch.setattr(decode_batch, "_GATHER_BELOW", 0.0)
    gathered.clear()
    every_row = decode(5)
    assert not any(gathered)
    for other in (every_row, alone):
        assert [ids for ids, _ in together] == [ids for ids, _ in other]
        for (_, a), (_, b) in zip(together, other):
            assert a == pytest.approx(b, abs=1e-5)


def test_a_pool_gives_back_rows_it_no_longer_uses():
    """Ten proposals (20 rows); nine end after one token and eight are released: at the next
    step the pool keeps only the 4 rows in use (the running proposal's and the one still
    held), renumbered; the running proposal decodes the tokens it gets alone, and the held
    one's handle still reads its own rows (adoption after the renumbering)."""
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest

    ev = _evictors()["random"]

    def decode(others: int):
        engine = tiny_engine("qwen2", seed=1)
        engine.runner.eos_ids = set()
        states = engine.start([StartRequest(QUESTION + " x" * i, ev, i) for i in range(others + 1)])
        main = ProposeRequest(states[0], "base", SamplingSpec(2, 0.0, 1.0, 10, "\x00\x01"), 0, 100)
        short = [ProposeRequest(s, "base", SamplingSpec(2, 0.0, 1.0, 1, "\x00\x01"), i + 1, 100)
                 for i, s in enumerate(states[1:])]
        engine.submit(short[:4] + [main] + short[4:])
        kept = None
        while engine.busy_rows():
            for p in engine.step():
                if p.request is main:
                    return engine, kept, [c.token_ids for c in p.candidates]
                if kept is None and p.request is short[-1]:
                    # held, like a proposal waiting to be scored (the others are dropped): what
                    # adopting its second row gives now
                    kept = p, p.handle.ids.tolist(), p.handle.select([1])
        raise AssertionError("main did not finish")

    _, _, alone = decode(0)
    engine, (kept, ids_before, before), together = decode(9)
    assert together == alone
    (pool,) = [p for _, p in engine.pools.values()]
    assert pool.cache.n_rows == 4  # shrunk from 20 to the rows in use
    assert max(kept.handle.ids.tolist()) < 4 < max(ids_before)  # renumbered
    after = kept.handle.select([1])  # the held proposal's second row, after renumbering
    assert int(after.rows.lengths[0]) == int(before.rows.lengths[0]) > 0
    assert int(after.rows.positions[0]) == int(before.rows.positions[0])
    for a, b in zip(after.layers, before.layers):
        n = int(before.rows.lengths[0])
        assert torch.equal(a.keys[:, :, :n], b.keys[:, :, :n]) and torch.equal(a.values[:, :, :n], b.values[:, :, :n])


def test_a_pool_whose_rows_were_all_given_back_shrinks_to_none_and_decodes_on():
    """Eight proposals (16 rows) end and are released together: the next step's shrink keeps
    no row (it used to fail in torch.cat on an empty list; admission by run.kv_memory met it
    when a helper's proposals all ended at once), and a proposal submitted then decodes as
    it does on a fresh engine."""
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest

    ev = _evictors()["random"]
    fresh = tiny_engine("qwen2", seed=1)
    engine = tiny_engine("qwen2", seed=1)
    for e in (fresh, engine):
        e.runner.eos_ids = set()
    states = engine.start([StartRequest(QUESTION + " x" * i, ev, i) for i in range(8)])
    ended = run_to_end(engine, [ProposeRequest(s, "base", SamplingSpec(2, 0.0, 1.0, 1, "\x00\x01"), i, 100)
                                for i, s in enumerate(states)])
    engine.release(states, ended)
    del ended
    (pool,) = [p for _, p in engine.pools.values()]
    assert pool.cache.n_rows == 16
    outs = []
    for e in (engine, fresh):
        (state,) = e.start([StartRequest(QUESTION, ev, 0)])
        (done,) = run_to_end(e, [ProposeRequest(state, "base", SamplingSpec(2, 0.0, 1.0, 6, "\x00\x01"), 0, 100)])
        outs.append([c.token_ids for c in done.candidates])
    assert pool.cache.n_rows == 2  # shrunk to none, then grown for the new proposal's rows
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kind", ["random", "none"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_idle_engine_decodes_as_a_new_one(kind, dtype):
    """After other proposals have come and gone (more rows, longer ones), an idle engine's pools
    hold no rows and no slots, as a new engine's, so a proposal decoded alone then gets the
    tokens it gets on a new engine: what a server answers does not depend on what it served
    before (issue 40; the rows in a forward change its float rounding)."""
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest

    ev = _evictors()[kind]
    spec = SamplingSpec(2, 1.0, 1.0, 12, "\x00\x01")

    def alone(engine):
        (state,) = engine.start([StartRequest(QUESTION, ev, 0)])
        (done,) = run_to_end(engine, [ProposeRequest(state, "base", spec, 7, 100)])
        engine.release([state], [done])
        return [c.token_ids for c in done.candidates]

    fresh = alone(tiny_engine("qwen2", seed=1, dtype=dtype))
    engine = tiny_engine("qwen2", seed=1, dtype=dtype)
    states = engine.start([StartRequest(QUESTION + " and more" * i, ev, i) for i in range(4)])
    done = run_to_end(engine, [ProposeRequest(s, "base", SamplingSpec(3, 1.0, 1.0, 20, "\x00\x01"), i, 100)
                               for i, s in enumerate(states)])
    engine.release(states, done)
    del done, states
    engine.step()  # idle: nothing to decode
    assert [p.cache.n_rows for _, p in engine.pools.values()] == [0]
    assert alone(engine) == fresh


@pytest.mark.parametrize("kind", ["random", "none"])
def test_released_states_free_their_caches_without_the_cyclic_gc(kind):
    """States and proposals released (then the engine idle) leave no KV cache alive: each is
    freed with its last reference, not left in a reference cycle for Python's cyclic GC, which
    runs its full collections rarely (a server's resident memory crept by tens of MiB between
    them, issue 40)."""
    import gc

    from kvflow.backends.hf.cache import BudgetedCache
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest

    ev = _evictors()[kind]
    engine = tiny_engine("qwen2", seed=1)
    gc.collect()
    gc.disable()
    # caches an earlier test in this process still holds (its engines) are not this test's
    before = {id(o) for o in gc.get_objects() if isinstance(o, BudgetedCache)}
    try:
        states = engine.start([StartRequest(QUESTION + " and more" * i, ev, i) for i in range(3)])
        done = run_to_end(engine, [ProposeRequest(s, "base", SamplingSpec(2, 1.0, 1.0, 12, "\x00\x01"), i, 100)
                                   for i, s in enumerate(states)])
        engine.release(states, done)
        del done, states
        engine.step()  # idle: its row pools emptied
        alive = [o for o in gc.get_objects() if isinstance(o, BudgetedCache) and o.n_rows and id(o) not in before]
        assert not alive, f"{len(alive)} caches with rows outlive their release"
    finally:
        gc.enable()


def test_cancel_stops_proposals_mid_step_and_the_others_decode_on():
    """`cancel` (the optional Engine method a server's gone requests use): a running proposal
    leaves the batch at once with its tokens so far (finish `cancelled`), a queued one never
    starts (no candidates), their rows are free, and the proposal left decodes the tokens it
    decodes alone."""
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest

    ev = _evictors()["none"]
    spec = SamplingSpec(2, 1.0, 1.0, 24, "\x00\x01")

    def requests(engine, k):
        states = engine.start([StartRequest(QUESTION + " and more" * i, ev, i) for i in range(k)])
        return [ProposeRequest(s, "base", spec, 10 + i, 100) for i, s in enumerate(states)]

    alone = tiny_engine("qwen2", seed=1)
    (kept_alone,) = run_to_end(alone, requests(alone, 1))
    engine = tiny_engine("qwen2", seed=1)
    kept, going, queued = requests(engine, 3)
    engine.submit([kept, going])
    for _ in range(5):
        assert not engine.step()
    engine.submit([queued])
    stopped = {id(p.request): p for p in engine.cancel([going, queued])}
    assert [c.finish for c in stopped[id(going)].candidates] == ["cancelled", "cancelled"]
    assert [c.n_tokens for c in stopped[id(going)].candidates] == [5, 5]
    assert stopped[id(queued)].candidates == [] and engine.busy_rows() == 2
    engine.release([going.state, queued.state], list(stopped.values()))
    ended = []
    while not ended:
        ended = engine.step()
    (done,) = ended
    assert done.request is kept and engine.busy_rows() == 0
    assert [c.token_ids for c in done.candidates] == [c.token_ids for c in kept_alone.candidates]
