"""Progress of a run (kvflow.runtime.progress, issue 35): the ETA, tokens/s and accuracy from a
fake clock; the rich bar only on a terminal and not under `--log`; the local executor's plain
line per finished problem carries the same figures."""

from __future__ import annotations

import io
import types

import pytest

from kvflow.runtime import progress as progress_mod
from kvflow.runtime.progress import Progress, Tally, clock_text


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _record(correct: bool, base: int = 100, helper: int = 20) -> dict:
    return {"correct": correct, "tokens_generated": {"base": base, "helper": helper}}


def test_eta_is_the_mean_pace_so_far_times_what_is_left():
    clock = FakeClock()
    tally = Tally(10, clock)
    assert tally.eta() is None and tally.status() == "acc -, - tok/s, ETA ?"  # nothing done yet
    clock.now += 30
    for correct in (True, False, True):
        tally.record(_record(correct))
    assert tally.eta() == pytest.approx(70.0)  # 10 s a problem, 7 left
    assert tally.tokens_per_s() == pytest.approx(360 / 30)
    assert tally.status() == "acc 2/3 (67%), 12 tok/s, ETA 1:10"
    clock.now += 50  # a slow stretch: the pace is the mean over the whole run
    tally.record(_record(False))
    assert tally.eta() == pytest.approx(80 / 4 * 6)
    clock.now += 3 * 3600
    for _ in range(6):
        tally.record(_record(True))
    assert tally.eta() == 0.0 and tally.status().endswith("ETA 0:00")


def test_clock_text():
    assert [clock_text(s) for s in (None, 0, 59.4, 65, 3723)] == ["?", "0:00", "0:59", "1:05", "1:02:03"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_is_drawn_on_a_terminal_with_the_figures():
    clock = FakeClock()
    out = Terminal()
    with Progress(4, enabled=True, clock=clock, stream=out) as bar:
        assert bar.live
        clock.now += 20
        bar.record(_record(True))
        bar.record(_record(False))
    text = out.getvalue()
    assert "2/4" in text and "acc 1/2 (50%)" in text and "ETA 0:20" in text and "tok/s" in text


def test_no_bar_off_a_terminal_when_quiet_or_under_log():
    assert not Progress(3, stream=io.StringIO()).live  # logs, CI
    assert not Progress(3, enabled=False, stream=Terminal()).live  # quiet
    progress_mod.plain_log(True)
    try:
        assert not Progress(3, stream=Terminal()).live  # kvflow run --log
    finally:
        progress_mod.plain_log(False)
    assert Progress(3, stream=Terminal()).live


def test_the_local_executor_logs_a_line_per_problem_with_accuracy_and_eta(tmp_path, monkeypatch, capsys):
    """kvflow.runtime.local.decode with a stand-in Session (no model): each finished problem is
    appended and logged with the tally's figures when stderr is not a terminal."""
    from kvflow.runtime import local, session
    from kvflow.results.files import ResultsDir, read_samples

    problems = [types.SimpleNamespace(id=f"p{i}", question="q", gold="1") for i in range(3)]

    class FakeSession:
        plan = types.SimpleNamespace(live_problems=2, batch_problems=1, kv_budget=None, max_live=lambda: 2)

        def __init__(self, loaded, registry, on_load=None) -> None:
            pass

        def check_kv_memory(self, problems) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def facts(self) -> dict:
            return {"threads": 1}


        def trajectory(self, p):
            return types.SimpleNamespace(problem_id=p.id, steps=[1, 2], committed_tokens=7)

        def decode(self, source, on_done, on_tick=None) -> None:
            for traj in source:
                on_done(traj)

        def record(self, traj) -> dict:
            return {"id": traj.problem_id, "correct": traj.problem_id != "p1", "seconds": 0.5,
                    "tokens_generated": {"base": 10}}

        def summary(self) -> dict:
            return {"occupancy": {}, "engine_stats": {}}

    monkeypatch.setattr(session, "Session", FakeSession)
    monkeypatch.setattr(local, "manifest", lambda loaded, registry: {"name": "t"})
    loaded = types.SimpleNamespace(resolved={"name": "t"}, pipeline=types.SimpleNamespace(
        models={}, run=types.SimpleNamespace(batch_problems=1)))
    store = ResultsDir(tmp_path / "run")
    local.decode(loaded, None, store, problems, quiet=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kvflow: [")]
    assert [r["id"] for r in read_samples(store.samples, validate=False)] == ["p0", "p1", "p2"]
    assert len(lines) == 3
    assert lines[1].startswith("kvflow: [2/3] p1: wrong, 2 steps, 7 tokens, 0.5 s; acc 1/2 (50%), ")
    assert all("tok/s, ETA " in line for line in lines) and lines[2].endswith("ETA 0:00")
