"""`kvflow view`: the viewer's data (outcome classes, McNemar, signal distributions, candidates),
the generated page's structure (self-contained, strict JSON data), the CLI (bad input exits 2
naming the file; --serve), and `run.record_candidates` on a real tiny run.

The page rendered in a real browser is tested in tests/test_view_browser.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from kvflow.results.runs import load_run
from kvflow.view.data import build_index, mcnemar_exact, pair_summary, run_details
from kvflow.view.page import render_page

GSM8K = REPO / "docs" / "results" / "repro" / "gsm8k"
RESCUE, EVICTED = GSM8K / "cpu_kv_rescue__64afb68c", GSM8K / "cpu_best_of_n__f9cd6046"


def strict(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


class Blocks(HTMLParser):
    """The page's `<script type="application/json">` blocks (id -> text) and every tag seen."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: dict[str, str] = {}
        self.tags: list[tuple[str, dict]] = []
        self._open = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "script" and a.get("type") == "application/json":
            self._open = a["id"]
            self.blocks[self._open] = ""

    def handle_data(self, data):
        if self._open:
            self.blocks[self._open] += data

    def handle_endtag(self, tag):
        if tag == "script":
            self._open = None


def parse_page(text: str) -> Blocks:
    p = Blocks()
    p.feed(text)
    return p


