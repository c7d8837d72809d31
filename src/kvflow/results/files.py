"""A run's results directory (DESIGN.md §8): `results/<name>__<hash>/`.

- `config.resolved.yaml`: the pipeline after include and overrides;
- `manifest.json`: versions, git commit, device, seed, times;
- `samples.jsonl`: one record per finished problem, appended and flushed as it finishes;
- `metrics.json`: aggregate metrics, written when the run completes.

Every file is strict JSON (`kvflow.jsonfile`): a non-finite number (a pruner's signal before
warm-up, a NaN score) is written as `null`; files of earlier versions that hold `NaN` still
read, with such numbers as None.

A killed run leaves at most one torn line at the end of `samples.jsonl`; `ResultsDir.load()`
cuts it off (and says so) and the run resumes with the problems not yet recorded. A corrupt
line anywhere else is an error, never silently merged.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from kvflow import jsonfile
from kvflow.errors import ConfigProblem, UserError

SAMPLES = "samples.jsonl"
METRICS = "metrics.json"
MANIFEST = "manifest.json"
CONFIG = "config.resolved.yaml"


class ResultsDir:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.samples = self.path / SAMPLES

    def reset(self) -> None:
        if self.path.exists():
            shutil.rmtree(self.path)

    def prepare(self, resolved: dict, manifest: dict) -> None:
        """Create the directory (or open it to resume): config and a fresh manifest, which
        keeps what earlier sessions of the run measured (decode occupancy)."""
        previous = self.manifest() if (self.path / MANIFEST).exists() else {}
        if previous.get("occupancy"):
            manifest = {**manifest, "occupancy": previous["occupancy"]}
        self.path.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.path / CONFIG, yaml.safe_dump(resolved, sort_keys=False, allow_unicode=True))
        _atomic_write(self.path / MANIFEST, jsonfile.dumps(manifest, indent=2))

    def update_manifest(self, **fields: Any) -> None:
        manifest = self.manifest()
        manifest.update(fields)
        _atomic_write(self.path / MANIFEST, jsonfile.dumps(manifest, indent=2))

    def load(self) -> list[dict]:
        """Records written so far; a torn last line (killed mid-write) is cut off the file."""
        return read_samples(self.samples, repair=True)

    def append(self, record: dict) -> None:
        """Append one record, whole or not at all: a failed write (disk full) is cut back off
        the file, and the run stops with a message; it resumes from the records before it."""
        line = (jsonfile.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        size = self.samples.stat().st_size if self.samples.exists() else 0
        try:
            with open(self.samples, "ab") as f:
                f.write(line)
                f.flush()
        except OSError as e:
            try:
                os.truncate(self.samples, size)
            except OSError:
                pass  # ResultsDir.load cuts a torn last line anyway
            raise UserError([ConfigProblem(str(self.samples), 0, "samples", f"cannot write a record: "
                                           f"{e.strerror or e}", "free space (or fix permissions) and run the "
                                           "same command again: finished problems are kept")]) from None
            f.flush()
            os.fsync(f.fileno())

    def write_metrics(self, metrics: dict) -> None:
        _atomic_write(self.path / METRICS, jsonfile.dumps(metrics, indent=2))

    def manifest(self) -> dict:
        return read_json_object(self.path / MANIFEST, "manifest") or {}

    def metrics(self) -> Optional[dict]:
        return read_json_object(self.path / METRICS, "metrics")


def read_json_object(path: Path, what: str) -> Optional[dict]:
    """A results directory's JSON object file (manifest, metrics), None if absent; anything
    else there is a UserError naming the file."""
    path = Path(path)
    if not path.exists():
        return None
    hint = {"metrics": "delete it: `kvflow run` recomputes metrics.json from samples.jsonl"}.get(
        what, "rerun with --force to start the run afresh")
    try:
        data = jsonfile.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError([ConfigProblem(str(path), 0, what, f"cannot read {path.name}: {e}", hint)]) from None
    if not isinstance(data, dict):
        raise UserError([ConfigProblem(str(path), 0, what, f"{path.name} holds a JSON {type(data).__name__}, "
                                                           "not an object", hint)])
    return data


Number = Union[StrictInt, StrictFloat]  # counts are ints as kvflow writes them; means of them are not


class _StepRecord(BaseModel):
    model_config = ConfigDict(extra="allow")
    text: Optional[StrictStr] = None
    source: StrictStr
    score: Optional[Number] = None
    n_tokens: Optional[StrictInt] = None
    fallback: Optional[StrictBool] = None


class SampleRecord(BaseModel):
    """A samples.jsonl record as kvflow reads it back: the fields metrics and reports are
    computed from are required, the others optional; every one present is type-checked."""

    model_config = ConfigDict(extra="allow")
    id: StrictStr
    prediction: Optional[StrictStr] = None
    correct: StrictBool
    output: Optional[StrictStr] = None
    steps: list[_StepRecord]
    step_counts: dict[str, Number]
    output_tokens: Number
    tokens_generated: dict[str, Number]
    candidates: dict[str, Number]
    pruned: dict[str, Number]
    finish: Optional[StrictStr]
    degenerate: StrictBool
    seconds: Number


def _record_problem(rec: dict) -> Optional[str]:
    try:
        SampleRecord.model_validate(rec)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        return f"record {rec.get('id')!r}: field {where!r}: {err['msg'].lower()}" + (
            f" ({len(e.errors()) - 1} more)" if len(e.errors()) > 1 else "")
    return None


def read_samples(path: Path, *, repair: bool = False, validate: bool = True) -> list[dict]:
    """Records of a samples.jsonl. A torn last line is what a killed run leaves: it is skipped
    with a warning, and with `repair` also cut off the file (a complete last record missing
    only its newline gets the newline). A corrupt line elsewhere, or an id recorded twice, is
    a UserError: never silently merged."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise UserError([ConfigProblem(str(path), 0, "samples", f"cannot read samples.jsonl: {e.strerror or e}",
                                       "rerun with --force to start the run afresh")]) from None
    records, good_end = [], 0
    for i, line in enumerate(lines):
        last = i == len(lines) - 1
        if line.strip():
            try:
                rec = jsonfile.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("not a sample record")
            except ValueError as exc:
                if not last:
                    raise UserError([ConfigProblem(str(path), i + 1, "samples", f"corrupt record: {exc}",
                                                   "remove or fix the line, or rerun with --force")]) from None
                action = "cutting off" if repair else "ignoring"
                print(f"kvflow: {path}: {action} an incomplete last line ({len(line)} bytes)", file=sys.stderr)
                if repair:
                    with open(path, "r+b") as f:
                        f.truncate(good_end)
                break
            problem = _record_problem(rec) if validate else (None if isinstance(rec.get("id"), str) else
                                                              "record without a string `id`")
            if problem:  # a complete JSON object of the wrong shape is not a torn write
                raise UserError([ConfigProblem(str(path), i + 1, "samples", problem,
                                               "remove or fix the line, or rerun with --force")])
            records.append(rec)
            if last and repair:
                with open(path, "ab") as f:
                    f.write(b"\n")
        if not last:
            good_end += len(line) + 1
    dupes = [k for k, v in Counter(r["id"] for r in records).items() if v > 1]
    if dupes:
        raise UserError([ConfigProblem(str(path), 0, "samples", f"duplicate records for {dupes[:5]}",
                                       "rerun with --force")])
    return records


