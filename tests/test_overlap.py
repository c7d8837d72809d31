"""Engines that overlap (`run.overlap_engines`, kvflow.runtime.scheduler): two hf models step
on threads of their own at once, a streaming engine is read while they compute, and no
trajectory changes."""

from __future__ import annotations

import threading

import pytest

from kvflow.components.base import Trajectory
from kvflow.config import load_pipeline
from kvflow.registry import get_registry
from kvflow.runtime.compile import build_plan
from kvflow.runtime.scheduler import Occupancy, run
from kvflow.testing import tiny_pipeline

QUESTIONS = ["How many clips did Natalia sell?", "Natalia sold 48 clips in April. How many in May?",
             "What is 3 + 4?"]


def _plan(tmp_path, overlap: str):
    # base (tiny qwen2, random evictor) and helper (tiny llama): two hf engines, two models
    path = tiny_pipeline(tmp_path, problems=3, n=2, max_tokens=60, scorer={"kind": "random"},
                         evictor={"kind": "random", "budget": 16, "buffer": 8},
                         extra={"run": {"overlap_engines": overlap, "batch_problems": 2}, "limits": {"max_steps": 6}})
    plan, engines = build_plan(load_pipeline(path), get_registry())
    return plan, engines


def _trajectories():
    return [Trajectory(f"p{i}", q, f"Question: {q}\nAnswer:") for i, q in enumerate(QUESTIONS)]


def _decode(plan, timings=None):
    trajs, done, occupancy = _trajectories(), [], Occupancy()
    run(plan, trajs, done.append, timings=timings, occupancy=occupancy)
    assert len(done) == len(trajs)
    return [(t.problem_id, [(s.text, s.source, s.n_tokens) for s in t.steps], t.finish, t.tokens_generated,
             t.pruned) for t in trajs], occupancy


def _gate(plan, timeout=30.0):
    """Make every engine's first step wait until the other's has begun (a barrier of two): a
    scheduler that steps them one after another fails it (the first waits in vain)."""
    barrier = threading.Barrier(len(plan.engines()), timeout=timeout)
    threads = {}
    for engine in plan.engines():
        original = engine.step

        def step(max_rows=None, _original=original, _engine=engine, _first=[True]):
            threads.setdefault(id(_engine), set()).add(threading.get_ident())
            if _first[0]:
                _first[0] = False
                barrier.wait()
            return _original(max_rows)

        engine.step = step
    return threads


def test_overlapped_engines_step_at_once_and_change_no_trajectory(tmp_path):
    plan_off, _ = _plan(tmp_path / "off", "off")
    plan_on, _ = _plan(tmp_path / "on", "on")
    assert plan_on.overlap == "on" and len(plan_on.engines()) == 2
    threads = _gate(plan_on)
    timings: dict = {}
    got, occupancy = _decode(plan_on, timings)
    expected, occupancy_off = _decode(plan_off)
    assert got == expected
    # each model stepped on one thread of its own, neither the caller's
    main = threading.get_ident()
    assert all(len(t) == 1 and main not in t for t in threads.values())
    assert len({next(iter(t)) for t in threads.values()}) == 2
    assert occupancy.forwards == occupancy_off.forwards and occupancy.rows == occupancy_off.rows
    summary = occupancy.summary()
    assert all(s.get("overlapped_steps", 0) > 0 for s in summary.values()), summary
    assert "overlapped_steps" not in str(occupancy_off.summary())
    # a round of both models is one forward phase naming both; the phases still sum to wall
    phases = timings["p0"]["phases"]
    assert "propose/forward:base+helper" in phases, phases
    assert abs(sum(phases.values()) - timings["p0"]["wall"]) < 1e-3


def test_without_overlap_the_gate_fails(tmp_path):
    """The control: stepped one after another, the first engine waits at the barrier in vain."""
    plan, _ = _plan(tmp_path, "off")
    _gate(plan, timeout=1.0)
    with pytest.raises(threading.BrokenBarrierError):
        _decode(plan)


def test_auto_overlaps_streaming_engines_and_distinct_gpus_only(tmp_path):
    plan, _ = _plan(tmp_path, "auto")
    overlap = _overlap_of(plan)
    a, b = plan.engines()
    assert not overlap.wanted([a, b])  # two models on this CPU: they would share its cores
    assert not overlap.wanted([a])
    b.streams = True
    try:
        assert overlap.wanted([a, b])  # read SGLang's stream while hf computes
    finally:
        del b.streams
    devices = (a.device, b.device)
    try:
        a.device, b.device = "cuda:0", "cuda:1"
        assert overlap.wanted([a, b])
        b.device = "cuda:0"
        assert not overlap.wanted([a, b])  # one GPU: no second device to compute on
    finally:
        a.device, b.device = devices


def test_an_engine_failing_on_its_thread_fails_the_run(tmp_path):
    plan, _ = _plan(tmp_path, "on")
    engine = plan.engines()[1]

    def broken(max_rows=None):
        raise RuntimeError("helper forward failed")

    engine.step = broken
    with pytest.raises(RuntimeError, match="helper forward failed"):
        _decode(plan)


def _overlap_of(plan):
    from kvflow.runtime.overlap import Overlap
    from kvflow.runtime.scheduler import _step

    return Overlap(plan, None, {id(e): str(i) for i, e in enumerate(plan.engines())}, _step)
