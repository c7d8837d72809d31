"""`kvflow run --sweep`: parsing, expansion, validation of every point first, skipping (no model runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.errors import UserError
from kvflow.tools.sweep import expand, load_points, parse_sweeps, short_names, split_values, with_file_axes

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
    from kvflow.results.files import ResultsDir

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


def _sweep_file(tmp_path, body: str) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(f"include: {QUICK}\nname: grid\n{body}", encoding="utf-8")
    return path


def test_a_pipelines_sweep_mapping_runs_as_its_grid(tmp_path, cli, monkeypatch):
    calls: list = []
    _fake_runner(monkeypatch, calls)
    out = tmp_path / "out"
    path = _sweep_file(tmp_path, "sweep:\n  proposers.base.evictor.budget: [32, 64]\n"
                                 "  proposers.base.evictor.kind: [none, snapkv, knorm]\n")
    res = cli("run", path, "--set", f"run.output={out}")
    assert res.exit_code == 0, res.output
    # full KV ignores the budget axis: it runs once, at the first budget's place
    assert "sweep: 5 point(s)" in res.stderr and len(calls) == 5 and len({c[0] for c in calls}) == 5
    assert "kind=none" in res.stdout and "budget=64 kind=knorm" in res.stdout
    # the grid is not part of a point's configuration: a plain run of one point finds its directory
    from kvflow.config.validate import load_pipeline

    one = load_pipeline(path, sets=[f"run.output={out}", "proposers.base.evictor.kind=knorm",
                                    "proposers.base.evictor.budget=64", "sweep={}"])
    assert any(d.name.endswith(one.hash) for d in out.iterdir())
    # a --sweep on the same path replaces the file's axis
    res = cli("run", path, "--set", f"run.output={out}", "--sweep", "proposers.base.evictor.kind=snapkv")
    assert res.exit_code == 0 and "sweep: 2 point(s)" in res.stderr and len(calls) == 5  # both complete
    res = cli("run", path, "--set", f"run.output={out}", "--sweep", "proposers.base.evictor.budget=16")
    assert res.exit_code == 0 and "sweep: 3 point(s)" in res.stderr and len(calls) == 7  # none: complete


def test_a_bad_sweep_mapping_is_a_user_error(tmp_path, cli, monkeypatch):
    calls: list = []
    _fake_runner(monkeypatch, calls)
    path = _sweep_file(tmp_path, "sweep:\n  proposers.base.evictor.kind: [snapkv, nosuchevictor]\n")
    res = cli("run", path, "--set", f"run.output={tmp_path / 'out'}")
    assert res.exit_code == 2 and calls == [] and "nosuchevictor" in res.stderr and "Traceback" not in res.output
    path = _sweep_file(tmp_path, "sweep:\n  proposers.base.evictor.kind: []\n")
    res = cli("run", path, "--set", f"run.output={tmp_path / 'out'}")
    assert res.exit_code == 2 and "has no values" in res.stderr and calls == []


def test_the_leaderboard_sweep_runs_every_builtin_evictor_and_full_kv():
    import yaml

    from kvflow.registry import get_registry

    path = REPO / "pipelines" / "leaderboard" / "gsm8k_cpu.yaml"
    grid = yaml.safe_load(path.read_text())["sweep"]
    kinds = grid["proposers.base.evictor.kind"]
    reg = get_registry()
    builtin = {n for n in reg.names("evictors") if reg.info("evictors", n).plugin == "builtin"}
    assert set(kinds) == builtin and kinds[0] == "none" and len(grid["proposers.base.evictor.budget"]) >= 2
    points = load_points(path, with_file_axes(path, []))
    assert len(points) == (len(kinds) - 1) * len(grid["proposers.base.evictor.budget"]) + 1
