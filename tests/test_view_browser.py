"""`kvflow view` in a real browser: headless Chromium opens the generated page (file://, no
server) at URLs whose hash selects a run, a comparison, a filter and a problem, runs its
script, and the rendered DOM (`--dump-dom`) is checked against the records: the trajectory's
steps and their colours by source, the candidates of each step, the rows a filter leaves,
the outcome counts of a comparison, the signal plots with their thresholds, and no script
error (the page writes them to `<body data-errors>`; console errors are read from Chromium's
log too). A screenshot of each page is kept in the test's tmp_path.

Skipped, saying why, where no Chromium is installed (Debian: `apt-get install chromium`;
or point KVFLOW_CHROMIUM at a Chrome/Chromium binary).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import REPO
from kvflow.results.runs import load_run

GSM8K = REPO / "docs" / "results" / "repro" / "gsm8k"
RESCUE, EVICTED = GSM8K / "cpu_kv_rescue__64afb68c", GSM8K / "cpu_best_of_n__f9cd6046"


def _chromium() -> str | None:
    for name in (os.environ.get("KVFLOW_CHROMIUM"), "chromium", "chromium-browser", "google-chrome",
                 "google-chrome-stable"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


CHROMIUM = _chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium/Chrome found (apt-get install chromium, or set "
                                                         "KVFLOW_CHROMIUM): the viewer's browser test cannot run")


def _browser(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"  # its own profile: tests never share or touch a user's
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=15000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def console_errors(stderr: str) -> list[str]:
    """Console messages of the page at error level, as Chromium logs them with --enable-logging."""
    return [line for line in stderr.splitlines() if "CONSOLE" in line and ("Uncaught" in line or "Error" in line)]


class Dom(HTMLParser):
    """Start tags of the dumped DOM with their attributes, and the text under each id'd element."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.tags: list[tuple[str, dict]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, {k: (v if v is not None else "") for k, v in attrs}))

    def find(self, tag: str | None = None, *, class_: str | None = None, **attrs: str) -> list[dict]:
        """Start tags named `tag` having the class `class_` and the attributes `attrs` (a_b: a-b)."""
        out = []
        for t, a in self.tags:
            if tag is not None and t != tag:
                continue
            if class_ is not None and class_ not in a.get("class", "").split():
                continue
            if all(a.get(k.replace("_", "-")) == v for k, v in attrs.items()):
                out.append(a)
        return out

    def body(self) -> dict:
        return self.find("body")[0]


def open_page(tmp_path: Path, index: Path, fragment: str, shot: str) -> Dom:
    """The DOM of index.html#fragment after its script ran (and a screenshot into tmp_path)."""
    url = index.resolve().as_uri() + "#" + fragment
    dumped = _browser(tmp_path, "--dump-dom", url)
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    assert not console_errors(dumped.stderr), console_errors(dumped.stderr)
    dom = Dom(dumped.stdout)
    body = dom.body()
    assert body.get("data-ready") == "1", "the page did not finish rendering"
    assert "data-errors" not in body, body["data-errors"]
    shot_path = tmp_path / f"{shot}.png"
    taken = _browser(tmp_path, "--hide-scrollbars", "--window-size=1400,2000", f"--screenshot={shot_path}", url)
    assert taken.returncode == 0 and shot_path.stat().st_size > 10_000, taken.stderr[-2000:]
    return dom


def _rgb(style: str) -> tuple[str, ...]:
    match = re.search(r"rgba?\((\d+),\s*(\d+),\s*(\d+)", style)
    assert match, style
    return match.groups()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
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


def _view(cli, out: Path, *dirs: Path) -> Path:
    result = cli("view", *dirs, "-o", out)
    assert result.exit_code == 0, result.output
    return out / "index.html"


def test_a_small_run_trajectory_and_candidates(cli, tmp_path, tiny_run):
    index = _view(cli, tmp_path / "view", tiny_run)
    run = load_run(tiny_run)
    for rec in run.records:
        dom = open_page(tmp_path, index, f"run=0&problem={rec['id']}", f"tiny-{rec['id'].replace('/', '_')}")
        spans = dom.find("span", class_="step")
        # the committed trajectory: one span per step, in order, with its source and score
        assert [s["data-source"] for s in spans] == [s["source"] for s in rec["steps"]]
        assert [s["data-step"] for s in spans] == [str(k) for k in range(len(rec["steps"]))]
        colour = {}
        for span in spans:  # one colour per source, different sources different colours (Figure 7)
            colour.setdefault(span["data-source"], set()).add(_rgb(span["style"]))
        assert all(len(c) == 1 for c in colour.values())
        assert len({next(iter(c)) for c in colour.values()}) == len(colour)
        legend = dom.text.split('class="legend"')[1]
        for source, n in rec["step_counts"].items():
            assert f"{source}: {n} steps" in legend
        # every candidate of every step, pruned ones with their signal traces and thresholds
        cards = dom.find("div", class_="candidate")
        assert len(cards) == len(rec["all_candidates"])
        assert [c["data-finish"] for c in cards] == [c["finish"] for c in sorted(
            rec["all_candidates"], key=lambda c: (c["step"], c["source"], c["index"]))]
        traces = dom.find("svg", class_="signal")
        assert len(traces) == 2 * sum(1 for c in rec["all_candidates"] if c["source"] == "base")
        thresholds = {t["data-threshold"] for t in dom.find("line", class_="threshold")}
        assert {"4", "0.3"} <= thresholds


