"""The tables of `kvflow report`, as plain data (`Table`), rendered to markdown or CSV.

Numbers stay numbers in the rows (CSV keeps full precision); `Table.markdown()` formats them.
Fractions (accuracy, rates, shares) are written as percentages in markdown. Runs are named by
their variant, evictor, budget and N, and by whatever else differs between runs of the same
variant, evictor and N (kvflow.report.labels): two runs that differ only by scorer are two rows
and two series, named by scorer.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from kvflow.report.labels import SeriesNames, series_names
from kvflow.results.runs import VARIANTS, Run
from kvflow.results.stats import mcnemar_exact, wilson


@dataclass
class Table:
    name: str  # file stem: <name>.csv
    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    percent: set[str] = field(default_factory=set)  # columns that hold fractions
    note: str = ""

    def csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(self.columns)
        for row in self.rows:
            w.writerow(["" if v is None else (round(v, 6) if isinstance(v, float) else v) for v in row])
        return buf.getvalue()

    def markdown(self) -> str:
        def cell(col: str, v: Any) -> str:
            if v is None:
                return "–"
            if isinstance(v, bool):
                return "yes" if v else "no"
            if isinstance(v, float):
                if col in self.percent:
                    return f"{v:.1%}"
                return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
            return str(v).replace("|", "\\|")

        lines = [f"### {self.title}", ""]
        if self.note:
            lines += [self.note, ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        numeric = [any(isinstance(row[i], (int, float)) and not isinstance(row[i], bool) for row in self.rows)
                   for i in range(len(self.columns))]
        lines.append("|" + "|".join("---:" if num else "---" for num in numeric) + "|")
        for row in self.rows:
            lines.append("| " + " | ".join(cell(c, v) for c, v in zip(self.columns, row)) + " |")
        return "\n".join(lines) + "\n"


def _sources(runs: Sequence[Run]) -> list[str]:
    return list(dict.fromkeys(p for r in runs for p in r.proposers))


def _pruners(runs: Sequence[Run]) -> list[str]:
    return list(dict.fromkeys(k for r in runs for k in (r.metrics.get("pruned_fraction") or {})))


def _budget_text(r: Run) -> str:
    return "full" if r.full_kv else str(r.budget)


def _interval(lo_hi: Optional[tuple[float, float]]) -> Optional[str]:
    return None if lo_hi is None else f"[{lo_hi[0]:.0%}, {lo_hi[1]:.0%}]"


def recovery_interval(rescue: dict[str, bool], evicted: dict[str, bool], full: dict[str, bool], ids: Sequence[str],
                      *, draws: int = 2000, seed: int = 0) -> Optional[tuple[float, float]]:
    """95% paired-bootstrap interval of the share recovered, (acc - acc_evicted) / (acc_full -
    acc_evicted): problems are resampled with replacement, the three runs' answers to a
    problem staying together; draws where nothing was lost are left out."""
    import random

    ids = list(ids)
    if not ids:
        return None
    rng = random.Random(seed)
    values = []
    for _ in range(draws):
        sample = [rng.choice(ids) for _ in ids]
        r, e, f = (sum(d[i] for i in sample) for d in (rescue, evicted, full))
        if f != e:
            values.append((r - e) / (f - e))
    if len(values) < draws // 2:
        return None
    values.sort()
    return (values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1])


def runs_table(runs: Sequence[Run], names: Optional[SeriesNames] = None) -> Table:
    names = names or series_names(runs)
    sources, pruners = _sources(runs), _pruners(runs)
    cols = ["run", "variant", "evictor", "budget", "N", "problems", "complete", "accuracy", "accuracy 95% CI",
            "degeneration rate", "mean steps", "mean output tokens"]
    cols += [f"tokens: {s}" for s in sources] + [f"step share: {s}" for s in sources]
    cols += [f"pruned: {p}" for p in pruners] + ["early-exit fraction"]
    with_recovery = any(r.metrics.get("recovery") is not None for r in runs)
    if with_recovery:
        cols.append("recovery")  # from run.baselines (metrics.json), when the run had them
    cols.append("differs by")  # what else tells it from runs of its variant, evictor and N (labels.py)
    t = Table("runs", "Runs", cols, percent={"accuracy", "degeneration rate", "early-exit fraction", "recovery"}
              | {f"step share: {s}" for s in sources} | {f"pruned: {p}" for p in pruners})
    for r in runs:
        m = r.metrics
        n_done = m.get("n_problems", 0)
        ci = wilson(int(m.get("n_correct", round((m.get("accuracy") or 0) * n_done))), n_done) if n_done else None
        if r.served:  # requests, not graded problems: no accuracy, no degeneration against a gold answer
            row = [r.label, r.variant, r.evictor, _budget_text(r), r.n, n_done, "served", None, None, None,
                   m.get("mean_steps"), m.get("mean_output_tokens")]
        else:
            row = [r.label, r.variant, r.evictor, _budget_text(r), r.n, n_done, r.complete, m.get("accuracy"),
                   _interval(ci), m.get("degeneration_rate"), m.get("mean_steps"), m.get("mean_output_tokens")]
        row += [(m.get("tokens_generated") or {}).get(s) if s in r.proposers else None for s in sources]
        row += [(m.get("step_share") or {}).get(s) if s in r.proposers else None for s in sources]
        row += [(m.get("pruned_fraction") or {}).get(p) for p in pruners]
        row.append(m.get("early_exit_fraction"))
        if with_recovery:
            row.append(m.get("recovery"))
        row.append(names.of(r) or None)
        t.rows.append(row)
    return t


def _wall_seconds(r: Run) -> Optional[float]:
    """Seconds from the run's start to its end (manifest; loading included), None if unknown."""
    from datetime import datetime

    try:
        start, end = (datetime.fromisoformat(r.manifest[k]) for k in ("started", "finished"))
    except (KeyError, TypeError, ValueError):
        return None
    return (end - start).total_seconds() or None


