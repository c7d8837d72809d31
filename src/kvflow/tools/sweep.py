"""`kvflow run FILE --sweep PATH=V1,V2,... [--sweep ...]`: a grid of runs (DESIGN.md §5).

Each `--sweep` names a dotted path and a comma-separated list of YAML values; the grid is
their cross product (the first `--sweep` varies slowest). A point is the pipeline with the
run's own `--set`s followed by one `--set PATH=VALUE` per sweep, so it has its own config hash
and its own results directory (`<output>/<name>__<hash>/`). Commas inside brackets, braces
or quotes do not split values: `--sweep 'proposers.base.pruners=[],[{kind: gzip}]'`.

Every point is validated before any runs; all problems are reported at once, each naming the
points it applies to. Points whose results directory is complete are skipped (unless
`--force`); an interrupted sweep resumes where it stopped, like a single run.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from kvflow.config.loader import format_path, parse_path
from kvflow.errors import ConfigProblem, UserError
from kvflow.runtime.progress import Progress, Tally, clock_text
from kvflow.results.files import ResultsDir

SWEEP_FILE = "<--sweep>"


@dataclass(frozen=True)
class Axis:
    path: str  # as written (dotted)
    values: tuple[str, ...]  # raw YAML texts


@dataclass
class Point:
    index: int
    settings: tuple[tuple[str, str], ...]  # (path, raw value) per axis
    names: tuple[str, ...] = ()  # short, unique names of the axes (for labels)
    loaded: object = None  # LoadedPipeline once validated

    @property
    def label(self) -> str:
        names = self.names or tuple(p for p, _ in self.settings)
        return " ".join(f"{n}={v}" for n, (_, v) in zip(names, self.settings))

    @property
    def sets(self) -> list[str]:
        return [f"{p}={v}" for p, v in self.settings]


def split_values(text: str) -> list[str]:
    """Split on commas outside brackets, braces and quotes."""
    out, depth, quote, cur = [], 0, None, []
    for ch in text:
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur).strip())
    return out


def parse_sweeps(specs: Iterable[str]) -> list[Axis]:
    """``["a.b=1,2", "c=x"]`` -> axes. Raises UserError listing every malformed spec."""
    axes: list[Axis] = []
    problems: list[ConfigProblem] = []
    seen: dict[tuple, str] = {}
    for spec in specs:
        key, eq, raw = spec.partition("=")
        key = key.strip()
        if not eq or not key:
            problems.append(ConfigProblem(SWEEP_FILE, 0, key, "expected PATH=VALUE1,VALUE2,...",
                                          "e.g. --sweep proposers.base.evictor.budget=64,128,256"))
            continue
        try:
            parts = parse_path(key)
        except ValueError as e:
            problems.append(ConfigProblem(SWEEP_FILE, 0, key, str(e)))
            continue
        values = split_values(raw)
        if any(v == "" for v in values):
            problems.append(ConfigProblem(SWEEP_FILE, 0, key, f"empty value in '{raw}'",
                                          "separate values with single commas: 64,128,256"))
            continue
        if len(set(values)) != len(values):
            problems.append(ConfigProblem(SWEEP_FILE, 0, key, f"repeated value in '{raw}'"))
            continue
        if parts in seen:
            problems.append(ConfigProblem(SWEEP_FILE, 0, key, "swept twice", "give all its values in one --sweep"))
            continue
        seen[parts] = key
        axes.append(Axis(format_path(parts), tuple(values)))
    if problems:
        raise UserError(problems)
    return axes


def with_file_axes(file, axes: Sequence[Axis], sets: Sequence[str] = (), unsets: Sequence[str] = (),
                   registry=None) -> list[Axis]:
    """The pipeline file's own `sweep:` axes (in its order), each replaced by a --sweep on the
    same path, then the --sweep axes it does not have."""
    import yaml

    from kvflow.config.validate import load_pipeline

    own = load_pipeline(file, sets=sets, unsets=unsets, registry=registry).pipeline.sweep
    given = {a.path: a for a in axes}
    out = []
    for path, values in own.items():
        key = format_path(parse_path(path))
        texts = tuple(yaml.safe_dump(v, default_flow_style=True, width=10**6).strip().removesuffix("\n...")
                      .removesuffix("...").strip() for v in values)
        out.append(given.pop(key, Axis(key, texts)))
    return out + [a for a in axes if a.path in given]


def _unbounded_evictor_settings(point: Point) -> set[str]:
    """The settings of a point that only set fields of a proposer's evictor that keeps every
    token (`none`: its budget, buffer, window are unused), so that its points at several budgets
    are one run."""
    loaded = point.loaded
    drop = set()
    for name, comps in loaded.components.proposers.items():
        if getattr(comps.evictor.cls, "bounded", True):
            continue
        prefix = f"proposers.{name}.evictor."
        drop |= {path for path, _ in point.settings if path.startswith(prefix) and path != prefix + "kind"}
    return drop


def expand(axes: Sequence[Axis]) -> list[Point]:
    """The cross product of the axes, first axis slowest."""
    combos = itertools.product(*[[(a.path, v) for v in a.values] for a in axes])
    names = short_names([a.path for a in axes])
    return [Point(i, tuple(c), names) for i, c in enumerate(combos)]


def short_names(paths: Sequence[str]) -> tuple[str, ...]:
    """The shortest dotted suffix of each path that no other path ends with:
    proposers.base.n, proposers.helper.n -> base.n, helper.n."""
    parts = [parse_path(p) for p in paths]
    out = []
    for i, p in enumerate(parts):
        for k in range(1, len(p) + 1):
            if not any(j != i and q[-k:] == p[-k:] for j, q in enumerate(parts)):
                break
        out.append(format_path(p[-k:]))
    return tuple(out)


def load_points(file, axes: Sequence[Axis], sets: Sequence[str] = (), unsets: Sequence[str] = (),
                registry=None) -> list[Point]:
    """Validate every point (nothing runs). Raises one UserError with every problem, each
    problem once, naming the sweep points it occurs in unless it occurs in all of them."""
    from kvflow.config.validate import load_pipeline
    from kvflow.runtime.runner import results_path

    points = expand(axes)
    found: dict[ConfigProblem, list[str]] = {}
    for point in points:
        try:
            point.loaded = load_pipeline(file, sets=[*sets, *point.sets], unsets=unsets, registry=registry)
        except UserError as e:
            for p in e.problems:
                found.setdefault(p, []).append(point.label)
    if found:
        problems = []
        for p, labels in found.items():
            if len(labels) < len(points):
                p = ConfigProblem(p.file, p.line, p.path, f"{p.message} (sweep point{'s' if len(labels) > 1 else ''} "
                                  f"{'; '.join(labels)})", p.hint)
            problems.append(p)
        raise UserError(problems)
    points = _merge_full_kv(file, points, sets, unsets, registry)
    by_dir: dict[Path, list[str]] = {}
    for point in points:
        by_dir.setdefault(results_path(point.loaded), []).append(point.label)
    clashes = [labels for labels in by_dir.values() if len(labels) > 1]
    if clashes:
        raise UserError([ConfigProblem(SWEEP_FILE, 0, "", f"points {' and '.join(c)} give the same pipeline",
                                       "drop the duplicate value") for c in clashes])
    return points


def _merge_full_kv(file, points: list[Point], sets, unsets, registry) -> list[Point]:
    """Points whose evictor keeps every token lose their settings of its unused fields (a
    budget axis), and those left equal to an earlier point are dropped: full KV runs once."""
    from kvflow.config.validate import load_pipeline

    out: list[Point] = []
    seen: set[tuple] = set()
    for point in points:
        drop = _unbounded_evictor_settings(point)
        if drop:
            kept = tuple((p, v) for p, v in point.settings if p not in drop)
            loaded = load_pipeline(file, sets=[*sets, *(f"{p}={v}" for p, v in kept)], unsets=unsets,
                                   registry=registry)
            point = Point(point.index, kept, tuple(n for n, (p, _) in zip(point.names, point.settings)
                                                   if p not in drop), loaded)
        key = point.settings
        if key in seen:
            continue
        seen.add(key)
        out.append(point)
    return out


def run_sweep(file, sweeps: Sequence[str], *, sets: Sequence[str] = (), unsets: Sequence[str] = (),
              force: bool = False, registry=None, say: Optional[Callable[[str], None]] = None,
              ray_address: Optional[str] = None) -> int:
    """Validate all points, then run each (skipping complete ones). Returns the worst exit code.
    With `run.executor: ray` the points share one pool of Ray workers (`_run_on_ray`)."""
    from kvflow.runtime import runner

    say = say or (lambda m: print(f"kvflow: {m}", file=sys.stderr, flush=True))
    axes = with_file_axes(file, parse_sweeps(sweeps), sets, unsets, registry)
    if not axes:
        raise UserError([ConfigProblem(SWEEP_FILE, 0, "", "nothing to sweep", "give --sweep PATH=V1,V2 or a "
                                                                               "`sweep:` mapping in the pipeline")])
    points = load_points(file, axes, sets, unsets, registry)
    total = len(points)
    say(f"sweep: {total} point(s) over {', '.join(a.path for a in axes)}")
    if ray_address or any(p.loaded.pipeline.run.executor == "ray" for p in points):
        return _run_on_ray(points, force=force, registry=registry, say=say, ray_address=ray_address)
    code = 0
    rows = []
    complete = {point.index for point in points if not force and _complete(point.loaded)}
    with Progress(total, title="sweep") as bar:
        pace = Tally(total - len(complete))  # the ETA counts the points that run
        for i, point in enumerate(points, 1):
            path = runner.results_path(point.loaded)
            status = "skipped (complete)" if point.index in complete else None
            bar.update(i - 1, f"{point.label}; ETA {clock_text(pace.eta())}")
            if status is None:
                say(f"sweep [{i}/{total}] {point.label}: running -> {path}")
                rc = int(runner.run_pipeline(point.loaded, force=force, registry=registry, quiet=True) or 0)
                code = max(code, rc)
                status = "done" if rc == 0 else f"failed (exit {rc})"
                pace.add()
                accuracy = (ResultsDir(path).metrics() or {}).get("accuracy")
                say(f"sweep [{i}/{total}] {point.label}: {status}"
                    + (f", accuracy {accuracy:.1%}" if isinstance(accuracy, (int, float)) else "")
                    + f"; {pace.done}/{pace.total} run, ETA {clock_text(pace.eta())}")
            else:
                say(f"sweep [{i}/{total}] {point.label}: {status} {path}")
            rows.append((point, path, status))
            bar.update(i, f"{point.label}; ETA {clock_text(pace.eta())}")
    _print_summary(rows)
    return code


def _run_on_ray(points: list[Point], *, force: bool, registry, say, ray_address: Optional[str]) -> int:
    """Every point that is not complete runs at once on one pool of Ray workers
    (kvflow.runtime.ray_executor): a worker whose point has no problems left takes another's."""
    from kvflow.runtime import ray_executor, runner

    executors = {p.loaded.pipeline.run.executor for p in points}
    if executors != {"ray"}:
        first = points[0].loaded
        raise UserError(first.problem("run.executor", "--ray-address is given, but the run's executor is local"
                                      if executors == {"local"} else "the points of a sweep run on one executor",
                                      "set run.executor=ray for all of them (docs/cluster.md)"))
    ray_executor.check(points[0].loaded, ray_address)  # before anything is written
    total = len(points)
    todo = []
    for i, point in enumerate(points, 1):
        if not force and _complete(point.loaded):
            say(f"sweep [{i}/{total}] {point.label}: skipped (complete) {runner.results_path(point.loaded)}")
        else:
            todo.append((i, point))
    def run_point(point, decode) -> int:
        return runner.run_pipeline(point.loaded, force=force, registry=registry, quiet=True, decode=decode)

    status = ray_executor.run_sweep_points(todo, total, run_point=run_point, flag=ray_address,
                                           say=say) if todo else {}
    rows = [(p, runner.results_path(p.loaded), status.get(p.index, "skipped (complete)")) for p in points]
    _print_summary(rows)
    return 0 if all(s in ("done", "skipped (complete)") for _, _, s in rows) else 1


def _complete(loaded) -> bool:
    """Complete = metrics.json written and every problem of the dataset recorded."""
    from kvflow.results.files import ResultsDir
    from kvflow.runtime.runner import load_dataset, results_path

    store = ResultsDir(results_path(loaded))
    metrics = store.metrics()
    if metrics is None:
        return False
    return metrics.get("n_problems", 0) >= len(load_dataset(loaded))


def _print_summary(rows) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvflow.results.files import ResultsDir

    table = Table(title="kvflow sweep", title_justify="left")
    for col in ("point", "status", "accuracy", "results"):
        table.add_column(col, overflow="fold")
    for point, path, status in rows:
        m = ResultsDir(path).metrics() or {}
        acc = f"{m['accuracy']:.1%} ({m.get('n_correct', 0)}/{m.get('n_problems', 0)})" if "accuracy" in m else "–"
        table.add_row(point.label, status, acc, str(path))
    Console(highlight=False).print(table)
