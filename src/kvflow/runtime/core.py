"""The run core: what every executor of a run shares (DESIGN.md §3, "runtime").

A run is a pipeline over its dataset into a results directory. The core owns the parts that
do not depend on where problems decode: the dataset in the run's order, the checks made before
anything is written, resume (which problems are recorded already), the manifest, the records
(one `samples.jsonl` line per finished problem, appended with Ctrl-C held) and the metrics.
Where the problems decode is an executor's job, behind one interface, `Decode`:

    decode(loaded, registry, store, todo, quiet) -> None

decode every problem of `todo` and append each finished one's record to `store` (a
`ResultsDir`): call `store.prepare(loaded.resolved, manifest(loaded, registry))` once the
engines have loaded (the results directory is created only then), `append_record(store,
record)` for each finished problem, and `store.update_manifest(occupancy=merge_occupancy(...))`
at the end. `run(loaded, decode, ...)` calls it with the problems not yet recorded, then
writes the metrics. The executors are peers, none importing another's internals:

- `kvflow.runtime.local`: this process's engines (a `kvflow.runtime.session.Session`);
- `kvflow.runtime.ray_executor`: kvflow workers on a Ray cluster, each with its own Session;
- `kvflow.runtime.runner.run_pipeline` picks one from `run.executor` (`kvflow run`, sweeps).

A third executor, the server of `kvflow serve` (problems come from HTTP requests, not from a
dataset; answers go back as responses), plugs in below `run`, not through it: it holds one
`Session` for the life of the process (engines loaded once), turns each request into a
trajectory with `session.trajectory(problem)`, feeds `session.decode(source, on_done)` from a
queue (a source may yield None for "nothing ready yet"), answers in `on_done`, and, when asked
to keep records (`--record DIR`), builds each with `session.record(traj)` and appends it with
`append_record` into a `ResultsDir` it prepared with `manifest(...)`, so `kvflow view` and
`kvflow report` read served traffic like a run.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Protocol

from kvflow.config.validate import LoadedPipeline
from kvflow.errors import ConfigProblem, UserError
from kvflow.runtime import compile as compile_
from kvflow.results.files import ResultsDir, compute_metrics
from kvflow.runtime.summary import print_summary
from kvflow.versions import installed_versions, versions_line


class Decode(Protocol):
    """An executor's decode step (see the module docstring)."""

    def __call__(self, loaded: LoadedPipeline, registry, store: ResultsDir, todo: list, quiet: bool) -> None: ...


# --------------------------------------------------------------------------- dataset and checks


def results_path(loaded: LoadedPipeline) -> Path:
    return Path(loaded.pipeline.run.output) / f"{loaded.pipeline.name}__{loaded.hash}"


_AS_CONFIGURED = object()


def load_dataset(loaded: LoadedPipeline, limit=_AS_CONFIGURED):
    """The run's problems, in the run's order (limit: the pipeline's `dataset.limit` unless given)."""
    from kvflow.eval.datasets import DatasetError, load_jsonl_problems, load_problems

    ds = loaded.pipeline.dataset
    limit = ds.limit if limit is _AS_CONFIGURED else limit
    select = dict(limit=limit, offset=ds.offset, shuffle=ds.shuffle, seed=loaded.pipeline.run.seed)
    try:
        if ds.path is None:
            return load_problems(ds.name, **select)
        path = Path(loaded.path).parent / ds.path  # an absolute ds.path stays absolute
        if not path.is_file():
            raise UserError(loaded.problem("dataset.path", f"no such file: {path}"))
        return load_jsonl_problems(path, ds.fields.question, ds.fields.answer, ds.fields.id, name=ds.name, **select)
    except (DatasetError, ValueError) as exc:
        raise UserError(loaded.problem("dataset.path" if ds.path else "dataset.name", str(exc))) from None


def check_output(loaded: LoadedPipeline) -> None:
    """`run.output` is (or can become) a directory: no part of it is a file."""
    from kvflow.outputs import output_dir_problem

    out = Path(loaded.pipeline.run.output)
    why = output_dir_problem(out)
    if why:
        raise UserError(loaded.problem("run.output", f"{out}: {why}",
                                       "point run.output at a directory (it is created if missing)"))