def _peak_kv_mib(r: Run) -> Optional[float]:
    """Peak KV bytes of one sequence in MiB: the evictor's `budget + buffer` tokens
    (manifest kv_memory), or for full KV the longest output of the run (its prompt where the
    records count it: `prompt_tokens`)."""
    kv = r._kv_memory()
    if kv.get("peak_bytes"):
        return kv["peak_bytes"] / 2**20
    per_token = kv.get("bytes_per_token")
    longest = max((int(x.get("prompt_tokens") or 0) + sum(int(st.get("n_tokens") or 0) for st in x.get("steps") or [])
                   for x in r.records), default=0)
    return per_token * longest / 2**20 if per_token and longest else None


def leaderboard(runs: Sequence[Run], names: Optional[SeriesNames] = None) -> Optional[Table]:
    """Evictors ranked by accuracy against the full-KV run of the same variant and N (the
    decode-time leaderboard, docs/leaderboard.md): Wilson interval, the exact McNemar test on
    the problems both answered (broken: right with full KV, wrong evicted; rescued: the
    reverse), output tokens and their inflation over full KV on the same problems, the share
    that hit the token cap, decode throughput (tokens / the run's wall time) and the peak KV
    of one sequence. None unless some variant and N has a full-KV run and evicted ones."""
    names = names or series_names(runs)
    groups: dict[tuple[str, int], list[Run]] = {}
    for r in runs:
        if not r.served:
            groups.setdefault((r.variant, r.n), []).append(r)
    t = Table("leaderboard", "Decode-time eviction leaderboard",
              ["rank", "evictor", "budget", "variant", "N", "problems", "accuracy", "accuracy 95% CI", "Δ vs full KV",
               "broken / rescued", "McNemar p", "mean output tokens", "length inflation", "hit token cap",
               "tokens/s", "peak KV MiB / seq"],
              percent={"accuracy", "Δ vs full KV", "hit token cap"},
              note="Each evicted run against the full-KV run of its variant and N, on the problems both answered; "
                   "broken = right with full KV and wrong evicted, rescued = the reverse; McNemar: exact two-sided "
                   "sign test on those. Length inflation = mean output tokens over full KV's on the same problems. "
                   "tokens/s = output tokens / the run's wall time (model loading included). Ranked within each "
                   "budget by accuracy, then fewer tokens.")
    for (variant, n), sel in groups.items():
        full = [r for r in sel if r.full_kv]
        evicted = [r for r in sel if not r.full_kv]
        if not full or not evicted:
            continue
        ref = full[-1]
        ref_ok = ref.correct_by_id()
        ref_tokens = {x["id"]: float(x.get("output_tokens") or sum(st.get("n_tokens") or 0 for st in x.get("steps") or []))
                      for x in ref.records}
        rows = []
        for r in [ref, *(e for e in evicted if e.records)]:  # a run that has answered nothing yet: no row
            ok = r.correct_by_id()
            common = [i for i in ok if i in ref_ok]
            done = len(r.records)
            correct = sum(ok.values())
            tokens = {x["id"]: float(x.get("output_tokens") or sum(st.get("n_tokens") or 0 for st in x.get("steps") or []))
                      for x in r.records}
            broken = sum(1 for i in common if ref_ok[i] and not ok[i])
            rescued = sum(1 for i in common if ok[i] and not ref_ok[i])
            base_tokens = sum(ref_tokens[i] for i in common)
            wall = _wall_seconds(r)
            capped = sum(1 for x in r.records if x.get("finish") in ("cap_tokens", "cap_steps")) / done if done else None
            label = "full KV (none)" if r.full_kv else r.evictor + (f" ({names.of(r)})" if names.of(r) else "")
            if not r.complete:
                label += " (unfinished)"  # its numbers rest on the problems it has answered so far
            rows.append([None, label, _budget_text(r), variant, n,
                         done, correct / done if done else None, _interval(wilson(correct, done)) if done else None,
                         sum(ok[i] - ref_ok[i] for i in common) / len(common) if common and r is not ref else None,
                         f"{broken} / {rescued}" if r is not ref else None,
                         round(mcnemar_exact(rescued, broken), 4) if r is not ref else None,
                         sum(tokens.values()) / done if done else None,
                         sum(tokens[i] for i in common) / base_tokens if base_tokens and r is not ref else None,
                         capped, sum(tokens.values()) / wall if wall else None, _peak_kv_mib(r)])
        # full KV first, then one ranking per budget ("which method loses least at budget B")
        budget_order = lambda row: -1 if row[2] == "full" else int(row[2]) if str(row[2]).isdigit() else 10**9
        rows.sort(key=lambda row: (budget_order(row), -(row[6] or 0), row[11] or 0))
        rank, last_budget = 0, None
        for row in rows:
            if row[2] == "full":
                continue
            rank = 1 if row[2] != last_budget else rank + 1
            row[0], last_budget = rank, row[2]
        t.rows.extend(rows)
    cpus = {_cpu_text(r) for r in runs if not r.served}
    if len(cpus) > 1:  # bf16 rounds differently on other CPUs: per-problem pairs then mix machine and method
        t.note += (" These runs computed on different CPUs (" + "; ".join(sorted(cpus)) + "): a problem's "
                   "tokens can differ between CPUs at the last bit of bf16, so per-problem pairs mix the two.")
    return t if t.rows else None


