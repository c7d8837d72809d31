"""`kvflow calibrate RESULTS_DIR`: thresholds for the degeneration detectors from recorded
signal traces (METHODS.md §9).

Input: `samples.jsonl` of a run with ``run.record_signals: true``. Each record's `signals`
list holds one entry per candidate of a proposer with pruners: ``{step, source, index,
finish, signals: {pruner_name: [value per generated token]}}`` (null before warm-up; files
written before kvflow's strict JSON hold NaN there, read as None).

One number per candidate and signal: the extreme value in the direction the pruner flags,
i.e. the value that decides whether a threshold would have stopped the candidate: the max
for signals flagged when high (`entropy`), the min for signals flagged when low (`gzip`'s
compression ratio, `confidence`'s group confidence). The direction comes from the pruner kind (its name without a ``_2``
suffix); other kinds count as "high" unless told otherwise. Candidates whose trace is all
nan (they ended before warm-up) are left out. Note that a pruned candidate's trace ends
where it was stopped, so the current threshold shapes the histogram near it: calibrate from
a run whose thresholds were loose (or whose pruners were off but recorded; see `signal()`).

Valley rule: a histogram of the values with `bins` equal bins over [min, max], smoothed with
a 3-bin moving average. The main mode is the highest bin; the second mode is the local
maximum with the deepest dip (its height minus the lowest bin between it and the main mode);
the proposed threshold is the centre of that lowest bin (the middle one on ties). With no
dip at all the distribution is unimodal and no threshold is proposed; nor is one with fewer
than `MIN_CANDIDATES` (20) candidates.

Outputs: a table (printed by the CLI), ``calibrate.json`` and one histogram PNG per signal
(candidates stacked by outcome, proposed threshold solid, configured threshold dashed).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import yaml

from kvflow import jsonfile
from kvflow.errors import UserError
from kvflow.results.files import CONFIG, SAMPLES, read_samples
from kvflow.results.signals import DIRECTIONS, configured_thresholds, kind_of  # noqa: F401 - calibrate's vocabulary

#: fewer candidates than this and no threshold is proposed (a histogram of a handful is noise)
MIN_CANDIDATES = 20


@dataclass
class SignalReport:
    name: str  # pruner name as recorded (kind, or kind_2 ...)
    direction: str  # high | low
    values: list[float] = field(repr=False)  # one per candidate
    outcomes: list[str] = field(repr=False)  # "pruned here" | "pruned by another" | "kept"
    threshold: Optional[float]  # proposed (None: unimodal)
    modes: tuple[Optional[float], Optional[float]]
    configured: Optional[float]  # the run's threshold, when its config names it
    flagged_fraction: Optional[float]  # share of candidates the proposed threshold would stop
    note: str = ""  # why no threshold: "unimodal" | "too few candidates"

    @property
    def n(self) -> int:
        return len(self.values)

    def summary(self) -> dict:
        d = asdict(self)
        del d["values"], d["outcomes"]
        return {**d, "candidates": self.n, "pruned_here": self.outcomes.count("pruned here")}


def valley_threshold(values: Sequence[float], bins: int = 40) -> tuple[Optional[float], tuple[Optional[float], Optional[float]]]:
    """(threshold, (main mode, second mode)) by the valley rule of the module docstring."""
    vals = [v for v in values if math.isfinite(v)]
    if len(vals) < 2 or max(vals) == min(vals):
        return None, (vals[0] if vals else None, None)
    lo, hi = min(vals), max(vals)
    width = (hi - lo) / bins
    counts = [0] * bins
    for v in vals:
        counts[min(bins - 1, int((v - lo) / width))] += 1
    smooth = [sum(counts[max(0, i - 1): i + 2]) / len(counts[max(0, i - 1): i + 2]) for i in range(bins)]
    centre = lambda i: lo + (i + 0.5) * width  # noqa: E731
    main = max(range(bins), key=lambda i: (smooth[i], -i))
    best: Optional[tuple[float, int, int]] = None  # (depth, peak, valley)
    for p in range(bins):
        left = smooth[p - 1] if p > 0 else -1.0
        right = smooth[p + 1] if p + 1 < bins else -1.0
        if p == main or smooth[p] < left or smooth[p] < right:
            continue
        a, b = sorted((p, main))
        between = list(range(a + 1, b))
        if not between:
            continue
        low = min(smooth[i] for i in between)
        lows = [i for i in between if smooth[i] == low]
        depth = smooth[p] - low
        if depth > 0 and (best is None or depth > best[0]):
            best = (depth, p, lows[len(lows) // 2])
    if best is None:
        return None, (centre(main), None)
    return centre(best[2]), (centre(main), centre(best[1]))


def _extreme(trace: Sequence[Optional[float]], direction: str) -> Optional[float]:
    vals = [float(v) for v in trace if v is not None and math.isfinite(float(v))]
    if not vals:
        return None
    return max(vals) if direction == "high" else min(vals)


def analyse(records: Sequence[dict], *, bins: int = 40, directions: Optional[dict[str, str]] = None,
            configured: Optional[dict[str, float]] = None) -> list[SignalReport]:
    directions = {**DIRECTIONS, **(directions or {})}
    per: dict[str, tuple[list[float], list[str]]] = {}
    for rec in records:
        for cand in rec.get("signals") or []:
            finish = cand.get("finish", "")
            for name, trace in (cand.get("signals") or {}).items():
                value = _extreme(trace, directions.get(name, directions.get(kind_of(name), "high")))
                if value is None:
                    continue
                outcome = ("pruned here" if finish == f"pruned:{name}" else
                           "pruned by another" if finish.startswith("pruned:") else "kept")
                per.setdefault(name, ([], []))
                per[name][0].append(value)
                per[name][1].append(outcome)
    reports = []
    for name, (values, outcomes) in sorted(per.items()):
        direction = directions.get(name, directions.get(kind_of(name), "high"))
        threshold, modes = valley_threshold(values, bins)
        note = "" if threshold is not None else "unimodal"
        if len(values) < MIN_CANDIDATES:
            threshold, note = None, "too few candidates"
        flagged = None
        if threshold is not None:
            flagged = sum((v > threshold) if direction == "high" else (v < threshold) for v in values) / len(values)
        reports.append(SignalReport(name, direction, values, outcomes, threshold, modes,
                                    (configured or {}).get(name), flagged, note))
    return reports


def calibrate(results_dir: Path, *, bins: int = 40, out: Optional[Path] = None, plots: bool = True,
              directions: Optional[dict[str, str]] = None) -> tuple[list[SignalReport], Path]:
    """Analyse a results directory; write calibrate.json (and PNGs) under `out`
    (default RESULTS_DIR/calibrate). Raises UserError when there is nothing to analyse."""
    results_dir = Path(results_dir)
    if not (results_dir / SAMPLES).is_file():
        raise UserError(f"{results_dir}: no {SAMPLES} here", hint="pass a results directory written by `kvflow run`")
    # read-only, and only what calibration reads (ids and signal traces) must be there
    records = read_samples(Path(results_dir) / SAMPLES, validate=False)
    config_file = results_dir / CONFIG
    resolved = yaml.safe_load(config_file.read_text()) if config_file.is_file() else {}
    reports = analyse(records, bins=bins, directions=directions, configured=configured_thresholds(resolved or {}))
    if not reports:
        raise UserError(f"{results_dir}: no signal traces in {SAMPLES}",
                        hint="rerun with `--set run.record_signals=true` on a pipeline with pruners")
    out = Path(out) if out is not None else results_dir / "calibrate"
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibrate.json").write_text(jsonfile.dumps([r.summary() for r in reports], indent=2))
    if plots:
        for r in reports:
            plot_histogram(r, out / f"{r.name}.png", bins)
    return reports, out


def plot_histogram(report: SignalReport, path: Path, bins: int = 40) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = ["kept", "pruned by another", "pruned here"]
    data = [[v for v, o in zip(report.values, report.outcomes) if o == g] for g in groups]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.hist(data, bins=bins, stacked=True, label=groups, color=["tab:blue", "tab:gray", "tab:orange"])
    if report.threshold is not None:
        ax.axvline(report.threshold, color="tab:red", label=f"proposed {report.threshold:.3g}")
    if report.configured is not None:
        ax.axvline(report.configured, color="black", linestyle="--", label=f"configured {report.configured:.3g}")
    stat = "max" if report.direction == "high" else "min"
    ax.set_xlabel(f"{report.name}: {stat} per candidate (flags when {report.direction})")
    ax.set_ylabel("candidates")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
