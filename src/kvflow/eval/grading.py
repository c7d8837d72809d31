"""Answer equivalence (METHODS.md §11): normalised string match, numeric match, then
math-verify (`verify(parse(gold), parse(pred))`) in a worker process.

The first two steps run in the caller (`fast_equiv`) and settle most answers. Only
undecided pairs reach math-verify, which runs in the main thread of a `Grader`'s worker
process (its timeouts use SIGALRM); a call that does not finish in `timeout` seconds kills
and replaces the worker and counts as wrong, so grading never stalls a run.

The worker is a fresh interpreter (`python -m kvflow.eval._worker`, see there) fed JSON
lines through a pipe, rather than a multiprocessing 'spawn' child: spawn re-imports the
caller's `__main__`, which re-runs unguarded research scripts and fails outright under
`python - < script` and some notebook setups. No CUDA state, locks or threads are inherited.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import Callable, Optional, Union

from kvflow.eval._equiv import fast_equiv

__all__ = ["Grader", "fast_equiv", "is_equiv"]

log = logging.getLogger(__name__)


def _check_spec(check: Union[str, Callable[[str, str], bool], None]) -> Optional[str]:
    if check is None or isinstance(check, str):
        return check
    module, name = getattr(check, "__module__", None), getattr(check, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise ValueError("check must be an importable module-level function or a 'module:function' string")
    return f"{module}:{name}"


class Grader:
    """Grades (pred, gold) pairs; owns one symbolic-check worker process, started on first need.

    Use as a context manager, or call `close()`; thread-safe (calls are serialised).
    `check` replaces math-verify in the worker with another `(pred, gold) -> bool` function,
    given as an importable module-level function or a "module:function" string (the worker
    sees this process's `sys.path`); the tests use it to exercise the timeout path.
    """

    def __init__(
        self,
        timeout: float = 10.0,
        *,
        check: Union[str, Callable[[str, str], bool], None] = None,
        startup_timeout: float = 120.0,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self.timeout = float(timeout)
        self.startup_timeout = float(startup_timeout)
        self._check = _check_spec(check)
        self._proc: Optional[subprocess.Popen] = None
        self._buf = b""
        self._lock = threading.Lock()
        # fast: settled in-process; symbolic: sent to the worker; timeouts/crashes: counted wrong.
        self.stats = {"fast": 0, "symbolic": 0, "timeouts": 0, "crashes": 0}

    def __enter__(self) -> "Grader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def grade(self, pred: Optional[str], gold: Optional[str]) -> bool:
        """Is `pred` equivalent to `gold`? A symbolic check past `timeout` counts as False."""
        with self._lock:
            settled = fast_equiv(pred, gold)
            if settled is not None:
                self.stats["fast"] += 1
                return settled
            return self._symbolic(pred, gold)

    def grade_many(self, pairs: Iterable[tuple[Optional[str], Optional[str]]]) -> list[bool]:
        """`grade` over (pred, gold) pairs, in order."""
        return [self.grade(p, g) for p, g in pairs]

    def close(self) -> None:
        """Stop the worker (end of input, then by force). The grader stays usable."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                try:
                    self._proc.stdin.close()
                    self._proc.wait(2)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self._kill()

    # -- worker management ------------------------------------------------------------

    def _start(self) -> None:
        env = dict(os.environ)
        # The worker must import what this process can (kvflow from a checkout, a custom check).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        cmd = [sys.executable, "-m", "kvflow.eval._worker"] + ([self._check] if self._check else [])
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._buf = b""
        # The worker imports math-verify (sympy) before it says ready, so the per-call
        # timeout measures grading only, not interpreter start-up.
        try:
            line = self._readline(self.startup_timeout)
        except EOFError:
            line = b"exited"
        if line != b'"ready"':
            self._kill()
            why = "did not start in time" if line is None else "exited during start-up (see its stderr)"
            raise RuntimeError(f"grading worker {why}: {' '.join(cmd)}")

    def _readline(self, timeout: float) -> Optional[bytes]:
        """One line from the worker, None after `timeout` seconds, EOFError if it died."""
        deadline = time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout):
                try:
                    f.close()
                except OSError:  # a broken stdin pipe may fail to flush
                    pass
        self._proc = None

    def _symbolic(self, pred: str, gold: str) -> bool:
        self.stats["symbolic"] += 1
        request = (json.dumps([pred, gold]) + "\n").encode()
        # A worker that died (e.g. killed by the OOM killer) gets one fresh replacement.
        for _ in range(2):
            if self._proc is None or self._proc.poll() is not None:
                self._kill()
                self._start()
            try:
                self._proc.stdin.write(request)
                self._proc.stdin.flush()
                line = self._readline(self.timeout)
            except (EOFError, OSError):
                self.stats["crashes"] += 1
                self._kill()
                continue
            except BaseException:
                # Interrupted mid-request (Ctrl-C): the worker may still answer it, and that
                # stale answer must not be read as the next request's.
                self._kill()
                raise
            if line is None:
                self.stats["timeouts"] += 1
                log.warning("grading timed out after %.1fs (pred=%.80r gold=%.80r); counted wrong",
                            self.timeout, pred, gold)
                self._kill()
                return False
            return line == b"true"
        log.warning("grading worker died twice on pred=%.80r gold=%.80r; counted wrong", pred, gold)
        return False


_default: Optional[Grader] = None
_default_lock = threading.Lock()


def is_equiv(pred: Optional[str], gold: Optional[str]) -> bool:
    """METHODS.md §11 equivalence; symbolic checks go to a shared process-wide `Grader`
    (default timeout), so this is safe from any thread and never hangs."""
    global _default
    settled = fast_equiv(pred, gold)
    if settled is not None:
        return settled
    with _default_lock:
        if _default is None:
            _default = Grader()
            atexit.register(_default.close)
    return _default.grade(pred, gold)
