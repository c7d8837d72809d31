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