def _cpu_text(run: Run) -> str:
    """manifest.json's `cpu` in words ("not recorded" for runs from before kvflow recorded it)."""
    cpu = run.manifest.get("cpu") or {}
    if not cpu.get("model"):
        return "not recorded"
    return f"{cpu['model']}, bf16 matmul {cpu.get('bf16_matmul') or 'none'}"


def served_table(runs: Sequence[Run], names: Optional[SeriesNames] = None) -> Optional[Table]:
    """Served traffic (`kvflow serve --record` directories): requests answered, by endpoint and
    finish reason, prompt and completion tokens, tokens generated and committed steps by
    proposer, latency (arrival to the trajectory's end) p50 / p95. None without a served run."""
    served = [r for r in runs if r.served]
    if not served:
        return None
    sources = _sources(served)
    cols = ["run", "requests", "chat / completion", "finish: stop / length", "prompt tokens", "completion tokens"]
    cols += [f"tokens: {s}" for s in sources] + [f"steps: {s}" for s in sources] + ["latency p50 s", "latency p95 s"]
    t = Table("served", "Served requests", cols)
    for r in served:
        recs = r.records
        facts = [x.get("served") or {} for x in recs]
        walls = sorted(float(x.get("seconds") or 0.0) for x in recs)  # arrival to the trajectory's end
        steps = {s: sum(1 for x in recs for st in x.get("steps") or [] if st.get("source") == s) for s in sources}
        tokens = {s: sum((x.get("tokens_generated") or {}).get(s, 0) for x in recs) for s in sources}
        kinds = [f.get("endpoint") for f in facts]
        finish = [f.get("finish_reason") for f in facts]
        row = [r.label, len(recs), f"{kinds.count('chat')} / {kinds.count('completion')}",
               f"{finish.count('stop')} / {finish.count('length')}", sum(f.get("prompt_tokens") or 0 for f in facts),
               sum(f.get("completion_tokens") or 0 for f in facts)]
        row += [tokens[s] for s in sources] + [steps[s] for s in sources]
        row += [_quantile(walls, 0.5), _quantile(walls, 0.95)]
        t.rows.append(row)
    return t


