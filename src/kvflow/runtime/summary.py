"""The summary table `kvflow run` prints from a run's metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def summary_rows(metrics: dict, proposers: Sequence[str]) -> list[tuple[str, str]]:
    rows = [
        ("problems", f"{metrics.get('n_problems', 0)}"),
        ("accuracy", f"{metrics.get('accuracy', 0.0):.1%} ({metrics.get('n_correct', 0)})"),
        ("mean committed steps", f"{metrics.get('mean_steps', 0.0):.1f}"),
        ("mean output tokens", f"{metrics.get('mean_output_tokens', 0.0):.0f}"),
        ("degeneration rate", f"{metrics.get('degeneration_rate', 0.0):.1%}"),
    ]
    for p in proposers:
        rows.append((f"tokens generated: {p}", f"{metrics.get('tokens_generated', {}).get(p, 0.0):.0f} / problem"))
    for p in proposers:
        rows.append((f"committed-step share: {p}", f"{metrics.get('step_share', {}).get(p, 0.0):.1%}"))
    for name, frac in metrics.get("pruned_fraction", {}).items():
        rows.append((f"candidates pruned: {name}", f"{frac:.1%}"))
    finish = ", ".join(f"{k} {v}" for k, v in sorted(metrics.get("finish", {}).items()))
    rows.append(("finish", finish))
    timing = metrics.get("timing")
    if timing:
        rows.append(("wall time / problem (admitted to done)", f"{timing['mean_wall']:.1f} s"))
        share = ", ".join(f"{k} {v:.0%}" for k, v in timing["share"].items())
        rows.append(("time share", share))
        for name, occ in (timing.get("occupancy") or {}).items():
            rows.append((f"decode occupancy: {name}", f"{occ['occupancy']:.1%} ({occ['mean_rows']:.1f} of "
                                                      f"{occ['bound']} rows, {occ['forwards']} forwards)"))
    return rows


def print_summary(name: str, metrics: dict, path: Path, proposers: Sequence[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvflow run: {name}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary_rows(metrics, proposers):
        table.add_row(key, value)
    console = Console()
    console.print(table)
    console.print(f"results: {path}")
