"""`kvflow calibrate` on synthetic signal traces: the valley rule, per-candidate statistics,
outputs (table, JSON, PNGs) and errors."""

from __future__ import annotations

import json
import math
import random

import pytest
import yaml

from kvflow.tools.calibrate import analyse, calibrate, configured_thresholds, kind_of, valley_threshold
from kvflow.errors import UserError
from kvflow.results.files import ResultsDir

RESOLVED = {"proposers": {"base": {"pruners": [{"kind": "entropy", "threshold": 2.5}, {"kind": "gzip", "threshold": 0.25},
                                                {"kind": "gzip", "threshold": 0.1}]},
                          "helper": {"model": "m"}}}


def synthetic_records(seed=0, n_problems=12, per_step=8):
    """Candidates of two kinds: healthy (entropy around 1.0, compression ratio around 0.6) and
    degenerate (entropy around 4.0, or a loop with ratio around 0.15), with per-token traces."""
    rng = random.Random(seed)
    records = []
    for p in range(n_problems):
        signals = []
        for k in range(per_step):
            kind = rng.choice(["ok", "ok", "ok", "incoherent", "loop"])
            ent_peak = rng.gauss(4.0 if kind == "incoherent" else 1.0, 0.3)
            ratio_low = rng.gauss(0.15 if kind == "loop" else 0.6, 0.04)
            n = rng.randint(40, 80)
            warm = 31
            ent = [math.nan] * warm + [ent_peak * (0.8 + 0.2 * i / (n - warm)) for i in range(n - warm)]
            ratio = [math.nan] * warm + [ratio_low + 0.2 * (1 - i / (n - warm)) for i in range(n - warm)]
            finish = {"ok": "delimiter", "incoherent": "pruned:entropy", "loop": "pruned:gzip"}[kind]
            signals.append({"step": 0, "source": "base", "index": k, "finish": finish,
                            "signals": {"entropy": ent, "gzip": ratio, "gzip_2": ratio}})
        signals.append({"step": 1, "source": "base", "index": 0, "finish": "eos",  # ended before warm-up
                        "signals": {"entropy": [math.nan] * 5, "gzip": [math.nan] * 5, "gzip_2": [math.nan] * 5}})
        records.append({"id": f"p{p}", "signals": signals})
    return records


def write_run(path, records, resolved=RESOLVED):
    d = ResultsDir(path)
    path.mkdir(parents=True)
    for r in records:
        d.append(r)
    (path / "config.resolved.yaml").write_text(yaml.safe_dump(resolved))
    return path


def test_valley_between_two_modes():
    rng = random.Random(1)
    values = [rng.gauss(1.0, 0.2) for _ in range(300)] + [rng.gauss(4.0, 0.3) for _ in range(60)]
    threshold, (main, second) = valley_threshold(values, bins=40)
    assert 1.8 < threshold < 3.4
    assert abs(main - 1.0) < 0.3 and abs(second - 4.0) < 0.4


def test_unimodal_gives_no_threshold():
    rng = random.Random(2)
    threshold, (main, second) = valley_threshold([rng.gauss(0.0, 1.0) for _ in range(20000)], bins=20)
    assert threshold is None and second is None and abs(main) < 0.5
    assert valley_threshold([1.0, 1.0]) == (None, (1.0, None))
    assert valley_threshold([]) == (None, (None, None))


def test_per_candidate_statistic_follows_the_flag_direction():
    assert kind_of("gzip_2") == "gzip" and kind_of("my_pruner") == "my_pruner"
    rec = [{"signals": [{"finish": "pruned:entropy", "signals": {"entropy": [math.nan, 1.0, 3.0, 2.0],
                                                               "gzip": [math.nan, 0.5, 0.2, 0.4],
                                                               "mine": [1.0, 5.0]}}]}]
    reports = {r.name: r for r in analyse(rec, directions={"mine": "low"})}
    assert reports["entropy"].values == [3.0] and reports["entropy"].outcomes == ["pruned here"]
    assert reports["gzip"].values == [0.2] and reports["gzip"].outcomes == ["pruned by another"]
    assert reports["mine"].values == [1.0] and reports["mine"].direction == "low"
    assert reports["entropy"].threshold is None and reports["entropy"].note == "too few candidates"


def test_configured_thresholds_use_runtime_pruner_names():
    assert configured_thresholds(RESOLVED) == {"entropy": 2.5, "gzip": 0.25, "gzip_2": 0.1}


def test_calibrate_writes_json_and_histograms(tmp_path):
    run = write_run(tmp_path / "run", synthetic_records())
    reports, out = calibrate(run, bins=30)
    by = {r.name: r for r in reports}
    assert set(by) == {"entropy", "gzip", "gzip_2"}
    assert by["entropy"].direction == "high" and 1.6 < by["entropy"].threshold < 3.6
    assert by["gzip"].direction == "low" and 0.22 < by["gzip"].threshold < 0.5
    assert by["entropy"].n == 12 * 8  # the candidates that never warmed up are left out
    assert by["entropy"].configured == 2.5 and by["gzip_2"].configured == 0.1
    assert 0.05 < by["entropy"].flagged_fraction < 0.45
    summary = json.loads((out / "calibrate.json").read_text())
    assert {s["name"] for s in summary} == set(by) and summary[0]["candidates"] == 96
    for name in by:
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibrate_cli(tmp_path, cli):
    run = write_run(tmp_path / "run", synthetic_records(seed=3))
    result = cli("calibrate", run, "--out", tmp_path / "cal", "--no-plots")
    assert result.exit_code == 0, result.output
    assert "entropy" in result.output and "gzip" in result.output and "wrote" in result.output
    assert (tmp_path / "cal" / "calibrate.json").is_file() and not list((tmp_path / "cal").glob("*.png"))
    bad = cli("calibrate", run, "--direction", "x=up")
    assert bad.exit_code == 2


def test_calibrate_errors(tmp_path, cli):
    with pytest.raises(UserError, match="no samples.jsonl"):
        calibrate(tmp_path)
    run = write_run(tmp_path / "run", [{"id": "p0", "correct": True}])
    with pytest.raises(UserError, match="record_signals"):
        calibrate(run)
    assert cli("calibrate", tmp_path / "nowhere").exit_code == 2


def test_confidence_is_calibrated_from_its_lowest_value():
    """`confidence` flags when low (DeepConf's group confidence): each candidate counts with its
    minimum, and the valley between coherent (~9) and flat (~4.5) candidates is proposed."""
    rng = random.Random(3)
    signals = []
    for k in range(60):
        flat = k % 4 == 0
        low = rng.gauss(4.5 if flat else 9.0, 0.4)
        trace = [math.nan] * 31 + [low + 2.0 * (1 - i / 20) for i in range(21)]  # falls to its minimum
        signals.append({"finish": "pruned:confidence" if flat else "delimiter", "signals": {"confidence": trace}})
    (report,) = analyse([{"signals": signals}])
    assert report.direction == "low"
    assert sorted(report.values)[:3] == sorted(min(v for v in s["signals"]["confidence"] if v == v)
                                               for s in signals)[:3]
    assert 5.5 < report.threshold < 8.0 and report.flagged_fraction == pytest.approx(0.25)
