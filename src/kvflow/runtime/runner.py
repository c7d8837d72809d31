"""`kvflow run`: a validated pipeline over its dataset, into a results directory.

Order of work: check that every model is obtainable (nothing loaded yet), open or resume
the results directory, load models once (an engine each), stream the problems through the
step scheduler (kvflow.runtime.scheduler), grade and append each problem the moment it
finishes (in any order), then write metrics and print a summary. Progress: a live bar when
stderr is a terminal, else one line per finished problem.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from kvflow.versions import installed_versions, versions_line
from kvflow.config.validate import LoadedPipeline
from kvflow.errors import ConfigProblem, UserError
from kvflow.runtime import compile as compile_
from kvflow.runtime.results import ResultsDir, compute_metrics
from kvflow.runtime.summary import print_summary


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


def _check_done_in_dataset(loaded: LoadedPipeline, store: ResultsDir, done: list[dict]) -> None:
    """Every record is one of the run's problems: of its dataset in its order, at any limit
    (a run grown or viewed at another dataset.limit keeps the same order)."""
    if not done:
        return
    ids = {p.id for p in load_dataset(loaded, limit=None)}
    strays = [r["id"] for r in done if r["id"] not in ids]
    if strays:
        raise UserError([ConfigProblem(str(store.samples), 0, "samples", f"records for problems not in this run's "
                                       f"dataset: {strays[:3]}", "rerun with --force")])


def run_pipeline(loaded: LoadedPipeline, *, force: bool = False, registry=None, quiet: bool = False,
                 decode=None, ray_address: Optional[str] = None) -> int:
    """`decode(loaded, registry, store, todo, quiet)` decodes the problems to do into the
    results directory: by default this process's engines (`_decode`), or with `run.executor:
    ray` kvflow workers on a Ray cluster (`ray_address`, else RAY_ADDRESS, else a local one)."""
    from kvflow.registry import get_registry

    registry = registry or get_registry()
    pipe = loaded.pipeline
    if decode is None and pipe.run.executor == "ray":  # kvflow.runtime.ray_executor; checked before anything is written
        from kvflow.runtime import ray_executor

        ray_executor.check(loaded, ray_address)
        decode = ray_executor.decoder(ray_address)
    elif ray_address and pipe.run.executor != "ray":
        raise UserError(loaded.problem("run.executor", "--ray-address is given, but the run's executor is local",
                                       "add --set run.executor=ray (docs/cluster.md)"))
    # everything that can be checked is checked before a results directory exists or a model
    # loads: the output path, the models' files, the dataset, a previous run's directory
    check_output(loaded)
    compile_.check_models(loaded, registry)
    _say(quiet, f"versions: {versions_line()}")
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
    _check_done_in_dataset(loaded, store, done)
    done_ids = {r["id"] for r in done}
    todo = [p for p in problems if p.id not in done_ids]
    if not todo and len(done) > len(problems):
        # a smaller dataset.limit than the run has done: its prefix, reported, nothing written
        prefix = compute_metrics([r for r in done if r["id"] in ids], proposers, owners,
                                 baselines=pipe.run.baselines)
        _say(quiet, f"complete for these {len(problems)} problems: {store.path} has {len(done)}; "
                    f"the summary below is over the first {len(problems)}")
        if not quiet:
            print_summary(pipe.name, prefix, store.path, proposers)
        return 0
    if not todo and metrics is not None:
        _say(quiet, f"already complete: {store.path} (use --force to rerun)")
        if not quiet:
            print_summary(pipe.name, metrics, store.path, proposers)
        return 0
    if done:
        _say(quiet, f"resuming {store.path}: {len(done)} done, {len(todo)} to go")
    if todo:
        (decode or _decode)(loaded, registry, store, todo, quiet)
    else:
        store.prepare(loaded.resolved, _manifest(loaded, registry))
    records = store.load()
    metrics = compute_metrics(records, proposers, owners, baselines=pipe.run.baselines,
                              occupancy=store.manifest().get("occupancy"))
    store.write_metrics(metrics)
    store.update_manifest(finished=_now())
    if not quiet:
        print_summary(pipe.name, metrics, store.path, proposers)
    return 0


def _decode(loaded: LoadedPipeline, registry, store: ResultsDir, todo, quiet: bool) -> None:
    with torch_run_settings(loaded.pipeline.run):
        _decode_with(loaded, registry, store, todo, quiet)


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


def _decode_with(loaded: LoadedPipeline, registry, store: ResultsDir, todo, quiet: bool) -> None:
    import torch

    from kvflow.components.base import Trajectory
    from kvflow.eval.answer import extract_answer
    from kvflow.eval.grading import Grader
    from kvflow.eval.prompts import render_prompt
    from kvflow.runtime.progress import Progress
    from kvflow.runtime.scheduler import Occupancy, run

    pipe = loaded.pipeline
    torch.manual_seed(pipe.run.seed)
    plan, engines = compile_.build_plan(loaded, registry, on_load=lambda key: _say(
        quiet, f"loading models.{key}: {pipe.models[key].id}"))
    base = plan.proposers[0].engine
    # the results directory is created only now that every model has loaded
    store.prepare(loaded.resolved, _manifest(loaded, registry))
    store.update_manifest(threads=torch.get_num_threads(), **compile_.engine_facts(plan, engines))
    by_id = {p.id: p for p in todo}
    occupancy = Occupancy()
    with Grader(timeout=pipe.run.grade_timeout) as grader, Progress(len(todo), enabled=not quiet) as progress:
        started: dict[str, float] = {}
        timings: dict[str, dict] = {}  # filled by the scheduler just before on_done
        tally = {"done": 0, "correct": 0}

        def trajectories():
            for p in todo:  # rendered lazily: a problem is admitted when there is room for it
                started[p.id] = time.time()
                yield Trajectory(p.id, p.question, render_prompt(pipe.dataset.prompt, p.question, base.tokenizer))

        def on_done(traj: Trajectory) -> None:
            problem = by_id[traj.problem_id]
            prediction = extract_answer(traj.text)
            correct = bool(prediction is not None and grader.grade(prediction, problem.gold))
            record = _record(traj, problem, prediction, correct, time.time() - started[traj.problem_id], plan,
                             timings.pop(traj.problem_id, None))
            with _sigint_deferred():  # Ctrl-C lands after the line is written, never inside it
                store.append(record)
            tally["done"] += 1
            tally["correct"] += correct
            status = f"acc {tally['correct']}/{tally['done']}"
            progress.update(tally["done"], status)
            heartbeat["last"] = time.time()
            if not quiet and not progress.live:
                _say(False, f"[{tally['done']}/{len(todo)}] {problem.id}: {'correct' if correct else 'wrong'}, "
                            f"{len(traj.steps)} steps, {traj.committed_tokens} tokens, {record['seconds']:.1f} s; "
                            f"{status} ({tally['correct'] / tally['done']:.0%})")

        heartbeat = {"last": time.time(), "start": time.time()}

        def on_tick(live: int) -> None:  # a sign of life between finished problems (logs, CI)
            now = time.time()
            if quiet or progress.live or now - heartbeat["last"] < _HEARTBEAT_S:
                return
            heartbeat["last"] = now
            _say(False, f"[{tally['done']}/{len(todo)}] {live} in flight, {now - heartbeat['start']:.0f} s")

        _say(quiet, f"decoding {len(todo)} problems ({pipe.run.batch_problems} per decode batch, "
                    f"{plan.live_problems or 2 * plan.batch_problems} in flight)")
        try:
            run(plan, trajectories(), on_done, timings=timings, occupancy=occupancy, on_tick=on_tick)
        finally:
            try:  # best effort: must not hide why the run stopped (e.g. a full disk)
                # engines that count their own work (SGLang: prefix-cache hits, tokens after a
                # stop) report it for this invocation of the run
                stats = {e.label: e.stats() for e in plan.engines() if callable(getattr(e, "stats", None))}
                store.update_manifest(occupancy=_merge_occupancy(store.manifest().get("occupancy"),
                                                                 occupancy.summary()),
                                      **({"engine_stats": stats} if stats else {}))
            except (OSError, UserError):
                pass


_HEARTBEAT_S = 10.0  # seconds between "in flight" lines when no problem has finished


def _merge_occupancy(previous: Optional[dict], current: dict) -> dict:
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


@contextmanager
def _sigint_deferred():
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


def _record(traj, problem, prediction, correct: bool, seconds: float, plan, timing: Optional[dict] = None) -> dict:
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


def _manifest(loaded: LoadedPipeline, registry) -> dict:
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
        "git_commit": _git_commit(),
        "host": platform.node(),
        "started": _now(),
        "command": sys.argv,
    }


def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:
        return None


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"kvflow: {message}", file=sys.stderr)