def _atomic_write(path: Path, text: str) -> None:
    """Write whole or not at all: a failed write (disk full) leaves neither a partial file
    nor a `*.tmp` behind, and the previous contents stay."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- metrics


def compute_metrics(records: Iterable[dict], proposers: list[str], pruner_owners: dict[str, list[str]],
                    baselines: Any = None, occupancy: Optional[dict] = None) -> dict:
    """Aggregate metrics (DESIGN.md §8). `pruner_owners[pruner]` = proposers it watches.

    The paper's table columns: `accuracy`, `degeneration_rate`, `mean_base_tokens` (tokens the
    base generated per problem, pruned candidates included), `mean_steps` (committed steps),
    `mean_output_tokens`, `early_exit_fraction` (base candidates stopped by a pruner) and
    `step_share` (committed steps by source). With `baselines` (``run.baselines``: results
    directories `full` and `evicted`), `recovery` = (acc - acc_evicted) / (acc_full -
    acc_evicted), None when a baseline has no metrics.json yet or the two are equally accurate.
    """
    records = list(records)
    n = len(records)
    if n == 0:
        return {"n_problems": 0}

    def mean(values):
        values = list(values)
        return sum(values) / len(values) if values else 0.0

    steps_by_source = Counter()
    for r in records:
        steps_by_source.update(r["step_counts"])
    total_steps = sum(steps_by_source.values())
    candidates = Counter()
    for r in records:
        candidates.update(r["candidates"])
    pruned = Counter()
    for r in records:
        pruned.update(r["pruned"])
    pruned_fraction = {}
    for name, owners in pruner_owners.items():
        denom = sum(candidates[o] for o in owners)
        pruned_fraction[name] = pruned[name] / denom if denom else 0.0
    base = proposers[0]
    base_pruned = sum(pruned[name] for name, owners in pruner_owners.items() if base in owners)
    accuracy = mean(r["correct"] for r in records)
    tokens_generated = {p: mean(r["tokens_generated"].get(p, 0) for r in records) for p in proposers}
    out = {
        "n_problems": n,
        "accuracy": accuracy,
        "n_correct": sum(bool(r["correct"]) for r in records),
        "mean_steps": mean(len(r["steps"]) for r in records),
        "mean_output_tokens": mean(r["output_tokens"] for r in records),
        "mean_base_tokens": tokens_generated[base],
        "tokens_generated": tokens_generated,
        "step_share": {p: (steps_by_source[p] / total_steps if total_steps else 0.0) for p in proposers},
        "pruned_fraction": pruned_fraction,
        "early_exit_fraction": base_pruned / candidates[base] if candidates[base] else 0.0,
        "degeneration_rate": mean(r["degenerate"] for r in records),
        "finish": dict(Counter(r["finish"] for r in records)),
        "fallback_steps": sum(sum(1 for s in r["steps"] if s.get("fallback")) for r in records),
        "mean_seconds": mean(r["seconds"] for r in records),
    }
    timing = timing_summary(records)
    if timing:
        out["timing"] = timing
        if occupancy:
            timing["occupancy"] = occupancy
    if baselines is not None:
        out.update(recovery_metrics(accuracy, baselines))
    return out


def timing_summary(records: Iterable[dict]) -> dict:
    """Mean per-problem `timing` of the records that have one (kvflow.runtime.scheduler): `mean_wall`,
    `phases` (mean exclusive seconds by phase path), `categories` (mean seconds by
    kvflow.timing.categories: model forwards by proposers, scorer, records, kvflow itself) and
    `share` (categories / mean_wall). {} when no record has timing."""
    from kvflow.timing import categories

    timed = [r["timing"] for r in records if r.get("timing")]
    if not timed:
        return {}
    n = len(timed)
    phases: Counter = Counter()
    for t in timed:
        phases.update(t["phases"])
    phases_mean = {k: v / n for k, v in sorted(phases.items())}
    wall = sum(t["wall"] for t in timed) / n
    cats = dict(sorted(categories(phases_mean).items(), key=lambda kv: -kv[1]))
    return {"n_problems": n, "mean_wall": wall, "phases": phases_mean, "categories": cats,
            "share": {k: (v / wall if wall else 0.0) for k, v in cats.items()}}


def recovery_metrics(accuracy: float, baselines: Any) -> dict:
    """`recovery` and the baselines' accuracies, read from their metrics.json files.

    `baselines` has attributes or keys `full` and `evicted`: results directories, relative to
    the working directory; a glob pattern (``results/full_kv__*``) picks the matching directory
    whose metrics.json is newest."""
    get = (lambda k: baselines[k]) if isinstance(baselines, dict) else (lambda k: getattr(baselines, k))
    accs: dict[str, Optional[float]] = {}
    dirs: dict[str, str] = {}
    for key in ("full", "evicted"):
        path = _baseline_dir(str(get(key)))
        dirs[key] = str(path)
        m = ResultsDir(path).metrics()
        accs[key] = m.get("accuracy") if m else None
    full, evicted = accs["full"], accs["evicted"]
    recovery = None
    if full is not None and evicted is not None and full != evicted:
        recovery = (accuracy - evicted) / (full - evicted)
    return {"recovery": recovery, "baselines": {k: {"dir": dirs[k], "accuracy": accs[k]} for k in accs}}


def _baseline_dir(text: str) -> Path:
    if not any(ch in text for ch in "*?["):
        return Path(text)
    import glob

    found = [Path(p) for p in glob.glob(text) if (Path(p) / METRICS).is_file()]
    return max(found, key=lambda p: (p / METRICS).stat().st_mtime) if found else Path(text)
