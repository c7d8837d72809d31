"""Cheap wall-clock accounting by phase, for the step loop's per-problem `timing` record.

`PhaseClock.phase(name)` is a context manager; phases nest, and a nested phase's time is
taken out of its parent's, so the totals are *exclusive* and partition the time spent inside
the outermost phases. A nested phase is recorded under its path: `propose/forward:base+helper`
is model time inside the propose phase, `propose` alone is what propose spent outside every
nested phase (sampling, bookkeeping, forking caches). Two `perf_counter()` calls per phase:
negligible next to a decode step.

`NULL_CLOCK` does nothing; functions that take a `clock` default to it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Mapping


class PhaseClock:
    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._stack: list[str] = []
        self._since = 0.0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        now = time.perf_counter()
        if self._stack:
            parent = self._stack[-1]
            self.totals[parent] = self.totals.get(parent, 0.0) + now - self._since
            path = f"{parent}/{name}"
        else:
            path = name
        self._stack.append(path)
        self._since = now
        try:
            yield
        finally:
            now = time.perf_counter()
            path = self._stack.pop()
            self.totals[path] = self.totals.get(path, 0.0) + now - self._since
            self._since = now  # the parent, if any, resumes here

    def snapshot(self) -> dict[str, float]:
        return dict(self.totals)


class _NullClock:
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def snapshot(self) -> dict[str, float]:
        return {}


NULL_CLOCK = _NullClock()


def categories(phases: Mapping[str, float]) -> dict[str, float]:
    """Group exclusive phase times into where the time went:

    - `model:<proposers>`: forwards of the proposers' models (prefill, candidate decoding,
      ingesting committed text), by the proposers that shared the forward (`base+helper`
      when they decode in one batch);
    - `scorer`: everything the scorer did (its own model forwards included);
    - `records`: grading and writing finished problems' records (`kvflow run`'s callback);
    - `kvflow`: the rest: sampling, pruners, cache forks/selection, commit, bookkeeping.
    """
    out: dict[str, float] = {}
    for path, seconds in phases.items():
        parts = path.split("/")
        forward = next((p for p in reversed(parts) if p.startswith("forward:")), None)
        if "score" in parts:
            key = "scorer"
        elif forward is not None:
            key = "model:" + forward.split(":", 1)[1]
        elif parts[0] == "record":
            key = "records"
        else:
            key = "kvflow"
        out[key] = out.get(key, 0.0) + seconds
    return out
