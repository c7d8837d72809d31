"""Run names from the configuration diff (kvflow.report.labels): runs that differ in anything
but the budget are distinct series in `kvflow report`'s tables and plots, named by what differs."""

from __future__ import annotations

import csv
import io

from conftest import REPO
from kvflow.report import build_tables
from kvflow.report.labels import differing_paths, flatten, series_names, values_at
from kvflow.results.runs import load_run

GSM8K = REPO / "docs" / "results" / "repro" / "gsm8k"
#: round 2's two KV-Rescue runs: base-likelihood scorer (32.8%) and helper-likelihood (26.6%)
BASE_SCORER, HELPER_SCORER = "cpu_kv_rescue__64afb68c", "cpu_kv_rescue__3f1aec18"
ROUND2 = ["cpu_best_of_n__c01b256b", "cpu_best_of_n__f9cd6046", "cpu_best_of_n__666c3bfa",
          "cpu_early_exit_only__816efd10", "cpu_helper_only__04175628", BASE_SCORER, "cpu_interleave_only__31d9d959",
          HELPER_SCORER]


def test_flatten_and_diff():
    a = {"name": "a", "scorer": {"kind": "likelihood", "model": "base"},
         "proposers": {"base": {"pruners": [{"kind": "gzip", "threshold": 0.5}], "evictor": {"budget": 64}}},
         "run": {"output": "x", "threads": 1}}
    b = {"name": "b", "scorer": {"kind": "likelihood", "model": "helper"},
         "proposers": {"base": {"pruners": [{"kind": "gzip", "threshold": 0.4}], "evictor": {"budget": 64}}},
         "run": {"output": "y"}, "limits": {"max_steps": 3}}
    assert flatten(a)["proposers.base.pruners[0].threshold"] == 0.5
    # name, run.output and run.threads say nothing about what was computed: ignored
    assert differing_paths([a, b]) == ["scorer.model", "proposers.base.pruners[0].threshold", "limits.max_steps"]
    assert values_at(a, ["scorer.model", "limits.max_steps"]) == ["base", "–"]  # – = not set (the default)


def test_the_two_round2_kv_rescue_runs_are_two_series_named_by_scorer():
    runs = [load_run(GSM8K / name) for name in ROUND2]
    names = series_names(runs)
    by_dir = {r.path.name: r for r in runs}
    base, helper = by_dir[BASE_SCORER], by_dir[HELPER_SCORER]
    assert base.method == helper.method  # the fixed fields alone cannot tell them apart ...
    assert names.series(base) == "interleave + early exit / random, scorer.model=base"  # ... the diff does
    assert names.series(helper) == "interleave + early exit / random, scorer.model=helper"
    assert names.series(by_dir["cpu_interleave_only__31d9d959"]) == "interleave / random"  # alone: no suffix

    tables = {t.name: t for t in build_tables(runs)}
    acc = {row[0]: row[2] for row in tables["accuracy_vs_budget"].rows}
    assert acc[names.series(base)] == 21 / 64 and acc[names.series(helper)] == 17 / 64
    runs_table = tables["runs"]
    differs = {row[0]: row[runs_table.columns.index("differs by")] for row in runs_table.rows}
    assert differs[BASE_SCORER] == "scorer.model=base" and differs["cpu_best_of_n__c01b256b"] is None
    assert len({row[2] for row in tables["step_share"].rows}) == 3


def test_the_committed_round2_report_has_both_kv_rescue_rows():
    """docs/results/repro/gsm8k/report_round2 was regenerated with these labels."""
    rows = list(csv.DictReader(io.StringIO((GSM8K / "report_round2" / "accuracy_vs_budget.csv").read_text())))
    by_method = {r["method"]: float(r["B=64"]) for r in rows if r["B=64"]}
    assert by_method["interleave + early exit / random, scorer.model=base"] == 0.328125
    assert by_method["interleave + early exit / random, scorer.model=helper"] == 0.265625


def test_runs_equal_but_for_ignored_fields_stay_apart(tmp_path):
    """Two runs whose configurations differ only where labels look away (their name, the
    output directory) are still two points: named by directory."""
    import shutil

    import yaml

    a, b = tmp_path / "a__1", tmp_path / "b__2"
    shutil.copytree(GSM8K / BASE_SCORER, a)
    shutil.copytree(GSM8K / BASE_SCORER, b)
    config = yaml.safe_load((b / "config.resolved.yaml").read_text())
    config["name"], config["run"]["output"] = "other", "elsewhere"
    (b / "config.resolved.yaml").write_text(yaml.safe_dump(config))
    runs = [load_run(a), load_run(b)]
    names = series_names(runs)
    assert [names.of(r) for r in runs] == ["a__1", "b__2"]
