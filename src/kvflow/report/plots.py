"""PNG plots of `kvflow report` (matplotlib, Agg backend; imported only when plotting).

Series are named as the tables name them (kvflow.report.labels): variant / evictor, N, and
the configuration fields that tell apart runs of one variant, evictor and N.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Optional, Sequence

from kvflow.report.labels import SeriesNames, series_names
from kvflow.results.runs import Run


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(plt, n: int) -> list:
    """n colours, none repeated up to 20 (the default cycle has 10: a leaderboard's 16 evictors
    would share them), then cycling."""
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if n > len(cycle):
        cmap = plt.get_cmap("tab20")
        cycle = [cmap(i) for i in range(cmap.N)]
    return [cycle[i % len(cycle)] for i in range(n)]


MARKERS = "osD^vP<X>*"  # one per series, in turn: series whose colours are close differ in shape


def _wrap(label: str, width: int = 48) -> str:
    """A long series name on several lines (legends and tick labels stay narrow)."""
    return "\n".join(textwrap.wrap(label, width, break_long_words=False, break_on_hyphens=False)) or label


def _legend(ax) -> None:
    """The legend beside the axes, never over the lines; `_save` keeps it in the image."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def _percent_axis(ax, values: Sequence[float]) -> None:
    """0 at the bottom and at least 0-10%: all-zero accuracies are a flat line at 0, not a
    -0.04...0.04 axis."""
    top = max(values, default=0.0)
    ax.set_ylim(0, min(105.0, max(10.0, top * 1.15)))


def _unfinished(r: Run) -> str:
    limit = r.dataset.get("limit")
    return f"unfinished: {r.metrics.get('n_problems', 0)}" + (f" of {limit}" if limit else "") + " problems"


