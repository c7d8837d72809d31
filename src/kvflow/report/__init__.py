"""`kvflow report`: results directories -> markdown and CSV tables and PNG plots (DESIGN.md §8).

    kvflow report results/*  [--out report/] [--csv] [--allow-mixed]
                  [--oracle-evicted DIR --oracle-helper DIR [--oracle-full DIR]]

Tables (each also a CSV under --out):
- `runs`: per run, accuracy, degeneration rate, mean steps and output tokens, tokens per
  proposer, committed-step share, pruned fraction per pruner, early-exit fraction;
- `accuracy_vs_budget`: method (ablation variant / evictor) × budget, full KV last;
- `decode_cost`: steps, output length, base and helper tokens per problem;
- `ablation`: the paper's ablation rows (best-of-N, early exit, interleave, both, full KV);
- `served` (with a `kvflow serve --record` directory): requests by endpoint and finish
  reason, prompt and completion tokens, tokens and committed steps by proposer, latency; such
  a run is "served" in `runs`, with no accuracy (its requests have no gold answer);
- `step_share`: committed-step share by source, by N and budget (runs with a helper);
- `rescue` (with a KV-Rescue run): the paper's Table 2 form, per KV-Rescue run against its
  full-KV and evicted best-of-N baselines: accuracy lost to eviction, share recovered, the
  answer-level oracle's share (with a helper-only run), base tokens saved (overall and by
  early exit, with an interleave-only run), degeneration rates, helper step share;
- `oracle` (with the --oracle-* flags): answer-level oracle of an evicted-base run and a
  full-KV helper run (correct if either is), and the share of the full-vs-evicted gap it
  and every other run over the same problems recover.

Plots under --out: accuracy_vs_budget.png, step_share.png, decode_cost.png (full-KV
baselines dashed). Series and rows are named by variant, evictor, budget and N and by any
other configuration field that differs between runs of one variant, evictor and N
(kvflow.report.labels), so no two runs are ever merged into one series. Runs over different problem sets (dataset, offset, limit, shuffle seed)
are refused unless --allow-mixed. Nothing here writes into a results directory.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from kvflow.errors import UserError
from kvflow.report.labels import series_names
from kvflow.results.runs import Run, check_same_dataset, expand_dirs, load_run
from kvflow.report import tables as T

__all__ = ["Run", "build_tables", "load_runs", "report_command"]


def load_runs(args: Sequence[str], *, strict: bool = False) -> list[Run]:
    """The runs of the given directories. One that cannot be read is skipped with a warning
    naming it and why (with `strict`, every such problem is an error instead)."""
    runs, problems = [], []
    for path in expand_dirs(args):
        try:
            runs.append(load_run(path))
        except UserError as e:
            if strict:
                problems.extend(e.problems)
                continue
            print(f"kvflow: skipping {path}: {e.problems[0].format() if e.problems else e}", file=sys.stderr)
    if problems:
        raise UserError(problems)
    if args and not runs:
        raise UserError("no readable results directory among the arguments", hint="see the warnings above")
    return runs


def build_tables(runs: Sequence[Run], oracle: Optional[T.Oracle] = None) -> list[T.Table]:
    names = series_names(runs)  # one naming for every table and plot of the report
    tables = [T.runs_table(runs, names), T.accuracy_vs_budget(runs, names), T.decode_cost(runs, names),
              T.ablation(runs, names)]
    for extra in (T.leaderboard(runs, names), T.served_table(runs, names), T.step_share(runs, names),
                  T.rescue_table(runs, names)):
        if extra is not None:
            tables.append(extra)
    if oracle is not None:
        tables.append(T.oracle_table(oracle, runs, names))
    return tables


def report_command(
    dirs: Sequence[str],
    *,
    out: Optional[Path] = None,
    allow_mixed: bool = False,
    oracle_evicted: Optional[str] = None,
    oracle_helper: Optional[str] = None,
    oracle_full: Optional[str] = None,
    as_csv: bool = False,
    strict: bool = False,
    limit: Optional[int] = None,
    echo: Callable[[str], None] = print,
) -> list[T.Table]:
    if bool(oracle_evicted) != bool(oracle_helper):
        raise UserError("the oracle needs both --oracle-evicted DIR and --oracle-helper DIR",
                        hint="--oracle-full DIR is optional (it adds the gap recovered)")
    if oracle_full and not oracle_evicted:
        raise UserError("--oracle-full needs --oracle-evicted and --oracle-helper")
    if out is not None:
        check_output_dir(Path(out), "--out")  # before reading anything
    special = [d for d in (oracle_evicted, oracle_helper, oracle_full) if d]
    if not dirs and not special:
        raise UserError("no results directories given", hint="kvflow report results/*")
    if limit is not None and limit < 1:
        raise UserError(f"--limit {limit}: must be at least 1")
    runs = load_runs(dirs, strict=strict) if dirs else []
    if limit is not None:
        runs = [r.prefix(limit) for r in runs]
    by_path = {r.path: r for r in runs}

    def one(arg: str, flag: str) -> Run:
        paths = expand_dirs([arg])
        if len(paths) != 1:
            raise UserError(f"{flag} {arg}: expected one results directory, found {len(paths)}")
        if paths[0] not in by_path:
            run = load_run(paths[0])
            by_path[paths[0]] = run.prefix(limit) if limit is not None else run
            runs.append(by_path[paths[0]])
        return by_path[paths[0]]

    oracle = None
    if oracle_evicted:
        ev, hp = one(oracle_evicted, "--oracle-evicted"), one(oracle_helper, "--oracle-helper")
        fl = one(oracle_full, "--oracle-full") if oracle_full else None
    if not allow_mixed:
        check_same_dataset(runs)
    if oracle_evicted:
        oracle = T.oracle(ev, hp, fl)
    empty = [r.label for r in runs if not r.records]
    if empty:
        print(f"kvflow: no finished problems yet in: {', '.join(empty)}", file=sys.stderr)
    tables = build_tables(runs, oracle)
    if as_csv:
        echo(tables[0].csv().rstrip("\n"))
    else:
        echo(render_markdown(runs, tables).rstrip("\n"))
    if out is not None:
        written = write_outputs(Path(out), runs, tables)
        print(f"kvflow: wrote {len(written)} files to {out}/", file=sys.stderr)
    return tables


def check_output_dir(out: Path, flag: str) -> None:
    """Create `out` (a directory for outputs) or say clearly why it cannot be (exit 2)."""
    from kvflow.outputs import output_dir_problem

    why = output_dir_problem(out, create=True)
    if why:
        raise UserError(f"{flag} {out}: {why}", hint="pick a directory you can write to")


def render_markdown(runs: Sequence[Run], tables: Sequence[T.Table], plots: Sequence[Path] = ()) -> str:
    datasets = sorted({r.dataset_text() for r in runs})
    parts = ["# kvflow report", "", f"{len(runs)} run(s); problems: {'; '.join(datasets)}", ""]
    for t in tables:
        parts.append(t.markdown())
    for p in plots:
        parts.append(f"![{p.stem}]({p.name})\n")
    return "\n".join(parts)


def write_outputs(out: Path, runs: Sequence[Run], tables: Sequence[T.Table]) -> list[Path]:
    from kvflow.report import plots as P

    check_output_dir(out, "--out")
    written: list[Path] = []
    for t in tables:
        path = out / f"{t.name}.csv"
        path.write_text(t.csv(), encoding="utf-8")
        written.append(path)
    names = series_names(runs)
    pngs = [p for p in (P.accuracy_vs_budget(runs, out / "accuracy_vs_budget.png", names),
                        P.step_share(runs, out / "step_share.png", names),
                        P.decode_cost(runs, out / "decode_cost.png", names)) if p is not None]
    md = out / "report.md"
    md.write_text(render_markdown(runs, tables, pngs), encoding="utf-8")
    return written + pngs + [md]
