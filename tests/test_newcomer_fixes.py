"""Smaller things a newcomer hit (issue 34, 7), each pinned by a test that failed before."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO, run_kvflow

from kvflow.testing import tiny_pipeline


def test_validate_refuses_an_unknown_catalog_name_as_run_does(write, cli):
    """`kvflow validate` said ok to a catalog name that `kvflow run` then refused."""
    path = write("p.yaml", f"""
        include: {REPO / 'pipelines' / 'quickstart.yaml'}
        name: typo
        models:
          base: {{id: "catalog:smollm3-nope"}}
        """)
    result = cli("validate", path)
    assert result.exit_code == 2, result.output
    assert (f"{path}:4: models.base.id: unknown catalog model 'smollm3-nope'. "
            "Did you mean 'smollm2-135m-instruct'?") in result.stderr, result.stderr
    assert "Traceback" not in result.output


def test_runs_hint_names_a_pipeline_that_exists_from_the_current_directory(tmp_path):
    """The 'run a CPU pipeline instead' hint gave `pipelines/quickstart.yaml`, a path relative
    to the repository, also to a user running kvflow from anywhere else."""
    path = tiny_pipeline(tmp_path / "p", problems=1, model="kvflow-test/not-cached-anywhere")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_kvflow("run", str(path), cwd=elsewhere, env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr
    assert "is not available" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr
    (shown,) = set(re.findall(r"`kvflow run (\S+)`", proc.stderr))
    assert (elsewhere / shown).is_file(), shown  # an absolute path stays absolute under /
    assert Path(shown).is_absolute()
    inside = run_kvflow("run", str(path), cwd=REPO, env={"HF_HUB_OFFLINE": "1"})
    assert "`kvflow run pipelines/quickstart.yaml`" in inside.stderr  # from the checkout: relative


def test_report_does_not_compare_parameters_of_different_components_at_one_index():
    """`pruners[1].window` of a gzip pruner and of an n-gram pruner is not one field: the
    report named runs by it (`pruners[1].window=256` vs `64`) as if one setting had changed."""
    from kvflow.report.labels import differing_paths

    def config(second: dict, threshold: float = 2.5) -> dict:
        return {"proposers": {"base": {"pruners": [{"kind": "entropy", "threshold": threshold, "window": 32},
                                                   second]}}}

    gzip = {"kind": "gzip", "threshold": 0.25, "window": 256}
    ngram = {"kind": "ngram", "threshold": 4, "window": 64, "n": 3}
    assert differing_paths([config(gzip), config(ngram)]) == ["proposers.base.pruners[1].kind"]
    # the same component at that index: its parameters are compared as before
    assert differing_paths([config(gzip), config({**gzip, "window": 128}, threshold=3.0)]) == [
        "proposers.base.pruners[0].threshold", "proposers.base.pruners[1].window"]


# --------------------------------------------------------------------------- kvflow report's plots


def _figures(monkeypatch):
    """The figures the report's plots save, kept open for inspection."""
    from kvflow.report import plots

    saved = []
    real = plots._save

    def keep(fig, plt, path):
        saved.append(fig)
        out = real(fig, type("NoClose", (), {"close": staticmethod(lambda f: None)}), path)
        return out

    monkeypatch.setattr(plots, "_save", keep)
    return saved


def _long_runs(tmp_path):
    from test_report import make_run

    from kvflow.report import load_runs

    root = tmp_path / "r"
    for i, (ev, budget) in enumerate([("random", 32), ("random", 64), ("rkv", 32), ("rkv", 64), ("none", None)]):
        make_run(root, f"run_with_a_rather_long_descriptive_name_{i}", [False] * 4, evictor=ev, budget=budget)
    return load_runs([str(root / "*")])


def test_accuracy_plot_of_all_zero_accuracies_has_a_readable_axis_and_keeps_its_legend(tmp_path, monkeypatch):
    """All accuracies 0 drew a -0.04...0.04 % axis, and a legend of long names was cut at the
    image's edge."""
    import matplotlib.image

    from kvflow.report import plots

    saved = _figures(monkeypatch)
    runs = _long_runs(tmp_path)
    names = plots.series_names(runs)
    for r in runs:  # names as long as a real comparison's
        names.suffix[r.path] = ("scorer.model=helper, proposers.base.pruners[0].threshold=2.5, "
                                f"proposers.base.pruners[1].window=256, run.seed={r.name[-1]}")
    png = plots.accuracy_vs_budget(runs, tmp_path / "acc.png", names)
    (fig,) = saved
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    assert low == 0 and high >= 10, (low, high)
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    height, width = matplotlib.image.imread(png).shape[:2]
    assert legend.width <= width and legend.height <= height, (legend.width, legend.height, width, height)
    assert not legend.overlaps(ax.get_window_extent(renderer))  # beside the lines, not over them


def test_decode_cost_plot_keeps_its_bars_readable_with_long_names(tmp_path, monkeypatch):
    """Rotated run names under vertical bars took most of the figure's height: bars squashed."""
    from kvflow.report import plots

    saved = _figures(monkeypatch)
    runs = _long_runs(tmp_path)
    names = plots.series_names(runs)
    for r in runs:
        names.suffix[r.path] = "scorer.model=helper, proposers.base.pruners[0].threshold=2.5, limits.max_steps=48"
    plots.decode_cost(runs, tmp_path / "cost.png", names)
    (fig,) = saved
    renderer = fig.canvas.get_renderer()
    plot_area = fig.axes[0].get_window_extent(renderer)
    assert plot_area.height >= 0.5 * fig.bbox.height and plot_area.width >= 0.3 * fig.bbox.width, (
        plot_area, fig.bbox)


def test_series_names_shorten_the_paths_of_differing_fields():
    """Series names spelled every differing field's whole path: labels grew unreadably long."""
    from kvflow.report.labels import short_paths

    assert short_paths(["proposers.base.pruners[0].threshold", "scorer.model", "proposers.base.evictor.window",
                        "proposers.helper.evictor.window"]) == {
        "proposers.base.pruners[0].threshold": "pruners[0].threshold", "scorer.model": "scorer.model",
        "proposers.base.evictor.window": "base.evictor.window",
        "proposers.helper.evictor.window": "helper.evictor.window"}