def _quantile(values: Sequence[float], q: float) -> Optional[float]:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def accuracy_vs_budget(runs: Sequence[Run], names: Optional[SeriesNames] = None) -> Table:
    names = names or series_names(runs)
    budgets = sorted({r.budget for r in runs if not r.full_kv and r.budget is not None})
    order = {v: i for i, v in enumerate(VARIANTS)}
    series = {r.path: names.series(r) for r in runs}
    first = {}
    for r in runs:
        first.setdefault(series[r.path], r)
    methods = sorted(first, key=lambda m: (first[m].full_kv, order.get(first[m].variant, 99), m))
    cols = ["method", "N"] + [f"B={b}" for b in budgets] + ["full KV"]
    t = Table("accuracy_vs_budget", "Accuracy vs KV budget", cols, percent=set(cols[2:]),
              note="One row per method (ablation variant / evictor, and the configuration fields that tell "
                   "runs of one variant, evictor and N apart) and N; full-KV runs in the last column.")
    keys = sorted({(series[r.path], r.n) for r in runs}, key=lambda k: (methods.index(k[0]), k[1]))
    for method, n in keys:
        sel = [r for r in runs if series[r.path] == method and r.n == n]
        row: list[Any] = [method, n]
        for b in budgets:
            accs = [r.metrics.get("accuracy") for r in sel if r.budget == b and not r.full_kv]
            row.append(accs[-1] if accs else None)
        full = [r.metrics.get("accuracy") for r in sel if r.full_kv]
        row.append(full[-1] if full else None)
        t.rows.append(row)
    return t


