"""What `kvflow view` shows, computed from results directories (read-only) as plain data.

`build_index(runs)` is the page's table of contents, small enough to parse at once: the runs
(metrics, the configuration fields that differ between them, thresholds, each problem's
summary row), every pair of runs over their common problems (outcome classes and an exact
McNemar test), and per run the signal distributions (paper Figure 3 a-d: each base
candidate's extreme entropy / gzip value, pruned vs kept, with the thresholds) and the
committed-step share along the trajectory. `run_details(run)` holds what one problem's page
needs (question, gold, prediction, committed steps, and the candidates of every step with
their per-token signals when the run recorded them); the page parses a run's details only
when one of its problems is opened.

Numbers are rounded to 4 significant digits (a signal trace is most of a run's bytes and
no plot needs more); a missing value (a signal before warm-up, an unscored step) is None.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

from kvflow.results.signals import DIRECTIONS, configured_thresholds, kind_of
from kvflow.report.labels import differing_paths, values_at
from kvflow.results.runs import Run
from kvflow.results.stats import mcnemar_exact, wilson

#: histogram bins of a signal distribution
BINS = 30
#: token positions of the mean signal trace (pruned vs kept) in a distribution
TRACE_POSITIONS = 192
#: outcome classes of a problem in a pair of runs (A, B): (A correct, B correct) -> class
OUTCOMES = {(True, True): "both right", (False, True): "rescued", (True, False): "broken",
            (False, False): "both wrong"}


def short(value: Optional[float]) -> Optional[float]:
    """`value` to 4 significant digits (None stays None; NaN and infinities become None)."""
    if value is None or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(f"{value:.4g}")


def pair_summary(a: Run, b: Run) -> Optional[dict]:
    """Outcome classes of the problems runs `a` and `b` both finished ("rescued": wrong in
    `a`, right in `b`), and the exact McNemar p-value; None when they share no problem."""
    ca, cb = a.correct_by_id(), b.correct_by_id()
    common = [i for i in ca if i in cb]
    if not common:
        return None
    counts = {name: 0 for name in OUTCOMES.values()}
    for i in common:
        counts[OUTCOMES[(ca[i], cb[i])]] += 1
    return {"problems": len(common), **counts, "p_value": short(mcnemar_exact(counts["rescued"], counts["broken"]))}


def problem_row(rec: dict, proposers: Sequence[str]) -> dict:
    """The summary row of one problem (the problems table). `sources`: each committed step's
    proposer as its index in `proposers` (-1: a fallback step, committed though pruned)."""
    def source(step: dict) -> int:
        src = step.get("source")
        return -1 if step.get("fallback") or src not in proposers else list(proposers).index(src)

    return {"id": rec["id"], "correct": bool(rec.get("correct")), "steps": len(rec.get("steps") or []),
            "tokens": rec.get("output_tokens"), "degenerate": bool(rec.get("degenerate")),
            "finish": rec.get("finish"), "seconds": short(rec.get("seconds")),
            "sources": [source(s) for s in rec.get("steps") or []]}


def direction(pruner: str) -> str:
    """Which way a pruner flags: "high" (entropy) or "low" (gzip's compression ratio)."""
    return DIRECTIONS.get(pruner, DIRECTIONS.get(kind_of(pruner), "high"))


def _extreme(trace: Iterable[Optional[float]], way: str) -> Optional[float]:
    vals = [v for v in trace if isinstance(v, (int, float)) and math.isfinite(v)]
    return (max(vals) if way == "high" else min(vals)) if vals else None


def signal_distributions(run: Run) -> list[dict]:
    """Per pruner signal of the base proposer's candidates (paper Figure 3 a-d): a histogram of
    each candidate's extreme value (the one a threshold decides on), split into candidates
    this pruner stopped ("pruned") and the others ("kept"), the mean trace by token position
    of both groups, and the configured threshold. [] for a run without recorded signals."""
    base = run.proposers[0] if run.proposers else None
    values: dict[str, list[tuple[float, bool]]] = {}
    traces: dict[str, dict[bool, list[list]]] = {}
    for rec in run.records:
        for cand in rec.get("signals") or []:
            if cand.get("source") != base:
                continue
            for name, trace in (cand.get("signals") or {}).items():
                pruned = cand.get("finish") == f"pruned:{name}"
                value = _extreme(trace, direction(name))
                if value is not None:
                    values.setdefault(name, []).append((value, pruned))
                traces.setdefault(name, {True: [], False: []})[pruned].append(trace)
    thresholds = configured_thresholds(run.config)
    out = []
    for name, pairs in sorted(values.items()):
        lo, hi = min(v for v, _ in pairs), max(v for v, _ in pairs)
        threshold = thresholds.get(name)
        if threshold is not None:  # the threshold's line must fall inside the plot
            lo, hi = min(lo, threshold), max(hi, threshold)
        width = (hi - lo) / BINS if hi > lo else 1.0
        counts = {"pruned": [0] * BINS, "kept": [0] * BINS}
        for v, pruned in pairs:
            counts["pruned" if pruned else "kept"][min(BINS - 1, int((v - lo) / width))] += 1
        out.append({"signal": name, "direction": direction(name), "threshold": threshold, "lo": short(lo),
                    "hi": short(lo + width * BINS), "counts": counts,
                    "candidates": {"pruned": sum(p for _, p in pairs), "kept": sum(not p for _, p in pairs)},
                    "mean_trace": {"pruned": _mean_trace(traces[name][True]),
                                   "kept": _mean_trace(traces[name][False])}})
    return out


def _mean_trace(traces: Sequence[Sequence[Optional[float]]]) -> list[Optional[float]]:
    """Mean of the traces at each token position (over the traces that have a value there)."""
    out = []
    for pos in range(min(TRACE_POSITIONS, max((len(t) for t in traces), default=0))):
        vals = [t[pos] for t in traces if pos < len(t) and isinstance(t[pos], (int, float)) and math.isfinite(t[pos])]
        out.append(short(sum(vals) / len(vals)) if vals else None)
    return out


def step_share_by_position(run: Run) -> dict:
    """Committed steps by source at each step position of the trajectories (how the helper's
    share moves along a trajectory): {"positions": [...], "sources": {src: [count...]}}."""
    sources = list(run.proposers) + ["fallback"]
    longest = max((len(r.get("steps") or []) for r in run.records), default=0)
    counts = {s: [0] * longest for s in sources}
    for rec in run.records:
        for k, step in enumerate(rec.get("steps") or []):
            src = "fallback" if step.get("fallback") else step.get("source")
            counts.setdefault(src, [0] * longest)[k] += 1
    return {"positions": longest, "sources": {s: c for s, c in counts.items() if any(c)}}


def build_index(runs: Sequence[Run]) -> dict:
    """The viewer's index: runs, differing configuration fields, problems, pairs, signals."""
    paths = differing_paths([r.config for r in runs]) if len(runs) > 1 else []
    entries = []
    for i, r in enumerate(runs):
        m = r.metrics
        n, correct = m.get("n_problems", 0), m.get("n_correct", 0)
        entries.append({
            "index": i, "dir": r.label, "name": r.name, "variant": r.variant, "evictor": r.evictor,
            "budget": None if r.full_kv else r.budget, "n": r.n, "proposers": list(r.proposers),
            "complete": r.complete, "dataset": r.dataset_text(), "config": values_at(r.config, paths),
            "thresholds": configured_thresholds(r.config),
            "metrics": {"problems": n, "correct": correct, "accuracy": short(m.get("accuracy")),
                        "ci": [short(x) for x in wilson(correct, n)] if n else None,
                        "degeneration_rate": short(m.get("degeneration_rate")), "mean_steps": short(m.get("mean_steps")),
                        "mean_output_tokens": short(m.get("mean_output_tokens")),
                        "tokens_generated": {k: short(v) for k, v in (m.get("tokens_generated") or {}).items()},
                        "step_share": {k: short(v) for k, v in (m.get("step_share") or {}).items()},
                        "early_exit_fraction": short(m.get("early_exit_fraction"))},
            "recorded": {"signals": any(rec.get("signals") for rec in r.records),
                         "candidates": any(rec.get("all_candidates") for rec in r.records)},
            "problems": [problem_row(rec, r.proposers) for rec in r.records],
            "distributions": signal_distributions(r),
            "step_share_by_position": step_share_by_position(r),
        })
    pairs = []
    for i, a in enumerate(runs):
        for j, b in enumerate(runs):
            if i != j:
                summary = pair_summary(a, b)
                if summary is not None:
                    pairs.append({"a": i, "b": j, **summary})
    return {"config_paths": paths, "runs": entries, "pairs": pairs}


def run_details(run: Run) -> dict:
    """Per problem id: question, gold, prediction, the committed steps, and per step the
    candidates known (all of them with run.record_candidates; with run.record_signals only,
    those of the pruned proposers, without their text) with their signals."""
    problems = {}
    for rec in run.records:
        by_key: dict[tuple, dict] = {}
        for c in rec.get("all_candidates") or []:
            by_key[(c.get("step"), c.get("source"), c.get("index"))] = {
                "source": c.get("source"), "index": c.get("index"), "finish": c.get("finish"),
                "score": short(c.get("score")), "tokens": c.get("n_tokens"), "text": c.get("text"),
                "committed": bool(c.get("committed"))}
        for s in rec.get("signals") or []:
            key = (s.get("step"), s.get("source"), s.get("index"))
            entry = by_key.setdefault(key, {"source": s.get("source"), "index": s.get("index"),
                                            "finish": s.get("finish"), "committed": None})
            entry["signals"] = {name: [short(v) for v in trace] for name, trace in (s.get("signals") or {}).items()}
        steps: dict[int, list] = {}
        for (step, _, _), entry in sorted(by_key.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2])):
            steps.setdefault(step, []).append(entry)
        problems[rec["id"]] = {
            "question": rec.get("question"), "gold": rec.get("gold"), "prediction": rec.get("prediction"),
            "correct": bool(rec.get("correct")), "finish": rec.get("finish"),
            "steps": [{"text": s.get("text"), "source": s.get("source"), "score": short(s.get("score")),
                       "tokens": s.get("n_tokens"), "fallback": bool(s.get("fallback"))}
                      for s in rec.get("steps") or []],
            "candidates": [steps.get(k, []) for k in range(max(list(steps) + [len(rec.get("steps") or []) - 1]) + 1)]
            if steps else [],
        }
    return problems