def test_a_committed_run_filters_comparison_and_signals(cli, tmp_path):
    index = _view(cli, tmp_path / "view", RESCUE, EVICTED)
    rescue = load_run(RESCUE)
    correct = sum(r["correct"] for r in rescue.records)

    def rows(dom: Dom) -> list[str]:
        return [a["data-id"] for a in dom.find("tr") if "data-id" in a]

    dom = open_page(tmp_path, index, "run=0", "runs")
    assert len(rows(dom)) == 64 and dom.find("p", id="problems-count")[0]["data-visible"] == "64"
    assert len(dom.find("tr", class_="clickable")) == 64 + 2  # the problems and the two runs
    # Figure 3 a-d: a histogram and a mean trace per signal, each with its threshold
    assert {h["data-signal"] for h in dom.find("svg", class_="histogram")} == {"entropy", "gzip"}
    assert {t["data-threshold"] for t in dom.find("line", class_="threshold")} >= {"0.9557", "0.541"}

    dom = open_page(tmp_path, index, "run=0&filter=wrong", "wrong")
    wrong = rows(dom)
    assert len(wrong) == 64 - correct
    assert set(wrong) == {r["id"] for r in rescue.records if not r["correct"]}

    dom = open_page(tmp_path, index, "run=0&vs=1&filter=rescued", "rescued")
    assert len(rows(dom)) == 15  # wrong under eviction, right with KV-Rescue (docs/reproduction.md)
    shown = dict(re.findall(r'data-outcome="([^"]+)">(\d+)<', dom.text))
    assert shown == {"both right": "6", "rescued": "15", "broken": "2", "both wrong": "41"}
    assert float(dom.find("div", id="pair")[0]["data-p"]) == pytest.approx(2 * (1 + 17 + 136) / 2 ** 17, rel=1e-3)

    dom = open_page(tmp_path, index, "run=0&q=gsm8k/11&sort=tokens&desc=1", "search")
    ids = rows(dom)
    assert ids and all("gsm8k/11" in i for i in ids)
    tokens = {r["id"]: r["output_tokens"] for r in rescue.records}
    assert [tokens[i] for i in ids] == sorted((tokens[i] for i in ids), reverse=True)

    degenerate = next(r for r in rescue.records if r["degenerate"])
    dom = open_page(tmp_path, index, f"run=0&problem={degenerate['id']}", "degenerate")
    spans = dom.find("span", class_="step")
    assert [s["data-source"] for s in spans] == [s["source"] for s in degenerate["steps"]]
    # with signals only (no record_candidates): the base's candidates, pruned ones with their trace
    cards = dom.find("div", class_="candidate")
    assert len(cards) == len(degenerate["signals"])
    assert len(dom.find("svg", class_="signal")) == 2 * len(degenerate["signals"])


def test_the_checks_see_a_script_error(cli, tmp_path):
    """The error checks above are not vacuous: a NaN put into the page's data (what kvflow
    wrote before strict JSON) stops JSON.parse, and both the page and Chromium's log say so."""
    index = _view(cli, tmp_path / "view", EVICTED)
    text = index.read_text()
    bad = tmp_path / "bad.html"
    bad.write_text(text.replace('"accuracy":0.125', '"accuracy":NaN', 1))
    dumped = _browser(tmp_path, "--dump-dom", bad.resolve().as_uri())
    body = Dom(dumped.stdout).body()
    assert "not valid JSON" in body.get("data-errors", "") and "data-ready" not in body
    assert any("not valid JSON" in line for line in console_errors(dumped.stderr))


def test_the_differing_configuration_fields_are_visible_at_1400_pixels(cli, tmp_path):
    """The runs table put the fields that tell runs apart last, past the right edge of the
    1400-pixel window docs/viewer.md takes its screenshots at (issue 34, 7)."""
    index = _view(cli, tmp_path / "view", RESCUE, EVICTED)
    measured = index.with_name("measured.html")
    measured.write_text(index.read_text(encoding="utf-8").replace("</body>", """<script>
window.addEventListener("load", function () { setTimeout(function () {
  var right = 0, cols = document.querySelectorAll("#runs th.config");
  cols.forEach(function (th) { right = Math.max(right, th.getBoundingClientRect().right); });
  document.body.setAttribute("data-config-columns", String(cols.length));
  document.body.setAttribute("data-config-right", String(Math.round(right)));
}, 0); });
</script></body>"""), encoding="utf-8")
    dumped = _browser(tmp_path, "--window-size=1400,900", "--dump-dom", measured.resolve().as_uri() + "#run=0")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    body = Dom(dumped.stdout).body()
    assert int(body["data-config-columns"]) >= 2, body  # the two runs differ in several fields
    assert 0 < int(body["data-config-right"]) <= 1400, body
