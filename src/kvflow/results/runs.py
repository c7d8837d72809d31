"""Reading results directories for `kvflow report` (read-only: nothing here writes to a run).

A `Run` is one results directory (DESIGN.md §8): its resolved config, manifest, the sample
records and the metrics (metrics.json, or recomputed from samples.jsonl for a run that has
not finished). What a run *is* comes from its config:

- `evictor`, `budget`: `proposers.<first>.evictor.kind/budget` (the first proposer is the base;
  the manifest's `kv_memory` gives the token budget of a `budget_bytes` run and its bits);
- `variant`: the ablation it belongs to (DESIGN.md §5): best-of-N (base only, no pruners),
  early exit (base only, with pruners), interleave (a helper, no pruners on the base),
  interleave + early exit (both), helper only (a single proposer called or using `helper`);
- `n`: the base proposer's candidates per step.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

from kvflow.errors import ConfigProblem, UserError
from kvflow.results.files import read_json_object, read_samples as _read_samples
from kvflow.results.signals import pruner_owners

CONFIG, MANIFEST, SAMPLES, METRICS = "config.resolved.yaml", "manifest.json", "samples.jsonl", "metrics.json"

VARIANTS = ("best-of-N", "early exit", "interleave", "interleave + early exit", "helper only")


@dataclass
class Run:
    path: Path
    config: dict
    manifest: dict
    records: list[dict]
    metrics: dict
    complete: bool
    proposers: list[str] = field(default_factory=list)

    # -- what the run is ------------------------------------------------------------------
    @property
    def label(self) -> str:
        return self.path.name

    @property
    def served(self) -> bool:
        """A `kvflow serve --record` directory: requests, with no gold answer to grade."""
        return bool(self.manifest.get("served"))

    @property
    def name(self) -> str:
        return str(self.config.get("name") or self.manifest.get("name") or self.path.name.split("__")[0])

    def _proposer(self, i: int = 0) -> dict:
        props = self.config.get("proposers") or {}
        names = list(props)
        return (props.get(names[i]) or {}) if i < len(names) else {}

    def _kv_memory(self) -> dict:
        """The base's `kv_memory` entry of the manifest (token budget after any budget_bytes
        conversion, quantization bits); {} for runs written before it existed."""
        props = list(self.config.get("proposers") or {})
        return ((self.manifest.get("kv_memory") or {}).get(props[0]) or {}) if props else {}

    @property
    def evictor(self) -> str:
        ev = self._proposer().get("evictor") or {}
        kind = str(ev.get("kind", "none"))
        spread = ev.get("allocation")
        if isinstance(spread, dict) and spread.get("kind"):
            kind = f"{kind}+{spread['kind']}"  # a scorer under an allocation wrapper: keydiff+adakv
        bits = self._kv_memory().get("bits")
        return f"{kind} ({bits}-bit)" if bits else kind

    @property
    def full_kv(self) -> bool:
        return self.evictor == "none"

    @property
    def budget(self) -> Optional[int]:
        if self.full_kv:
            return None
        if self._kv_memory().get("budget") is not None:
            return int(self._kv_memory()["budget"])
        ev = self._proposer().get("evictor") or {}
        if "budget" in ev:
            return ev["budget"]
        return _default_param("evictors", self.evictor, "budget")

    @property
    def n(self) -> int:
        return int(self._proposer().get("n", 1))

    @property
    def base_pruners(self) -> list[str]:
        return [str(p.get("kind")) for p in (self._proposer().get("pruners") or []) if isinstance(p, dict)]

    @property
    def variant(self) -> str:
        props = self.config.get("proposers") or {}
        if len(props) == 1:
            (pname, prop), = props.items()
            if "helper" in (pname, (prop or {}).get("model")):
                return "helper only"
            return "early exit" if self.base_pruners else "best-of-N"
        return "interleave + early exit" if self.base_pruners else "interleave"

    @property
    def method(self) -> str:
        """`variant / evictor`, the series key of accuracy-vs-budget (budget excluded)."""
        return f"{self.variant} / {'full KV' if self.full_kv else self.evictor}"

    @property
    def dataset(self) -> dict:
        ds = self.manifest.get("dataset") or self.config.get("dataset") or {}
        return {"name": ds.get("name", "gsm8k"), "limit": ds.get("limit"), "offset": ds.get("offset", 0),
                "shuffle": bool(ds.get("shuffle", False)),
                "seed": ((self.config.get("run") or {}).get("seed", 0) if ds.get("shuffle") else None)}

    def dataset_text(self) -> str:
        d = self.dataset
        text = f"{d['name']} offset={d['offset']} limit={d['limit']}"
        return text + (f" shuffled(seed={d['seed']})" if d["shuffle"] else "")

    def correct_by_id(self) -> dict[str, bool]:
        return {r["id"]: bool(r.get("correct")) for r in self.records}

    def prefix(self, n: int) -> "Run":
        """This run over the first `n` problems of its dataset order only (a GSM8K-64 run as
        GSM8K-16, to compare with runs that stopped there): records, metrics and the dataset's
        limit restricted; complete when all `n` are in. UserError where the order cannot be
        rebuilt (a `path` dataset) or the run covers fewer than `n`."""
        from kvflow.eval.datasets import DatasetError, load_problems

        ds = dict(self.config.get("dataset") or {})
        if ds.get("path"):
            raise UserError(f"{self.path}: --limit needs a built-in dataset (this run reads {ds['path']})")
        have = self.dataset["limit"]
        if have is not None and have < n:
            raise UserError(f"{self.path}: --limit {n}, but the run covers {have} problems",
                            hint="pass a limit at most the smallest run's dataset.limit")
        d = self.dataset
        try:
            ids = [p.id for p in load_problems(d["name"], limit=n, offset=d["offset"], shuffle=d["shuffle"],
                                               seed=d["seed"] or 0)]
        except (DatasetError, OSError, KeyError) as e:
            raise UserError(f"{self.path}: cannot rebuild its dataset order for --limit: {e}") from None
        keep = set(ids)
        records = [r for r in self.records if r["id"] in keep]
        config = {**self.config, "dataset": {**ds, "limit": n}}
        manifest = {**self.manifest, "dataset": {**(self.manifest.get("dataset") or ds), "limit": n}}
        return Run(self.path, config, manifest, records, _metrics(records, self.proposers, config),
                   len(records) == len(ids), self.proposers)

    def metrics_on(self, ids: Iterable[str]) -> dict:
        """The run's metrics recomputed over the problems in `ids` only (to compare runs that
        finished different problems on the problems they have in common)."""
        keep = set(ids)
        return _metrics([r for r in self.records if r["id"] in keep], self.proposers, self.config)


def _default_param(kind: str, name: str, param: str) -> Any:
    try:
        from kvflow.registry import get_registry

        return get_registry().info(kind, name).defaults.get(param)
    except Exception:
        return None


def read_samples(path: Path) -> list[dict]:
    """Records of a samples.jsonl, read-only (a torn last line is skipped with a warning)."""
    return _read_samples(path)


def load_run(path: Path) -> Run:
    path = Path(path)
    if not (path / CONFIG).is_file():
        raise UserError(f"{path}: not a results directory (no {CONFIG})",
                        hint="pass directories written by `kvflow run` (results/<name>__<hash>/)")
    try:
        config = yaml.safe_load((path / CONFIG).read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UserError([ConfigProblem(str(path / CONFIG), 0, "config", f"cannot read: {e}")]) from None
    if not isinstance(config, dict) or not isinstance(config.get("proposers", {}), dict):
        raise UserError([ConfigProblem(str(path / CONFIG), 0, "config", "not a resolved pipeline (a mapping with "
                                       f"`proposers`), but a YAML {type(config).__name__}")])
    manifest = read_json_object(path / MANIFEST, "manifest") or {}
    metrics = read_json_object(path / METRICS, "metrics")
    records = read_samples(path / SAMPLES)
    proposers = list(config.get("proposers") or {})
    complete = metrics is not None
    if metrics is None or metrics.get("n_problems", 0) != len(records) or not _metrics_shape_ok(metrics):
        metrics = _metrics(records, proposers, config)
    return Run(path, config, manifest, records, metrics, complete, proposers)


def _metrics_shape_ok(metrics: dict) -> bool:
    """metrics.json has what the tables read (else it is recomputed from the records)."""
    return isinstance(metrics.get("accuracy"), (int, float)) and isinstance(metrics.get("tokens_generated"), dict)


def _metrics(records: list[dict], proposers: list[str], config: dict) -> dict:
    """Metrics recomputed from sample records, as `kvflow run` writes them to metrics.json."""
    from kvflow.results.files import compute_metrics

    return compute_metrics(records, proposers, pruner_owners(config)) if records else {"n_problems": 0}


def expand_dirs(args: Iterable[str]) -> list[Path]:
    """Directories from arguments: paths, glob patterns, or a parent holding results dirs."""
    out: list[Path] = []
    problems = []
    for arg in args:
        matches = sorted(glob.glob(arg)) if any(c in arg for c in "*?[") else [arg]
        if not matches:
            problems.append(ConfigProblem("", 0, "", f"{arg}: no such results directory (pattern matched nothing)"))
            continue
        for m in matches:
            p = Path(m)
            if (p / CONFIG).is_file():
                out.append(p)
            elif p.is_dir() and any((c / CONFIG).is_file() for c in p.iterdir() if c.is_dir()):
                out.extend(sorted(c for c in p.iterdir() if (c / CONFIG).is_file()))
            elif not p.exists():
                problems.append(ConfigProblem("", 0, "", f"{m}: no such results directory"))
            else:
                problems.append(ConfigProblem("", 0, "", f"{m}: not a results directory (no {CONFIG})",
                                              "pass directories written by `kvflow run`"))
    if problems:
        raise UserError(problems)
    return list(dict.fromkeys(p.resolve() for p in out))


def check_same_dataset(runs: Iterable[Run]) -> None:
    """UserError unless every run used the same dataset, offset, limit (and shuffle seed)."""
    groups: dict[str, list[str]] = {}
    for r in runs:
        groups.setdefault(r.dataset_text(), []).append(r.label)
    if len(groups) > 1:
        lines = "; ".join(f"{key}: {', '.join(labels)}" for key, labels in groups.items())
        raise UserError(f"runs use different problem sets and cannot be compared: {lines}",
                        hint="report them separately, or pass --allow-mixed to compare anyway")
