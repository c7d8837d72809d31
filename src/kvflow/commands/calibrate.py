"""`kvflow calibrate`, `kvflow calibrate-bits`: pruner thresholds from a run's recorded signals,
and the quantized base's bit-width from calibration runs."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from kvflow.commands.common import SET_HELP, UNSET_HELP, errors, plugin_registry, rich_console
from kvflow.errors import UserError


def calibrate(
    results_dir: Path = typer.Argument(..., metavar="RESULTS_DIR", help="A run with run.record_signals: true."),
    bins: int = typer.Option(40, "--bins", min=4, help="Histogram bins."),
    out: Optional[Path] = typer.Option(None, "--out", metavar="DIR", help="Where to write calibrate.json and PNGs "
                                       "(default RESULTS_DIR/calibrate)."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write one histogram PNG per signal."),
    direction: Optional[List[str]] = typer.Option(None, "--direction", metavar="PRUNER=high|low",
                                                  help="Which way a third-party pruner flags (default high)."),
) -> None:
    """Propose pruner thresholds from recorded signal traces: the valley between two modes.

    Reads the per-token signals recorded by a run with `run.record_signals: true`; for each
    pruner signal, proposes the valley between the two modes of its histogram (coherent
    versus degenerate candidates), and writes `calibrate.json` and one histogram PNG per
    signal.
    \f
    ```sh
    kvflow run pipelines/quickstart.yaml --set run.record_signals=true
    kvflow calibrate results/quickstart__<hash>
    ```
    """
    from kvflow.tools.calibrate import calibrate as run_calibrate

    with errors():
        dirs = {}
        for item in direction or []:
            name, _, way = item.partition("=")
            if way not in ("high", "low"):
                raise UserError(f"--direction {item}: expected PRUNER=high or PRUNER=low")
            dirs[name] = way
        reports, where = run_calibrate(results_dir, bins=bins, out=out, plots=plots, directions=dirs)
        from rich.table import Table

        fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
        table = Table(title=f"signals in {results_dir} (one value per candidate: max if it flags high, "
                      "min if low)", title_justify="left")
        table.add_column("signal", no_wrap=True)
        for col in ("flags", "n", "pruned", "modes", "proposed", "configured", "stops"):
            table.add_column(col, no_wrap=col == "modes")
        for r in reports:
            table.add_row(r.name, r.direction, str(r.n), str(r.outcomes.count("pruned here")),
                          f"{fmt(r.modes[0])} / {fmt(r.modes[1])}",
                          fmt(r.threshold) if r.threshold is not None else f"- ({r.note})",
                          fmt(r.configured), "-" if r.flagged_fraction is None else f"{r.flagged_fraction:.1%}")
        rich_console().print(table)
        typer.echo(f"wrote {where}")


def calibrate_bits(
    file: Path = typer.Argument(..., metavar="PIPELINE", help="Pipeline YAML file; its first proposer is the base."),
    problems: int = typer.Option(60, "--problems", min=1, help="Calibration problems (the paper: 60)."),
    bits: str = typer.Option("2,3,4,8", "--bits", metavar="B1,B2,...",
                             help="Bit-widths to compare (2, 3, 4, 8; 16 = no quantization, eviction only)."),
    offset: Optional[int] = typer.Option(None, "--offset", min=0, help="First calibration problem (default: right "
                                         "after the pipeline's evaluation split, dataset.offset + dataset.limit)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", "-s", metavar="PATH=VALUE", help=SET_HELP),
    unset: Optional[List[str]] = typer.Option(None, "--unset", metavar="PATH", help=UNSET_HELP),
    out: Optional[Path] = typer.Option(None, "--out", metavar="DIR", help="Where to write calibrate_bits.json "
                                       "(default <run.output>/<name>__calibrate_bits)."),
    force: bool = typer.Option(False, "--force", help="Rerun bit-widths whose results directory is complete."),
) -> None:
    """Pick the quantized base's bit-width by accuracy at one byte budget, on problems disjoint from the evaluation split."""
    from kvflow.tools.calibrate_bits import FULL_PRECISION, calibrate_bits as run_calibrate_bits

    with errors("kvflow: interrupted; finished problems are saved, run the same command again to resume"):
        try:
            widths = [int(b) for b in bits.split(",") if b.strip()]
        except ValueError:
            raise UserError(f"--bits {bits}: expected comma-separated integers, e.g. 2,3,4,8") from None
        bad = [b for b in widths if b not in (2, 3, 4, 8, FULL_PRECISION)]
        if bad or not widths:
            raise UserError(f"--bits {bits}: each must be one of 2, 3, 4, 8 or {FULL_PRECISION}")
        rows, chosen, where = run_calibrate_bits(file, widths, problems, sets=set_ or (), unsets=unset or (),
                                                 offset=offset, out=out, force=force, registry=plugin_registry())
        from rich.table import Table

        table = Table(title=f"bit-width calibration of {file} (same bytes for every row)", title_justify="left")
        for col in ("bits", "tokens kept", "accuracy", "length cap", "mean output tokens", "results"):
            table.add_column(col, overflow="fold")
        for r in rows:
            mark = " *" if r is chosen else ""
            table.add_row(("none" if r.bits == FULL_PRECISION else str(r.bits)) + mark,
                          "?" if r.budget_tokens is None else str(r.budget_tokens),
                          f"{r.accuracy:.1%} ({r.n_correct}/{r.n_problems})", f"{r.length_cap_rate:.1%}",
                          f"{r.mean_output_tokens:.0f}", r.results)
        rich_console().print(table)
        typer.echo(f"chosen: {'no quantization' if chosen.bits == FULL_PRECISION else f'{chosen.bits} bits'} "
                   f"(wrote {where / 'calibrate_bits.json'})")
