"""`kvflow report`, `kvflow view`: tables, plots and an HTML viewer from results directories
(nothing is written into them)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from kvflow.commands.common import errors


def report(
    dirs: Optional[List[str]] = typer.Argument(None, metavar="DIR...", help="Results directories, globs, or a "
                                               "parent directory (e.g. results/)."),
    out: Optional[Path] = typer.Option(None, "--out", metavar="DIR", help="Write report.md, CSVs and PNGs here."),
    allow_mixed: bool = typer.Option(False, "--allow-mixed", help="Compare runs over different problem sets."),
    as_csv: bool = typer.Option(False, "--csv", help="Print the per-run table as CSV instead of markdown."),
    oracle_evicted: Optional[str] = typer.Option(None, "--oracle-evicted", metavar="DIR",
                                                 help="Oracle analysis: the evicted-base run."),
    oracle_helper: Optional[str] = typer.Option(None, "--oracle-helper", metavar="DIR",
                                                help="Oracle analysis: the full-KV helper run."),
    oracle_full: Optional[str] = typer.Option(None, "--oracle-full", metavar="DIR",
                                              help="Oracle analysis: the full-KV base run (for the gap recovered)."),
    strict: bool = typer.Option(False, "--strict", help="Refuse (exit 2) instead of skipping a directory that "
                                "cannot be read."),
    limit: Optional[int] = typer.Option(None, "--limit", metavar="N", help="Only the first N problems of each "
                                        "run's dataset order (runs of different sizes over one order compare)."),
) -> None:
    """Tables (markdown, CSV) and plots (PNG) from results directories.

    DIR may be a results directory, a glob, or a parent directory such as `results/`; runs
    over different problem sets are refused unless `--allow-mixed`. Nothing is written into
    the results directories. `--oracle-evicted` and `--oracle-helper` add the answer-level
    oracle of an evicted-base run and a full-KV helper run (correct if either is);
    `--oracle-full` names the full-KV base run, for the share of the gap each run recovers.
    `--limit N` reports every run on the first N problems of its dataset order.
    \f
    ```sh
    kvflow report results/ --out report/
    kvflow report results/ --oracle-evicted results/best_of_n__1a2b3c4d --oracle-helper results/helper_only__5e6f7a8b
    ```
    """
    from kvflow.report import report_command

    with errors():
        report_command(dirs or [], out=out, allow_mixed=allow_mixed, oracle_evicted=oracle_evicted,
                       oracle_helper=oracle_helper, oracle_full=oracle_full, as_csv=as_csv, strict=strict,
                       limit=limit, echo=typer.echo)


def view(
    dirs: List[str] = typer.Argument(..., metavar="DIR...", help="Results directories, globs, or a parent directory "
                                     "(e.g. results/)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", metavar="FOLDER", help="Where to write index.html "
                                       "(default ./kvflow-view)."),
    serve: bool = typer.Option(False, "--serve", help="Also serve the folder on 127.0.0.1 and print its address "
                               "(until Ctrl-C)."),
    port: int = typer.Option(0, "--port", min=0, max=65535, help="Port for --serve (0: any free port)."),
) -> None:
    """A static HTML viewer of runs, problems and trajectories: one self-contained file.

    Writes `FOLDER/index.html` (script, style and data inline: it opens from disk, offline,
    in any browser) with: the runs' metrics, with the configuration fields that differ
    between them as columns; each run's problems (correct, steps, tokens, degenerate, finish,
    seconds), sortable and filterable, and against another run of the same problems each
    problem's outcome (both right, rescued, broken, both wrong) with an exact McNemar test;
    one problem's question, gold, prediction and committed trajectory, each step coloured by
    its source and score, with every step's candidates and their per-token pruner signals
    when the run recorded them (`run.record_candidates`, `run.record_signals`); and a run's
    signal distributions (pruned vs kept, with the thresholds) and committed-step share
    along the trajectory. The page's state is in its URL, e.g.
    `index.html#run=1&vs=0&filter=rescued&problem=gsm8k/12`. Nothing is written into the
    results directories; a directory that cannot be read is an error (exit 2).
    \f
    See [The viewer](viewer.md).

    ```sh
    kvflow view results/kv_rescue__1a2b3c4d results/best_of_n__5e6f7a8b -o view/
    kvflow view results/ --serve
    ```
    """
    from kvflow.view import view_command

    with errors():
        view_command(dirs, out=out, serve=serve, port=port, echo=typer.echo)