def check_same_pipeline(loaded: LoadedPipeline, store: ResultsDir) -> None:
    """An existing results directory at this run's path holds this very pipeline."""
    import yaml

    from kvflow.config.validate import config_hash

    cfg = store.path / "config.resolved.yaml"
    if not cfg.exists():
        return  # nothing to compare with (its records are still checked one by one)
    try:
        data = yaml.safe_load(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UserError(loaded.problem("run.output", f"{cfg}: cannot read: {e}", "rerun with --force")) from None
    if not isinstance(data, dict) or config_hash(data) != loaded.hash:
        raise UserError(loaded.problem("run.output", f"{store.path} holds the results of a different pipeline "
                                       f"(its config.resolved.yaml does not hash to {loaded.hash})",
                                       "move it away, or rerun with --force to replace it"))


def check_done_in_dataset(loaded: LoadedPipeline, store: ResultsDir, done: list[dict]) -> None:
    """Every record is one of the run's problems: of its dataset in its order, at any limit
    (a run grown or viewed at another dataset.limit keeps the same order)."""
    if not done:
        return
    ids = {p.id for p in load_dataset(loaded, limit=None)}
    strays = [r["id"] for r in done if r["id"] not in ids]
    if strays:
        raise UserError([ConfigProblem(str(store.samples), 0, "samples", f"records for problems not in this run's "
                                       f"dataset: {strays[:3]}", "rerun with --force")])


# --------------------------------------------------------------------------- the run


def run(loaded: LoadedPipeline, decode: Decode, *, force: bool = False, registry=None, quiet: bool = False) -> int:
    """A run through one executor's `decode`: everything that can be checked is checked before
    a results directory exists or a model loads (the output path, the models' files, the
    dataset, a previous run's directory); then the problems not yet recorded are decoded, and
    the metrics written and summarised. Returns the exit code (0)."""
    from kvflow.registry import get_registry

    registry = registry or get_registry()
    pipe = loaded.pipeline
    check_output(loaded)
    compile_.check_models(loaded, registry)
    say(quiet, f"versions: {versions_line()}")
    problems = load_dataset(loaded)
    store = ResultsDir(results_path(loaded))
    owners = compile_.pruner_owners(loaded)
    proposers = list(pipe.proposers)
    if force:
        store.reset()
    check_same_pipeline(loaded, store)
    done = store.load()
    metrics = store.metrics()
    ids = {p.id for p in problems}
    check_done_in_dataset(loaded, store, done)
    done_ids = {r["id"] for r in done}
    todo = [p for p in problems if p.id not in done_ids]
    if not todo and len(done) > len(problems):
        # a smaller dataset.limit than the run has done: its prefix, reported, nothing written
        prefix = compute_metrics([r for r in done if r["id"] in ids], proposers, owners,
                                 baselines=pipe.run.baselines)
        say(quiet, f"complete for these {len(problems)} problems: {store.path} has {len(done)}; "
                   f"the summary below is over the first {len(problems)}")
        if not quiet:
            print_summary(pipe.name, prefix, store.path, proposers)
        return 0
    if not todo and metrics is not None:
        say(quiet, f"already complete: {store.path} (use --force to rerun)")
        if not quiet:
            print_summary(pipe.name, metrics, store.path, proposers)
        return 0
    if done:
        say(quiet, f"resuming {store.path}: {len(done)} done, {len(todo)} to go")
    if todo:
        decode(loaded, registry, store, todo, quiet)
    else:
        store.prepare(loaded.resolved, manifest(loaded, registry))
    records = store.load()
    metrics = compute_metrics(records, proposers, owners, baselines=pipe.run.baselines,
                              occupancy=store.manifest().get("occupancy"))
    store.write_metrics(metrics)
    store.update_manifest(finished=now())
    if not quiet:
        print_summary(pipe.name, metrics, store.path, proposers)
    return 0


# --------------------------------------------------------------------------- records and manifest


def append_record(store: ResultsDir, record: dict) -> None:
    """One finished problem's line in samples.jsonl, with Ctrl-C held until it is complete."""
    with sigint_deferred():
        store.append(record)


@contextmanager
def sigint_deferred():
    """Hold Ctrl-C (SIGINT) while a record is appended; if one came, it is acted on (normally
    KeyboardInterrupt) right after the line is complete. SIGKILL cannot be held: for that,
    ResultsDir.load cuts a torn last line."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending and callable(previous):
            previous(signal.SIGINT, None)


def record(traj, problem, prediction, correct: bool, seconds: float, plan, timing: Optional[dict] = None) -> dict:
    """A finished problem's samples.jsonl record (docs/results.md)."""
    step_counts = {p.name: 0 for p in plan.proposers}
    for s in traj.steps:
        step_counts[s.source] = step_counts.get(s.source, 0) + 1
    capped = traj.finish in ("cap_steps", "cap_tokens")
    return {
        "id": problem.id,
        "question": problem.question,
        "prompt": traj.prompt,
        "gold": problem.gold,
        "prediction": prediction,
        "correct": correct,
        "output": traj.text,
        "steps": [{"text": s.text, "source": s.source, "score": s.score, "n_tokens": s.n_tokens,
                   **({"fallback": True} if s.fallback else {})} for s in traj.steps],
        "step_counts": step_counts,
        "output_tokens": traj.committed_tokens,
        "tokens_generated": dict(traj.tokens_generated),
        "candidates": dict(traj.candidates),
        "pruned": dict(traj.pruned),
        "finish": traj.finish,
        "degenerate": bool(capped and not correct),
        "seconds": round(seconds, 3),
        **({"timing": timing} if timing else {}),
        **({"signals": traj.signals} if traj.signals else {}),
        **({"all_candidates": traj.all_candidates} if traj.all_candidates else {}),
    }


def merge_occupancy(previous: Optional[dict], current: dict) -> dict:
    """Occupancy over every session of a run (a resumed run adds its forwards and rows)."""
    out = {k: dict(v) for k, v in (previous or {}).items()}
    for name, cur in current.items():
        old = out.get(name)
        if old and old.get("bound") == cur["bound"]:
            forwards = old["forwards"] + cur["forwards"]
            rows = old["mean_rows"] * old["forwards"] + cur["mean_rows"] * cur["forwards"]
            cur = {"forwards": forwards, "mean_rows": round(rows / forwards, 3) if forwards else 0.0,
                   "bound": cur["bound"], "occupancy": round(rows / forwards / cur["bound"], 4) if forwards else 0.0}
        out[name] = cur
    return out


def manifest(loaded: LoadedPipeline, registry) -> dict:
    """manifest.json at the start of a run (an executor adds its engines' facts)."""
    from kvflow.versions import cpu

    versions = installed_versions()
    return {
        "name": loaded.pipeline.name,
        "config_hash": loaded.hash,
        "pipeline_file": str(loaded.path),
        "seed": loaded.pipeline.run.seed,
        "dataset": loaded.pipeline.dataset.model_dump(),
        "versions": versions,
        "plugins": [{"name": p.name, "distribution": p.distribution, "version": p.version, "status": p.status}
                    for p in registry.plugins()],
        "git_commit": git_commit(),
        "host": platform.node(),
        "cpu": cpu(),
        "started": now(),
        "command": sys.argv,
    }


def git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:
        return None


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def say(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"kvflow: {message}", file=sys.stderr)


# --------------------------------------------------------------------------- process settings


@contextmanager
def torch_run_settings(run):
    """torch's process settings a run asks for (`run.threads`, `run.deterministic`: on hf,
    deterministic kernels; cuBLAS needs its workspace setting for them), restored after it so
    that in-process callers (tests, notebooks, a Ray worker's next job) keep theirs."""
    import torch

    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    if run.threads:
        torch.set_num_threads(run.threads)
    if run.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