def decode_cost(runs: Sequence[Run], names: Optional[SeriesNames] = None) -> Table:
    names = names or series_names(runs)
    cols = ["run", "variant", "budget", "N", "mean steps", "mean output tokens", "base tokens", "helper tokens",
            "total tokens"]
    t = Table("decode_cost", "Decode cost per problem", cols,
              note="Tokens generated per problem (all candidates, pruned ones included); base = the first "
                   "proposer, helper = all others.")
    for r in runs:
        tg = r.metrics.get("tokens_generated") or {}
        base = tg.get(r.proposers[0]) if r.proposers else None
        helper = sum(tg.get(p, 0.0) for p in r.proposers[1:]) if len(r.proposers) > 1 else None
        total = sum(tg.values()) if tg else None
        t.rows.append([r.label, names.variant(r), _budget_text(r), r.n, r.metrics.get("mean_steps"),
                       r.metrics.get("mean_output_tokens"), base, helper, total])
    return t


def ablation(runs: Sequence[Run], names: Optional[SeriesNames] = None) -> Table:
    """Paper-style ablation rows (METHODS.md §9): per budget and N, the variants in order, then full KV."""
    names = names or series_names(runs)
    cols = ["budget", "N", "variant", "accuracy", "degenerate", "base tokens", "steps", "base candidates exited",
            "run"]
    t = Table("ablation", "Ablation", cols, percent={"accuracy", "degenerate", "base candidates exited"},
              note="Degenerate = an incorrect trajectory that hit the step or token cap.")
    order = {v: i for i, v in enumerate(VARIANTS)}

    def key(r: Run):
        return (r.full_kv, r.budget or 0, r.n, order.get(r.variant, 99), r.label)

    for r in sorted(runs, key=key):
        tg = r.metrics.get("tokens_generated") or {}
        t.rows.append([_budget_text(r), r.n, names.variant(r) + (" (full KV)" if r.full_kv else ""),
                       r.metrics.get("accuracy"), r.metrics.get("degeneration_rate"),
                       tg.get(r.proposers[0]) if r.proposers else None, r.metrics.get("mean_steps"),
                       r.metrics.get("early_exit_fraction") if r.base_pruners else None, r.label])
    return t


def step_share(runs: Sequence[Run], names: Optional[SeriesNames] = None) -> Optional[Table]:
    multi = [r for r in runs if len(r.proposers) > 1]
    if not multi:
        return None
    names = names or series_names(runs)
    sources = _sources(multi)
    cols = ["N", "budget", "variant"] + [f"share: {s}" for s in sources] + ["run"]
    t = Table("step_share", "Committed-step share by source", cols, percent={f"share: {s}" for s in sources},
              note="Fraction of committed steps that came from each proposer, by base N and budget.")
    for r in sorted(multi, key=lambda r: (r.n, r.full_kv, r.budget or 0, r.label)):
        share = r.metrics.get("step_share") or {}
        t.rows.append([r.n, _budget_text(r), names.variant(r)] + [share.get(s) if s in r.proposers else None
                                                            for s in sources] + [r.label])
    return t


@dataclass
class Oracle:
    evicted: Run
    helper: Run
    full: Optional[Run]
    ids: list[str]
    acc_evicted: float
    acc_helper: float
    acc_oracle: float
    acc_full: Optional[float]

    @property
    def recovered(self) -> Optional[float]:
        return recovery(self.acc_oracle, self.acc_evicted, self.acc_full)


def recovery(acc: Optional[float], acc_evicted: float, acc_full: Optional[float]) -> Optional[float]:
    """Share of the full-vs-evicted gap recovered: (acc − acc_evicted) / (acc_full − acc_evicted)."""
    if acc is None or acc_full is None or acc_full == acc_evicted:
        return None
    return (acc - acc_evicted) / (acc_full - acc_evicted)


def oracle(evicted: Run, helper: Run, full: Optional[Run], within: Optional[set[str]] = None) -> Oracle:
    """Answer-level oracle on the problems all three runs finished (and in `within`, if given)."""
    from kvflow.errors import UserError

    ev, hp = evicted.correct_by_id(), helper.correct_by_id()
    ids = [i for i in ev if i in hp and (within is None or i in within)]
    fl = full.correct_by_id() if full else None
    if fl is not None:
        ids = [i for i in ids if i in fl]
    if not ids:
        raise UserError("oracle: the runs share no problem ids",
                        hint="--oracle-evicted, --oracle-helper and --oracle-full must cover the same problems")

    def acc(d: dict[str, bool]) -> float:
        return sum(d[i] for i in ids) / len(ids)

    return Oracle(evicted, helper, full, ids, acc(ev), acc(hp), sum(ev[i] or hp[i] for i in ids) / len(ids),
                  acc(fl) if fl is not None else None)