def accuracy_vs_budget(runs: Sequence[Run], path: Path, names: Optional[SeriesNames] = None) -> Optional[Path]:
    """Accuracy vs budget, one line per series and N; full-KV runs as dashed horizontal lines.
    Points of unfinished runs are hollow and say on how many problems they rest."""
    names = names or series_names(runs)
    evicted = [r for r in runs if not r.full_kv and r.budget is not None and r.metrics.get("accuracy") is not None]
    full = [r for r in runs if r.full_kv and r.metrics.get("accuracy") is not None]
    if not evicted and not full:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = sorted({(names.series(r), r.n) for r in evicted})
    colors = _colors(plt, len(series) + len(full))
    for i, ((method, n), c) in enumerate(zip(series, colors)):
        sel = sorted((r for r in evicted if names.series(r) == method and r.n == n), key=lambda r: r.budget)
        ax.plot([r.budget for r in sel], [r.metrics["accuracy"] * 100 for r in sel], "-" + MARKERS[i % len(MARKERS)],
                color=c, label=_wrap(f"{method}, N={n}"))
        for r in sel:
            if not r.complete:  # a point on a few problems must not pass for a finished run
                ax.plot([r.budget], [r.metrics["accuracy"] * 100], "o", color="white", markeredgecolor=c, zorder=3)
                ax.annotate(_unfinished(r), (r.budget, r.metrics["accuracy"] * 100), fontsize=7, color=c,
                            textcoords="offset points", xytext=(4, 4))
    full_colors = ["black"] if len(full) == 1 else colors[len(series):]  # one full KV: the reference, in black
    for r, c in zip(full, full_colors):
        ax.axhline(r.metrics["accuracy"] * 100, linestyle="--", color=c,
                   label=_wrap(f"{names.variant(r)} (full KV), N={r.n}"
                               + ("" if r.complete else f", {_unfinished(r)}")))
    budgets = sorted({r.budget for r in evicted})
    if budgets:
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
    ax.set_xlabel("KV budget (tokens per layer and KV head)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("Accuracy vs KV budget")
    ax.grid(True, alpha=0.3)
    _percent_axis(ax, [r.metrics["accuracy"] * 100 for r in (*evicted, *full)])
    _legend(ax)
    return _save(fig, plt, path)


def step_share(runs: Sequence[Run], path: Path, names: Optional[SeriesNames] = None) -> Optional[Path]:
    """Share of committed steps from the helper(s) vs N (one line per series and budget) and
    vs budget (one line per series and N); full-KV runs dashed."""
    multi = [r for r in runs if len(r.proposers) > 1 and r.metrics.get("step_share")]
    if not multi:
        return None
    names = names or series_names(runs)
    variant = {r.path: names.series(r) for r in multi}  # variant / evictor and what else tells runs apart
    plt = _plt()

    def helper_share(r: Run) -> float:
        share = r.metrics["step_share"]
        return 100 * sum(share.get(p, 0.0) for p in r.proposers[1:])

    fig, (ax_n, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2))
    variants = sorted(set(variant.values()))
    budgets = sorted({r.budget for r in multi if not r.full_kv and r.budget is not None})
    keys = [(v, b) for v in variants for b in budgets] + [(v, None) for v in variants]
    keys = [k for k in keys
            if any(variant[r.path] == k[0] and (r.budget if not r.full_kv else None) == k[1] for r in multi)]
    for (name, b), c in zip(keys, _colors(plt, len(keys))):
        sel = [r for r in multi if variant[r.path] == name and (r.budget if not r.full_kv else None) == b]
        pts = sorted((r.n, helper_share(r)) for r in sel)
        label = f"{name}, " + (f"B={b}" if b is not None else "full KV")
        ax_n.plot([n for n, _ in pts], [s for _, s in pts], "-o" if b is not None else "--o", color=c, label=label)
    ns = sorted({r.n for r in multi})
    keys = [(v, n) for v in variants for n in ns if any(variant[r.path] == v and r.n == n for r in multi)]
    for (name, n), c in zip(keys, _colors(plt, len(keys))):
        sel = [r for r in multi if variant[r.path] == name and r.n == n]
        pts = sorted((r.budget, helper_share(r)) for r in sel if not r.full_kv and r.budget is not None)
        if pts:
            ax_b.plot([b for b, _ in pts], [s for _, s in pts], "-o", color=c, label=f"{name}, N={n}")
        for r in (r for r in sel if r.full_kv):
            ax_b.axhline(helper_share(r), linestyle="--", color=c, label=f"{name}, N={n}, full KV")
    ax_n.set_xlabel("candidates per step N (base)")
    ax_n.set_xticks(ns, [str(n) for n in ns])
    ax_b.set_xlabel("KV budget (tokens)")
    if budgets:
        ax_b.set_xscale("log", base=2)
        ax_b.set_xticks(budgets, [str(b) for b in budgets])
        ax_b.minorticks_off()
    for ax, title in ((ax_n, "helper step share vs N"), (ax_b, "helper step share vs budget")):
        ax.set_ylabel("committed steps from the helper (%)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    return _save(fig, plt, path)


def decode_cost(runs: Sequence[Run], path: Path, names: Optional[SeriesNames] = None) -> Optional[Path]:
    """Stacked bars: base and helper tokens generated per problem, per run."""
    rows = [r for r in runs if r.metrics.get("tokens_generated")]
    if not rows:
        return None
    names = names or series_names(runs)
    plt = _plt()
    # horizontal bars: a run's name is read along its row, at any length and any number of runs
    # (rotated names under vertical bars took the height of the plot)
    labels = [_wrap(f"{names.variant(r)}, {'full KV' if r.full_kv else f'B={r.budget}'}, N={r.n}", 40) for r in rows]
    lines = sum(label.count("\n") + 1 for label in labels)
    fig, ax = plt.subplots(figsize=(9, max(3.0, 0.22 * lines + 0.3 * len(rows) + 1.2)))
    base = [r.metrics["tokens_generated"].get(r.proposers[0], 0.0) for r in rows]
    helper = [sum(r.metrics["tokens_generated"].get(p, 0.0) for p in r.proposers[1:]) for r in rows]
    y = range(len(rows))
    ax.barh(y, base, label="base tokens")
    ax.barh(y, helper, left=base, label="helper tokens")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.invert_yaxis()  # the first run on top, as in the tables
    ax.set_xlabel("tokens generated per problem")
    ax.set_title("Decode cost")
    ax.grid(True, axis="x", alpha=0.3)
    _legend(ax)
    return _save(fig, plt, path)


def _save(fig, plt, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # what lies outside the axes (a legend) is kept
    plt.close(fig)
    return path
