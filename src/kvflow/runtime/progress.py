"""Progress of long work on stderr: a run's problems, a sweep's points.

On a terminal, a live bar (rich): done/total, accuracy so far, tokens generated per second and
the time left (ETA), then the time spent. When stderr is not a terminal (logs, CI), or with
`kvflow run --log` (`plain_log(True)`), no bar: the executors print one plain line per finished
problem instead, ending with the same ETA.

The figures come from a `Tally` (no terminal, no rich; a clock of its own, so that tests give it
a fake one): problems done and correct, tokens generated (every proposer's, as recorded in each
finished problem's `tokens_generated`), over the time since it started. The ETA is the mean
time per finished item so far times the items left: problems finish in bursts under continuous
batching (the first ones late, as a batch fills), so a mean over the whole run is steadier than
a recent rate. No ETA before the first item is done.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional

_PLAIN = {"on": False}


def plain_log(on: bool = True) -> None:
    """One plain line per finished problem even on a terminal (`kvflow run --log`)."""
    _PLAIN["on"] = bool(on)


def clock_text(seconds: Optional[float]) -> str:
    """1:05, 1:02:03, or "?" when unknown."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Tally:
    """What a progress display shows, from the records so far and a clock."""

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.clock = total, clock
        self.start = clock()
        self.done = self.correct = self.tokens = 0

    def add(self, correct: Optional[bool] = None, tokens: int = 0) -> None:
        self.done += 1
        self.correct += bool(correct)
        self.tokens += int(tokens)

    def record(self, record: dict) -> None:
        """A finished problem's samples.jsonl record."""
        self.add(record.get("correct"), sum((record.get("tokens_generated") or {}).values()))

    def elapsed(self) -> float:
        return max(0.0, self.clock() - self.start)

    def eta(self) -> Optional[float]:
        """Seconds until the last item is done, at the mean pace so far (None before the first)."""
        if self.done <= 0:
            return None
        return self.elapsed() / self.done * max(0, self.total - self.done)

    def tokens_per_s(self) -> Optional[float]:
        elapsed = self.elapsed()
        return self.tokens / elapsed if elapsed > 0 and self.tokens else None

    def accuracy(self) -> str:
        if not self.done:
            return "acc -"
        return f"acc {self.correct}/{self.done} ({self.correct / self.done:.0%})"

    def speed(self) -> str:
        rate = self.tokens_per_s()
        return "- tok/s" if rate is None else f"{rate:,.0f} tok/s" if rate >= 10 else f"{rate:.1f} tok/s"

    def status(self) -> str:
        """acc 3/4 (75%), 1,234 tok/s, ETA 2:05"""
        return f"{self.accuracy()}, {self.speed()}, ETA {clock_text(self.eta())}"


class Progress:
    """A live bar over `total` items on stderr when it is a terminal (and `enabled`, and no
    `plain_log`); otherwise nothing is drawn (`live` is False) and its holder prints lines,
    e.g. with `tally.status()`."""

    def __init__(self, total: int, *, title: str = "problems", enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic, stream=None) -> None:
        self.tally = Tally(total, clock)
        self._bar = None
        stream = stream if stream is not None else sys.stderr
        if enabled and not _PLAIN["on"] and stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

            self._bar = RichProgress(TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[status]}"), TextColumn("elapsed"), TimeElapsedColumn(),
                                     console=Console(file=stream), transient=False)
            self._task = self._bar.add_task(title, total=total, status="")

    @property
    def live(self) -> bool:
        """True when the bar is shown (stderr is a terminal)."""
        return self._bar is not None

    def __enter__(self) -> "Progress":
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def record(self, record: dict) -> None:
        """A finished problem: the tally and the bar move on."""
        self.tally.record(record)
        self.update(self.tally.done, self.tally.status())

    def update(self, done: int, status: str = "") -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, status=status)