def oracle_table(o: Oracle, runs: Sequence[Run], names: Optional[SeriesNames] = None) -> Table:
    names = names or series_names(runs)
    cols = ["what", "accuracy", "gap recovered", "run"]
    n = len(o.ids)
    t = Table("oracle", f"Oracle analysis ({n} common problems)", cols, percent={"accuracy", "gap recovered"},
              note="Oracle = correct when the evicted base or the full-KV helper is correct (answer level). "
                   "Gap recovered = (accuracy − evicted) / (full − evicted), all on the common problems.")
    t.rows.append(["evicted base", o.acc_evicted, 0.0 if o.acc_full is not None else None, o.evicted.label])
    t.rows.append(["full-KV helper", o.acc_helper, recovery(o.acc_helper, o.acc_evicted, o.acc_full), o.helper.label])
    t.rows.append(["oracle (evicted or helper)", o.acc_oracle, o.recovered, ""])
    if o.full is not None:
        t.rows.append(["full-KV base", o.acc_full, 1.0 if o.acc_full != o.acc_evicted else None, o.full.label])
    ids = set(o.ids)
    special = {o.evicted.path, o.helper.path} | ({o.full.path} if o.full else set())
    for r in runs:
        if r.path in special:
            continue
        d = r.correct_by_id()
        if not ids <= set(d):
            continue
        acc = sum(d[i] for i in o.ids) / n
        t.rows.append([f"{names.variant(r)} ({_budget_text(r)})", acc, recovery(acc, o.acc_evicted, o.acc_full), r.label])
    return t


