"""A progress bar on stderr, shown only when stderr is a terminal (logs and CI stay clean)."""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, *, enabled: bool = True) -> None:
        self.total = total
        self.correct = 0
        self.done = 0
        self._bar = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

            self._bar = RichProgress(TextColumn("[bold]problems"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[acc]}"), TimeElapsedColumn(),
                                     console=Console(stderr=True), transient=False)
            self._task = self._bar.add_task("run", total=total, acc="")

    def __enter__(self) -> "Progress":
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance(self, correct: bool) -> None:
        self.done += 1
        self.correct += bool(correct)
        if self._bar is not None:
            self._bar.update(self._task, advance=1, acc=f"acc {self.correct}/{self.done}")
