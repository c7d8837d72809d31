"""`kvflow run --sweep`: parsing, expansion, validation of every point first, skipping (no model runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.errors import UserError
from kvflow.sweep import expand, load_points, parse_sweeps, short_names, split_values

REPO = Path(__file__).resolve().parents[1]
QUICK = REPO / "pipelines" / "quickstart.yaml"


def test_split_values_respects_brackets_and_quotes():
    assert split_values("64,128, 256") == ["64", "128", "256"]
    assert split_values("[],[{kind: gzip, threshold: 0.3}]") == ["[]", "[{kind: gzip, threshold: 0.3}]"]
    assert split_values("'a,b',c") == ["'a,b'", "c"]


def test_parse_and_expand_cross_product():
    axes = parse_sweeps(["proposers.base.evictor.budget=64,128", "proposers.base.n=1,2,4"])
    assert [a.values for a in axes] == [("64", "128"), ("1", "2", "4")]
    points = expand(axes)
    assert len(points) == 6
    assert [p.label for p in points[:3]] == ["budget=64 n=1", "budget=64 n=2", "budget=64 n=4"]  # first axis slowest
    assert points[-1].sets == ["proposers.base.evictor.budget=128", "proposers.base.n=4"]
    assert short_names(["proposers.base.n", "proposers.helper.n", "run.seed"]) == ("base.n", "helper.n", "seed")


def test_parse_errors_all_at_once():
    with pytest.raises(UserError) as e:
        parse_sweeps(["nobudget", "a.b=1,,2", "c=1,1", "d.e=1", "d.e=2", "x..y=1"])
    text = e.value.format()
    for needle in ("expected PATH=VALUE1,VALUE2", "empty value", "repeated value", "swept twice", "malformed path"):
        assert needle in text, needle
    assert len(e.value.problems) == 5


def test_every_point_is_validated_before_running(tmp_path):
    axes = parse_sweeps(["proposers.base.evictor.budget=64,-1,oops", "proposers.base.n=1,0"])
    with pytest.raises(UserError) as e:
        load_points(QUICK, axes, sets=[f"run.output={tmp_path}"])
    text = e.value.format()
    assert "proposers.base.evictor.budget" in text and "proposers.base.n" in text
    assert "sweep points budget=-1 n=1; budget=-1 n=0" in text  # names the points a problem occurs in
    assert "budget=64 n=0" in text


def test_points_have_their_own_results_dirs(tmp_path):
    axes = parse_sweeps(["proposers.base.evictor.budget=64,128", "run.seed=0,1"])
    points = load_points(QUICK, axes, sets=[f"run.output={tmp_path}"])
    hashes = {p.loaded.hash for p in points}
    assert len(hashes) == 4
    assert points[1].loaded.pipeline.run.seed == 1 and points[2].loaded.resolved["proposers"]["base"]["evictor"]["budget"] == 128
    with pytest.raises(UserError, match="give the same pipeline"):
        load_points(QUICK, parse_sweeps(["run.seed=1,01"]), sets=[f"run.output={tmp_path}"])


def _fake_runner(monkeypatch, calls):
    """run_pipeline that writes a complete results directory without loading any model."""
    from kvflow.runtime import runner
    from kvflow.runtime.results import ResultsDir

    def fake_run(loaded, *, force=False, registry=None, quiet=False):
        calls.append((loaded.hash, force, quiet))
        store = ResultsDir(runner.results_path(loaded))
        store.prepare(loaded.resolved, {"dataset": loaded.pipeline.dataset.model_dump()})
        n = len(runner.load_dataset(loaded))
        store.write_metrics({"n_problems": n, "accuracy": 0.5, "n_correct": n // 2})
        return 0

    monkeypatch.setattr(runner, "run_pipeline", fake_run)


def test_cli_sweep_runs_each_point_once_and_skips_complete(tmp_path, cli, monkeypatch):
    calls: list = []
    _fake_runner(monkeypatch, calls)
    args = ["run", QUICK, "--set", f"run.output={tmp_path}", "--sweep", "proposers.base.evictor.budget=32,64",
            "--sweep", "proposers.base.n=1,2"]
    res = cli(*args)
    assert res.exit_code == 0, res.output
    assert len(calls) == 4 and len({c[0] for c in calls}) == 4 and all(c[2] for c in calls)  # quiet
    dirs = sorted(p.name for p in tmp_path.iterdir())
    assert len(dirs) == 4 and all(d.startswith("quickstart__") for d in dirs)
    assert "sweep: 4 point(s)" in res.stderr and "budget=64 n=2" in res.stdout
    res = cli(*args)  # all complete now
    assert res.exit_code == 0 and len(calls) == 4 and res.stderr.count("skipped (complete)") == 4
    res = cli(*args, "--force")
    assert res.exit_code == 0 and len(calls) == 8 and all(c[1] for c in calls[4:])


def test_cli_sweep_invalid_point_runs_nothing(tmp_path, cli, monkeypatch):
    calls: list = []
    _fake_runner(monkeypatch, calls)
    res = cli("run", QUICK, "--set", f"run.output={tmp_path}", "--sweep", "proposers.base.n=2,0")
    assert res.exit_code == 2 and calls == [] and not any(tmp_path.iterdir())
    assert "proposers.base.n" in res.stderr and "Traceback" not in res.output


def test_cli_sweep_interrupt_exits_130(tmp_path, cli, monkeypatch):
    from kvflow.runtime import runner

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_pipeline", interrupted)
    res = cli("run", QUICK, "--set", f"run.output={tmp_path}", "--sweep", "run.seed=0,1")
    assert res.exit_code == 130 and "interrupted" in res.stderr
