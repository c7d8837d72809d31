"""Names for runs from what differs between their configurations (`kvflow report`, `kvflow view`).

Two runs are told apart by their resolved configurations (config.resolved.yaml), not by a
fixed list of fields: every leaf of the configuration is a dotted path
(`scorer.model`, `proposers.base.pruners[1].threshold`), and the paths whose values are not
the same in every run are the *differing fields*. A path a run does not set is shown as `–`
(the default). Ignored: the paths that say how a run was scheduled or where it was written,
not what it computed (kvflow.config.validate.NOT_HASHED), and the free-text `name` and
`description` (a run's name is in its directory's name, which tables show beside it).

`kvflow report` names a series (a line of a plot, a row of a table) by the readable
`variant / evictor` of a run (kvflow.results.runs) and adds the differing fields *within*
the runs of that variant, evictor and N, the budget excepted (it is the x axis): the two
KV-Rescue runs of the reproduction's round 2 differ only by `scorer.model`, so they are
"interleave + early exit / random, scorer.model=base" and "... scorer.model=helper".
`kvflow view` shows the differing fields over all its runs as columns.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from kvflow.results.runs import Run

#: what a path holds in a run that does not set it (kvflow's default for it)
UNSET = "–"


def _ignored() -> frozenset[str]:
    from kvflow.config.validate import NOT_HASHED

    return frozenset({"name", "description"} | {f"{section}.{key}" for section, key in NOT_HASHED})


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted path -> leaf value, in the configuration's own order. A list of mappings is
    indexed (`pruners[0].kind`); any other list, and an empty mapping, is one leaf."""
    out: dict[str, Any] = {}
    if isinstance(config, dict) and config:
        for key, value in config.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(config, list) and config and all(isinstance(v, dict) for v in config):
        for i, value in enumerate(config):
            out.update(flatten(value, f"{prefix}[{i}]"))
    else:
        out[prefix] = config
    return out


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


_MISSING = object()


_ENTRY = re.compile(r"^(.*\[\d+\])\.(.+)$")  # a path inside a list entry: `...pruners[1]` and the rest


def _across_kinds(path: str, flats: Sequence[dict]) -> bool:
    """True for a parameter of a list entry (`proposers.base.pruners[1].window`) whose entry is
    not the same component in every run: a gzip pruner's window and an n-gram pruner's are
    not one field. Only the entry's `kind` is compared there."""
    m = _ENTRY.match(path)
    if m is None or m.group(2) == "kind":
        return False
    kinds = {json.dumps(f.get(f"{m.group(1)}.kind"), default=str) for f in flats}
    return len(kinds) > 1


def differing_paths(configs: Sequence[dict], ignore: Iterable[str] = ()) -> list[str]:
    """Paths whose value (or presence) is not the same in every configuration, in the order
    they first appear; ignored: NOT_HASHED paths, `name`, `description`, `ignore`, and the
    parameters of a list entry that is another component in some run (`_across_kinds`)."""
    skip = _ignored() | set(ignore)
    flats = [flatten(c) for c in configs]
    paths = list(dict.fromkeys(p for f in flats for p in f))
    out = []
    for p in paths:
        if p in skip or _across_kinds(p, flats):
            continue
        values = [f.get(p, _MISSING) for f in flats]
        if any(v is _MISSING for v in values) or not all(_same(values[0], v) for v in values[1:]):
            out.append(p)
    return out


def format_value(value: Any) -> str:
    """A configuration value as a label shows it (`–` for a path the run does not set)."""
    if value is _MISSING:
        return UNSET
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"), default=str)
    return str(value)


def values_at(config: dict, paths: Sequence[str]) -> list[str]:
    """The formatted values of `paths` in one configuration."""
    flat = flatten(config)
    return [format_value(flat.get(p, _MISSING)) for p in paths]


def budget_paths(run: "Run") -> set[str]:
    """The base evictor's budget fields: the x axis of accuracy vs budget, never a series name."""
    names = list(run.config.get("proposers") or {})
    return {f"proposers.{names[0]}.evictor.{k}" for k in ("budget", "budget_bytes")} if names else set()


@dataclass
class SeriesNames:
    """What tells each run apart from the others of its variant, evictor and N (`suffix`,
    by run directory: "" when nothing does), and the names built from it."""

    suffix: dict[Path, str] = field(default_factory=dict)

    def of(self, run: "Run") -> str:
        return self.suffix.get(run.path, "")

    def series(self, run: "Run") -> str:
        """`variant / evictor` and what else differs: a line of accuracy vs budget."""
        s = self.of(run)
        return run.method + (f", {s}" if s else "")

    def variant(self, run: "Run") -> str:
        """The run's variant and what else differs (tables whose rows are runs)."""
        s = self.of(run)
        return run.variant + (f" ({s})" if s else "")


def short_paths(paths: Sequence[str]) -> dict[str, str]:
    """Each path by its shortest ending of at least two parts that no other of `paths` ends
    with (`proposers.base.pruners[0].threshold` -> `pruners[0].threshold`, `scorer.model`
    stays): series names stay readable when several fields differ."""
    parts = {p: p.split(".") for p in paths}
    out = {}
    for p, segs in parts.items():
        for k in range(min(2, len(segs)), len(segs) + 1):
            tail = segs[-k:]
            if not any(q != p and qs[-k:] == tail for q, qs in parts.items()):
                out[p] = ".".join(tail)
                break
        else:
            out[p] = p
    return out


def series_names(runs: Sequence["Run"], key: Callable[["Run"], Hashable] = lambda r: (r.method, r.n)) -> SeriesNames:
    """For each group of runs with the same `key` (variant / evictor and N), the differing
    fields of the group's configurations (budget excepted) as `path=value` text. Runs that
    would still share a name and a budget (configurations equal but for ignored fields) get
    their directory name added, so that no two runs are ever one point."""
    names = SeriesNames()
    groups: dict[Hashable, list["Run"]] = {}
    for r in runs:
        groups.setdefault(key(r), []).append(r)
    for group in groups.values():
        if len(group) < 2:
            continue
        paths = differing_paths([r.config for r in group], ignore=set().union(*(budget_paths(r) for r in group)))
        short = short_paths(paths)
        for r in group:
            names.suffix[r.path] = ", ".join(f"{short[p]}={v}" for p, v in zip(paths, values_at(r.config, paths)))
        seen: dict[tuple, list["Run"]] = {}
        for r in group:
            seen.setdefault((names.suffix[r.path], r.full_kv, r.budget), []).append(r)
        for same in seen.values():
            if len(same) > 1:
                for r in same:
                    names.suffix[r.path] = ", ".join(x for x in (names.suffix[r.path], r.label) if x)
    return names
