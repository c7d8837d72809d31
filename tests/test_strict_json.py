"""Strict JSON (kvflow.jsonfile): what kvflow writes parses with a strict parser (no NaN, no
Infinity: a browser's JSON.parse, jq), files written before still read, and the committed
results under docs/results/ were migrated without changing what they mean."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from kvflow import jsonfile
from kvflow.results.files import ResultsDir, compute_metrics, read_json_object, read_samples

RESULTS = REPO / "docs" / "results"


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _results_files() -> list[Path]:
    return sorted(p for name in ("samples.jsonl", "metrics.json", "manifest.json") for p in RESULTS.rglob(name))


def test_every_committed_results_file_is_strict_json():
    files = _results_files()
    assert len(files) > 50  # the reproduction, allocations and breadthkv runs
    for path in files:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            for i, line in enumerate(text.splitlines(), 1):
                try:
                    _strict(line)
                except ValueError as e:
                    pytest.fail(f"{path}:{i}: {e}")
        else:
            try:
                _strict(text)
            except ValueError as e:
                pytest.fail(f"{path}: {e}")


def test_dumps_writes_null_for_non_finite_numbers_and_loads_reads_old_files():
    value = {"a": math.nan, "b": [1.0, math.inf, -math.inf, {"c": math.nan}], "d": "NaN", "e": (1, 2.5)}
    text = jsonfile.dumps(value)
    assert _strict(text) == {"a": None, "b": [1.0, None, None, {"c": None}], "d": "NaN", "e": [1, 2.5]}
    old = json.dumps(value)  # what kvflow wrote before: NaN, Infinity
    assert "NaN" in old and jsonfile.loads(old) == _strict(text)
    with pytest.raises(jsonfile.NonStrictJSON, match="NaN"):
        jsonfile.loads_strict(old)


def test_a_results_directory_is_written_strict_and_old_records_still_read(tmp_path):
    store = ResultsDir(tmp_path / "run")
    store.prepare({"name": "x"}, {"score": math.nan})
    record = {"id": "p0", "correct": True, "steps": [{"text": "s", "source": "base", "score": math.nan}],
              "step_counts": {"base": 1}, "output_tokens": 1, "tokens_generated": {"base": 1}, "candidates": {"base": 1},
              "pruned": {}, "finish": "eos", "degenerate": False, "seconds": 0.5,
              "signals": [{"step": 0, "source": "base", "index": 0, "finish": "eos",
                           "signals": {"entropy": [math.nan, 0.5, math.inf]}}]}
    store.append(record)
    store.write_metrics({"recovery": math.nan, "accuracy": 1.0})
    for name in ("manifest.json", "metrics.json"):
        _strict((store.path / name).read_text())
    (line,) = store.samples.read_text().splitlines()
    assert _strict(line)["signals"][0]["signals"]["entropy"] == [None, 0.5, None]
    assert store.load()[0]["steps"][0]["score"] is None

    # a file written before strict JSON (NaN in it) reads, with None where the NaN was
    old = tmp_path / "old"
    old.mkdir()
    (old / "samples.jsonl").write_text(json.dumps(record) + "\n")
    (old / "metrics.json").write_text(json.dumps({"recovery": math.nan}))
    assert read_samples(old / "samples.jsonl")[0]["signals"][0]["signals"]["entropy"] == [None, 0.5, None]
    assert read_json_object(old / "metrics.json", "metrics") == {"recovery": None}


MIGRATED = ["repro/gsm8k/cpu_kv_rescue__64afb68c", "repro/gsm8k/cpu_early_exit_only__816efd10",
            "repro/calib/cpu_kv_rescue__e7bf3366"]


@pytest.mark.parametrize("run", MIGRATED)
def test_migrated_runs_keep_their_metrics_hash_and_resume(run, tmp_path):
    """The committed runs whose signals held NaN (now null): metrics recomputed from the
    records equal their metrics.json, the configuration still hashes to the directory's name
    (a resume finds the same directory), and a resume's load keeps every record."""
    from kvflow.config.validate import config_hash
    from kvflow.results.signals import pruner_owners

    path = RESULTS / run
    config = yaml.safe_load((path / "config.resolved.yaml").read_text())
    assert path.name.endswith("__" + config_hash(config))
    records = read_samples(path / "samples.jsonl")
    assert any(None in trace for r in records for c in r.get("signals", []) for trace in c["signals"].values())
    metrics = json.loads((path / "metrics.json").read_text())
    again = compute_metrics(records, list(config["proposers"]), pruner_owners(config))
    for key in ("n_problems", "accuracy", "n_correct", "mean_steps", "mean_output_tokens", "tokens_generated",
                "step_share", "pruned_fraction", "early_exit_fraction", "degeneration_rate", "finish"):
        assert again[key] == metrics[key], key
    copy = tmp_path / path.name
    shutil.copytree(path, copy)
    assert [r["id"] for r in ResultsDir(copy).load()] == [r["id"] for r in records]
    assert (copy / "samples.jsonl").read_bytes() == (path / "samples.jsonl").read_bytes()  # nothing to repair


def test_calibrate_reads_migrated_signals(tmp_path):
    """`kvflow calibrate` over a migrated run (null before warm-up) proposes what it committed."""
    from kvflow.tools.calibrate import calibrate

    path = RESULTS / "repro/calib/cpu_kv_rescue__e7bf3366"
    reports, _ = calibrate(path, out=tmp_path, plots=False)
    committed = {r["name"]: r for r in json.loads((path / "calibrate" / "calibrate.json").read_text())}
    for r in reports:
        assert r.threshold == pytest.approx(committed[r.name]["threshold"]) if r.threshold is not None else \
            committed[r.name]["threshold"] is None
    _strict((tmp_path / "calibrate.json").read_text())
