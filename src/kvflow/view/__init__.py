"""`kvflow view`: a static HTML viewer of results directories (DESIGN.md §8).

    kvflow view DIR... [-o/--out FOLDER] [--serve [--port N]]

Writes one self-contained `index.html` (inline script, style and data; nothing fetched from
the network, no server needed) that shows:

- the runs: their metrics, and as columns the configuration fields that differ between them;
- a run's problems (id, correct, steps, tokens, degenerate, finish, seconds), sortable and
  filterable, and against another run each problem's outcome class (both right, rescued,
  broken, both wrong) with the counts and an exact McNemar test;
- one problem: question, gold, prediction, the committed trajectory with each step coloured
  by its source and its score, and, when the run recorded them, the candidates of every step
  (text, source, score, finish; `run.record_candidates`) and their per-token pruner signals
  with the thresholds (`run.record_signals`);
- a run's signal distributions (base candidates, pruned vs kept, with the thresholds) and the
  committed-step share along the trajectory.

The page's state is its URL hash (`#run=1&vs=0&filter=rescued&problem=gsm8k/12`), so a view
is a link. Nothing is written into the results directories.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from kvflow.errors import UserError

__all__ = ["view_command", "DEFAULT_OUT"]

DEFAULT_OUT = Path("kvflow-view")


def view_command(dirs: Sequence[str], *, out: Optional[Path] = None, serve: bool = False, port: int = 0,
                 echo: Callable[[str], None] = print) -> Path:
    """Write the viewer for the results directories `dirs` into `out`; with `serve`, serve
    it on localhost until interrupted. Returns the written index.html."""
    from kvflow.report import check_output_dir, load_runs
    from kvflow.view.page import write_viewer

    if not dirs:
        raise UserError("no results directories given", hint="kvflow view results/<name>__<hash> [more...]")
    out = Path(out) if out is not None else DEFAULT_OUT
    check_output_dir(out, "--out")
    runs = load_runs(dirs, strict=True)  # a directory that cannot be read is an error, named
    empty = [r.label for r in runs if not r.records]
    if empty:
        print(f"kvflow: no finished problems yet in: {', '.join(empty)}", file=sys.stderr)
    index = write_viewer(out, runs)
    size = index.stat().st_size
    echo(f"wrote {index} ({size / 1e6:.1f} MB, {len(runs)} run(s)); open it in a browser")
    if serve:
        serve_folder(out, port, echo)
    return index


def serve_folder(folder: Path, port: int, echo: Callable[[str], None]) -> None:
    """Serve `folder` on 127.0.0.1 (only this machine) until Ctrl-C; port 0 picks a free one."""
    import functools
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, format, *args):  # noqa: A002 - the signature http.server calls
            pass  # one line per request would bury the address

    handler = functools.partial(Quiet, directory=str(folder))
    try:
        server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    except OSError as e:
        raise UserError(f"--port {port}: cannot serve on 127.0.0.1: {e.strerror or e}",
                        hint="pick another port, or --port 0 for any free one") from None
    echo(f"serving {folder} at http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C to stop)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        echo("stopped")
    finally:
        server.server_close()