def rescue_table(runs: Sequence[Run], names: Optional[SeriesNames] = None) -> Optional[Table]:
    """The paper's Table 2 form: per KV-Rescue run, its full-KV and evicted best-of-N baselines
    (same evictor, budget and N), what eviction lost and what KV-Rescue won back.

    Every number of a row is computed on the problems that all of its runs finished, so
    partial runs compare fairly. `oracle recovered` needs a helper-only run; `saved by early
    exit` needs an interleave-only run of the same setting."""
    rescues = [r for r in runs if r.variant == "interleave + early exit" and not r.full_kv]
    if not rescues:
        return None
    names = names or series_names(runs)
    cols = ["setting", "problems", "full KV", "evicted", "KV-Rescue", "KV-Rescue 95% CI", "lost to eviction",
            "recovered", "recovered 95% CI", "oracle recovered", "oracle 95% CI", "base tokens saved",
            "saved by early exit", "degenerate: evicted", "degenerate: KV-Rescue", "helper steps",
            "base candidates exited", "baselines"]
    t = Table("rescue", "KV-Rescue vs eviction (the paper's Table 2 form)", cols,
              percent=set(cols[2:]) - {"KV-Rescue 95% CI", "recovered 95% CI", "oracle 95% CI", "baselines"},
              note="Per KV-Rescue run: full KV and evicted = best-of-N runs with the same N (evicted: same "
                   "evictor and budget), or of another N when there is none (`baselines` says which N). "
                   "Intervals: Wilson for accuracy, paired bootstrap over problems for the shares recovered. Lost = full − evicted; recovered = (KV-Rescue − evicted) / lost; "
                   "oracle recovered = the same for an answer-level pick that is right when the evicted base "
                   "or the helper-only run is; base tokens saved = 1 − KV-Rescue's base tokens / best-of-N's; "
                   "saved by early exit = 1 − KV-Rescue's / interleave-only's; degenerate = incorrect and at the "
                   "step or token cap; helper steps = share of committed steps from the helper. All on the "
                   "problems every run of the row finished.")

    def pick(pred) -> Optional[Run]:
        sel = [r for r in runs if pred(r)]
        return sel[-1] if sel else None

    for rescue in sorted(rescues, key=lambda r: (r.evictor, r.budget or 0, r.n, r.label)):
        same = (lambda r: r.evictor == rescue.evictor and r.budget == rescue.budget and r.n == rescue.n
                and not r.full_kv)
        same_any_n = (lambda r: r.evictor == rescue.evictor and r.budget == rescue.budget and not r.full_kv)
        evicted = pick(lambda r: r.variant == "best-of-N" and same(r)) or \
            pick(lambda r: r.variant == "best-of-N" and same_any_n(r))
        full = pick(lambda r: r.variant == "best-of-N" and r.full_kv and r.n == rescue.n) or \
            pick(lambda r: r.variant == "best-of-N" and r.full_kv)
        interleave = pick(lambda r: r.variant == "interleave" and same(r))
        helper = pick(lambda r: r.variant == "helper only")
        row_runs = [x for x in (rescue, evicted, full, interleave, helper) if x is not None]
        ids = set.intersection(*(set(x.correct_by_id()) for x in row_runs))
        setting = f"{rescue.evictor} B={_budget_text(rescue)} N={rescue.n}"
        if names.of(rescue):  # what tells it from the other KV-Rescue runs of this evictor and N
            setting += f" ({names.of(rescue)})"
        if not ids:
            t.rows.append([setting, 0] + [None] * (len(cols) - 2))
            continue
        m = {name: (x.metrics_on(ids) if x is not None else None)
             for name, x in (("rescue", rescue), ("evicted", evicted), ("full", full), ("interleave", interleave))}

        def get(name: str, key: str) -> Optional[float]:
            return m[name].get(key) if m[name] is not None else None

        acc_r, acc_e, acc_f = get("rescue", "accuracy"), get("evicted", "accuracy"), get("full", "accuracy")
        lost = acc_f - acc_e if acc_f is not None and acc_e is not None else None
        oracle_rec = oracle(evicted, helper, full, within=ids).recovered if helper and evicted else None
        base_r, base_e, base_i = (get("rescue", "mean_base_tokens"), get("evicted", "mean_base_tokens"),
                                  get("interleave", "mean_base_tokens"))
        sorted_ids = sorted(ids)
        rc, ec = rescue.correct_by_id(), evicted.correct_by_id() if evicted else None
        fc = full.correct_by_id() if full else None
        rec_ci = recovery_interval(rc, ec, fc, sorted_ids) if ec is not None and fc is not None else None
        oracle_ci = None
        if helper and ec is not None and fc is not None:
            hc = helper.correct_by_id()
            oracle_ci = recovery_interval({i: ec[i] or hc[i] for i in sorted_ids}, ec, fc, sorted_ids)
        baselines = ", ".join(f"{name} N={x.n}" for name, x in (("full", full), ("evicted", evicted)) if x is not None)
        t.rows.append([
            setting, len(ids), acc_f, acc_e, acc_r, _interval(wilson(sum(rc[i] for i in ids), len(ids))), lost,
            recovery(acc_r, acc_e, acc_f) if acc_e is not None else None, _interval(rec_ci), oracle_rec,
            _interval(oracle_ci),
            1 - base_r / base_e if base_r is not None and base_e else None,
            1 - base_r / base_i if base_r is not None and base_i else None,
            get("evicted", "degeneration_rate"), get("rescue", "degeneration_rate"),
            sum((m["rescue"].get("step_share") or {}).get(p, 0.0) for p in rescue.proposers[1:]),
            get("rescue", "early_exit_fraction"), baselines,
        ])
    return t