# --------------------------------------------------------------------------- a real tiny run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A tiny KV-Rescue run (tiny random models) with every candidate and the pruners'
    signals recorded: run.record_candidates and run.record_signals."""
    from typer.testing import CliRunner

    from kvflow.cli import app
    from kvflow.testing import tiny_pipeline

    root = tmp_path_factory.mktemp("tiny")
    path = tiny_pipeline(root, pruners=[{"kind": "entropy", "threshold": 4.0, "min_tokens": 4},
                                        {"kind": "gzip", "threshold": 0.3}], problems=2, n=3,
                         extra={"run": {"record_candidates": True, "record_signals": True}})
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 0, result.output
    (run_dir,) = (root / "results").iterdir()
    return run_dir


def test_record_candidates_keeps_every_candidate_of_every_step(tiny_run):
    config = yaml.safe_load((tiny_run / "config.resolved.yaml").read_text())
    n_per_step = sum(p.get("n", 1) for p in config["proposers"].values())
    for line in (tiny_run / "samples.jsonl").read_text().splitlines():
        rec = strict(line)  # strict JSON: the signals' warm-up values are null, not NaN
        cands = rec["all_candidates"]
        assert len(cands) == n_per_step * len({c["step"] for c in cands})
        assert sum(rec["candidates"].values()) == len(cands)
        for k, step in enumerate(rec["steps"]):
            (winner,) = [c for c in cands if c["step"] == k and c["committed"]]
            assert (winner["source"], winner["text"]) == (step["source"], step["text"])
            assert {c["source"] for c in cands if c["step"] == k} == set(config["proposers"])
        pruned = [c for c in cands if c["finish"].startswith("pruned:")]
        assert len(pruned) == sum(rec["pruned"].values())
        signalled = {(s["step"], s["source"], s["index"]) for s in rec["signals"]}
        assert signalled == {(c["step"], c["source"], c["index"]) for c in cands if c["source"] == "base"}


def test_record_candidates_adds_to_the_hash_only_when_set(tiny_run):
    from kvflow.config.validate import config_hash

    config = yaml.safe_load((tiny_run / "config.resolved.yaml").read_text())
    assert tiny_run.name.endswith(config_hash(config))
    without = {**config, "run": {k: v for k, v in config["run"].items() if k != "record_candidates"}}
    assert config_hash(without) != config_hash(config)  # a run that records is its own directory ...
    for committed in (RESCUE, EVICTED):  # ... and runs that never set it keep their directory's hash
        assert committed.name.endswith(config_hash(yaml.safe_load((committed / "config.resolved.yaml").read_text())))


def test_details_join_candidates_and_signals(tiny_run):
    run = load_run(tiny_run)
    details = run_details(run)
    for rec in run.records:
        d = details[rec["id"]]
        assert [s["source"] for s in d["steps"]] == [s["source"] for s in rec["steps"]]
        flat = [c for step in d["candidates"] for c in step]
        assert len(flat) == len(rec["all_candidates"])
        base = [c for c in flat if c["source"] == "base"]
        assert base and all(set(c["signals"]) == {"entropy", "gzip"} and c["text"] is not None for c in base)
        assert sum(c["committed"] for c in flat) == len(rec["steps"])


def test_page_is_self_contained_with_strict_json_data(tiny_run):
    page = render_page([load_run(tiny_run), load_run(RESCUE)])
    parsed = parse_page(page)
    assert set(parsed.blocks) == {"kvflow-index", "kvflow-run-0", "kvflow-run-1"}
    for text in parsed.blocks.values():
        strict(text)  # what JSON.parse in the page gets: NaN would fail here
    # nothing from the network: no external script, stylesheet, image, font or frame
    for tag, attrs in parsed.tags:
        assert not (tag == "script" and "src" in attrs), attrs
        assert tag not in ("link", "img", "iframe"), tag
    assert "@import" not in page and "url(" not in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)
    index = strict(parsed.blocks["kvflow-index"])
    assert [r["dir"] for r in index["runs"]] == [tiny_run.name, RESCUE.name]
    assert index["runs"][0]["recorded"] == {"signals": True, "candidates": True}
    assert "run.record_candidates" in index["config_paths"]  # a differing field, shown as a column


def test_old_nan_files_give_strict_page_data(tmp_path):
    """A run written before strict JSON (NaN in its signals) still views, and the page's data
    are strict JSON."""
    old = tmp_path / RESCUE.name
    shutil.copytree(RESCUE, old)
    lines = (old / "samples.jsonl").read_text().splitlines()
    assert "null" in lines[0]
    (old / "samples.jsonl").write_text("\n".join(line.replace("null", "NaN") for line in lines) + "\n")
    parsed = parse_page(render_page([load_run(old)]))
    details = strict(parsed.blocks["kvflow-run-0"])
    assert None in details["gsm8k/883"]["candidates"][0][0]["signals"]["entropy"]


# --------------------------------------------------------------------------- data on the committed runs


def test_mcnemar_exact():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(15, 2) == pytest.approx(2 * (1 + 17 + 136) / 2 ** 17)
    assert mcnemar_exact(2, 15) == mcnemar_exact(15, 2)
    assert mcnemar_exact(3, 3) == 1.0
    assert mcnemar_exact(5, 0) == pytest.approx(2 / 32)


def test_outcome_classes_of_kv_rescue_against_the_evicted_base():
    """docs/reproduction.md (bench/analyse_rescue.py): 15 rescued, 6 kept, 2 lost, 41 wrong in both."""
    s = pair_summary(load_run(EVICTED), load_run(RESCUE))
    assert (s["problems"], s["rescued"], s["both right"], s["broken"], s["both wrong"]) == (64, 15, 6, 2, 41)
    assert s["p_value"] == pytest.approx(mcnemar_exact(15, 2), rel=1e-3)


def test_signal_distributions_and_step_share_of_a_committed_run():
    run = load_run(RESCUE)
    index = build_index([run, load_run(EVICTED)])
    entry = index["runs"][0]
    dists = {d["signal"]: d for d in entry["distributions"]}
    assert set(dists) == {"entropy", "gzip"}
    assert dists["gzip"]["threshold"] == 0.541 and dists["entropy"]["threshold"] == 0.9557
    assert dists["gzip"]["direction"] == "low" and dists["entropy"]["direction"] == "high"
    base_pruned = sum(r["pruned"].get("gzip", 0) for r in run.records)
    assert dists["gzip"]["candidates"]["pruned"] == base_pruned == sum(dists["gzip"]["counts"]["pruned"])
    share = entry["step_share_by_position"]
    assert sum(sum(v) for v in share["sources"].values()) == sum(len(r["steps"]) for r in run.records)
    assert index["runs"][1]["distributions"] == []  # best-of-N: no pruners, no signals
    assert {(p["a"], p["b"]) for p in index["pairs"]} == {(0, 1), (1, 0)}


# --------------------------------------------------------------------------- the command


def test_view_command_writes_one_file(cli, tmp_path):
    out = tmp_path / "view"
    result = cli("view", RESCUE, EVICTED, "-o", out)
    assert result.exit_code == 0, result.output
    assert [p.name for p in out.iterdir()] == ["index.html"]
    assert "2 run(s)" in result.output
    for name in (RESCUE.name, EVICTED.name):
        assert f'"dir":"{name}"' in (out / "index.html").read_text()


def test_bad_input_is_a_message_naming_the_file_and_exit_2(cli, tmp_path):
    result = cli("view", tmp_path / "nowhere", "-o", tmp_path / "v")
    assert result.exit_code == 2 and "nowhere: no such results directory" in result.output
    assert "Traceback" not in result.output
    (tmp_path / "empty").mkdir()
    result = cli("view", tmp_path / "empty", "-o", tmp_path / "v")
    assert result.exit_code == 2 and "not a results directory" in result.output

    broken = tmp_path / RESCUE.name
    shutil.copytree(RESCUE, broken)
    lines = (broken / "samples.jsonl").read_text().splitlines()
    lines[3] = lines[3][:100]  # torn in the middle: corrupt, never silently dropped
    (broken / "samples.jsonl").write_text("\n".join(lines) + "\n")
    result = cli("view", broken, "-o", tmp_path / "v")
    assert result.exit_code == 2 and f"{broken / 'samples.jsonl'}:4" in result.output
    assert "Traceback" not in result.output

    # torn at the end: what a killed (or still running) run leaves; its finished problems view
    (broken / "samples.jsonl").write_text("\n".join(lines[:3] + [lines[3]]))
    result = cli("view", broken, "-o", tmp_path / "v")
    assert result.exit_code == 0 and "incomplete last line" in result.output and "samples.jsonl" in result.output

    (tmp_path / "file").write_text("x")
    result = cli("view", RESCUE, "-o", tmp_path / "file")
    assert result.exit_code == 2 and "--out" in result.output


def test_serve_prints_the_address_and_serves_the_page(tmp_path):
    import time
    import urllib.request

    kvflow = Path(sys.executable).parent / "kvflow"
    proc = subprocess.Popen([str(kvflow), "view", str(EVICTED), "-o", str(tmp_path / "v"), "--serve"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, address = time.monotonic() + 60, None
        while time.monotonic() < deadline and address is None:
            line = proc.stdout.readline()
            match = re.search(r"at (http://127\.0\.0\.1:\d+/)", line)
            address = match.group(1) if match else None
            if not line and proc.poll() is not None:
                break
        assert address, "no address printed"
        with urllib.request.urlopen(address + "index.html", timeout=30) as response:
            assert b'id="kvflow-index"' in response.read()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_committed_viewer_covers_the_committed_runs():
    """docs/results/repro/gsm8k/viewer/index.html (linked from the docs) holds every run
    committed beside it, as strict JSON; regenerate it with the command in docs/viewer.md."""
    page = (GSM8K / "viewer" / "index.html").read_text(encoding="utf-8")
    parsed = parse_page(page)
    index = strict(parsed.blocks["kvflow-index"])
    runs = sorted(p.name for p in GSM8K.iterdir() if (p / "config.resolved.yaml").is_file())
    assert [r["dir"] for r in index["runs"]] == runs
    for i, run in enumerate(index["runs"]):
        details = strict(parsed.blocks[f"kvflow-run-{i}"])
        assert len(details) == run["metrics"]["problems"] == len(run["problems"])
    assert len(page.encode()) < 5_000_000
