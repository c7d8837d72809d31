"""The viewer's one file: `index.html` with its stylesheet, script and data inlined.

No network, no server: the page opens from disk (file://) in any browser. The data are strict
JSON (kvflow.jsonfile) inside `<script type="application/json">` blocks, one for the index and
one per run, so the page's `JSON.parse` sees exactly what kvflow wrote: a NaN would stop it.
`<` is escaped as `\\u003c` inside them (valid JSON), so no text from a run can close the block.
"""

from __future__ import annotations

import datetime as _dt
import html
from pathlib import Path
from typing import Sequence

import kvflow
from kvflow import jsonfile
from kvflow.results.runs import Run
from kvflow.view.data import build_index, run_details

ASSETS = Path(__file__).parent / "assets"

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="kvflow {version}">
<title>{title}</title>
<style>
{css}
</style>
</head>
<body>
<header>
  <h1>kvflow view</h1>
  <span class="meta">{summary}</span>
  <nav><a href="#runs-section">runs</a><a href="#problems-section">problems</a><a href="#signals-section">signals</a></nav>
</header>
<main>
<section id="runs-section"><h2>Runs</h2><div id="runs-table"></div></section>
<section id="problems-section"><h2>Problems of run <span id="run-title"></span></h2><div id="problems-body"></div></section>
<section id="problem" hidden></section>
<section id="signals-section"><h2>Signals of the run's candidates</h2><div id="signals-body"></div></section>
</main>
<noscript>kvflow view needs JavaScript (it draws the tables and plots from the data in this file).</noscript>
{data}
<script>
{js}
</script>
</body>
</html>
"""


def json_block(element_id: str, value: object) -> str:
    """A `<script type="application/json">` block holding `value` as strict JSON."""
    text = jsonfile.dumps(value, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    return f'<script type="application/json" id="{element_id}">{text}</script>'


def render_page(runs: Sequence[Run]) -> str:
    """The whole page for `runs` (in the order given)."""
    index = build_index(runs)
    blocks = [json_block("kvflow-index", index)]
    blocks += [json_block(f"kvflow-run-{i}", run_details(r)) for i, r in enumerate(runs)]
    names = ", ".join(r.label for r in runs[:3]) + (f" and {len(runs) - 3} more" if len(runs) > 3 else "")
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    summary = f"{len(runs)} run(s): {names} · generated {now} by kvflow {kvflow.__version__}"
    return PAGE.format(version=html.escape(kvflow.__version__), title=html.escape(f"kvflow view: {names}"),
                       summary=html.escape(summary), css=(ASSETS / "viewer.css").read_text(encoding="utf-8"),
                       js=(ASSETS / "viewer.js").read_text(encoding="utf-8"), data="\n".join(blocks))


def write_viewer(out: Path, runs: Sequence[Run]) -> Path:
    """Write `out/index.html` (creating `out`); its path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "index.html"
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render_page(runs), encoding="utf-8")
    tmp.replace(path)
    return path
