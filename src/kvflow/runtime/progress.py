"""A progress bar on stderr, shown only when stderr is a terminal (logs and CI stay clean).
Used for a run's problems and for a sweep's points."""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, *, title: str = "problems", enabled: bool = True) -> None:
        self._bar = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

            self._bar = RichProgress(TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                                     console=Console(stderr=True), transient=False)
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

    def update(self, done: int, status: str = "") -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, status=status)
