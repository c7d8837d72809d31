"""kvflow's side of an engine's worker process: start it, send requests, read replies; one
registry of running workers for every backend.

`Worker.start(command, env, hello, ...)` launches the worker (SGLang's as a module of this
interpreter, vLLM's by its path with vLLM's interpreter), sends the first message, waits for
"ready", and reads replies on a thread into a queue, so that `poll()` never blocks kvflow's
scheduler for longer than asked. Messages are `wire.py`'s JSON lines.

Workers are shared per key within a process (`shared()`): model entries that name the same
weights and settings, and every test of a session, reuse one engine. One registry holds every
backend's workers, so `close_idle()` frees any idle worker, SGLang's or vLLM's, before a new one
sizes its KV pool from the memory left free (on a GPU an idle worker's memory would otherwise
shrink the next engine's pool; on a CPU every engine a process ever started would stay resident).

A worker that dies becomes an `EngineError` naming the model entry and the end of the worker's
log (a kvflow tripwire line in the log, said first); every worker is stopped at exit, its whole
process group with it (SGLang's scheduler and detokenizer, anything vLLM started).
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import signal
import subprocess
import tempfile
import threading
from typing import Any, Callable, Optional, Sequence

from kvflow.backends.served.wire import read_message, write_message
from kvflow.errors import EngineError

#: the line a kvflow hook inside an engine logs when it stops the engine on purpose
TRIPWIRE = "kvflow tripwire:"


class Worker:
    """One worker process and the engine kvflow built over it (at most one, shared by holders)."""

    def __init__(self, proc: subprocess.Popen, log_path: str, where: str, engine_name: str) -> None:
        self.proc, self.log_path, self.where, self.engine_name = proc, log_path, where, engine_name
        self.replies: queue.Queue = queue.Queue()
        self.info: dict = {}  # the "ready" message's: version, resolved settings
        self.hello: dict = {}  # the first message it was started with
        self.key: Optional[tuple] = None  # its entry in the shared workers, if any
        self.engine: Any = None  # the kvflow engine over it, built once (the backend's loading)
        self.holders = 0  # times that engine was handed out and not closed (`hold`, `ServedEngine.close`)
        self._ids = itertools.count()
        self._lock = threading.Lock()

    @classmethod
    def start(cls, command: Sequence[str], env: dict, hello: dict, *, where: str, engine_name: str,
              timeout: float) -> "Worker":
        log = tempfile.NamedTemporaryFile(prefix=f"kvflow-{engine_name.lower()}-", suffix=".log", delete=False)
        proc = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                start_new_session=True, text=True, bufsize=1)
        log.close()
        worker = cls(proc, log.name, where, engine_name)
        worker.hello = hello
        worker._write(hello)
        first = _read_with_timeout(proc.stdout, timeout)
        if not first or first[0] != "ready":
            message = first[2] if first and first[0] == "error" else "the worker exited"
            worker.close()
            raise EngineError(f"{where}: {engine_name} engine did not start: {message.strip().splitlines()[0]}"
                              f"\n{worker.log_tail()}")
        worker.info = first[1]
        threading.Thread(target=worker._read, daemon=True).start()
        return worker

    def _write(self, msg) -> None:
        with self._lock:
            write_message(self.proc.stdin, msg)

    def _read(self) -> None:
        while True:
            msg = read_message(self.proc.stdout)
            self.replies.put(msg if msg is not None else ["dead", None])
            if msg is None:
                return

    def new_rid(self, prefix: str) -> str:
        return f"{prefix}-{os.getpid()}-{next(self._ids)}"

    def send(self, *msg) -> None:
        if self.proc.poll() is not None:
            self.fail()
        try:
            self._write(list(msg))
        except (BrokenPipeError, OSError):
            self.fail()

    def poll(self, timeout: float) -> list:
        """Replies that arrived, waiting up to `timeout` seconds for the first."""
        out = []
        try:
            out.append(self.replies.get(timeout=timeout) if timeout > 0 else self.replies.get_nowait())
            while True:
                out.append(self.replies.get_nowait())
        except queue.Empty:
            pass
        for msg in out:
            if msg[0] == "dead":
                self.fail()
            if msg[0] == "error" and msg[1] is None:
                raise EngineError(f"{self.where}: {self.engine_name} worker failed: {msg[2]}")
        return out

    def fail(self) -> None:
        code = self.proc.wait(timeout=30) if self.proc.poll() is None else self.proc.returncode
        self._kill_group()
        tripwire = self.log_line(TRIPWIRE)
        if tripwire:  # kvflow's own hook stopped the engine: say why first
            raise EngineError(f"{self.where}: {tripwire}\n{self.log_tail()}")
        raise EngineError(f"{self.where}: the {self.engine_name} worker exited (code {code}); rerun to resume.\n"
                          f"{self.log_tail()}")

    def log_line(self, marker: str) -> Optional[str]:
        """The last line of the worker's log that contains `marker`, from the marker on."""
        try:
            with open(self.log_path, errors="replace") as f:
                hits = [line for line in f if marker in line]
        except OSError:
            return None
        return hits[-1][hits[-1].index(marker):].strip() if hits else None

    def log_tail(self, lines: int = 12) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                tail = f.read().splitlines()[-lines:]
        except OSError:
            return ""
        return f"end of the worker's log ({self.log_path}):\n" + "\n".join("  " + x for x in tail)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._write(["shutdown"])
                self.proc.wait(timeout=60)
            except Exception:  # noqa: BLE001 - shutting down regardless
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._kill_group()
        if _SHARED.get(self.key) is self:
            del _SHARED[self.key]

    def _kill_group(self) -> None:
        """Everything the engine started runs in the worker's process group (its own session):
        none may outlive the worker."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _read_with_timeout(stream, timeout: float) -> Optional[Any]:
    box: list = []
    t = threading.Thread(target=lambda: box.append(read_message(stream)), daemon=True)
    t.start()
    t.join(timeout)
    return box[0] if box else None


_SHARED: dict[tuple, Worker] = {}


def shared(key: tuple, start: Callable[[], Worker],
           serves: Optional[Callable[[tuple, Worker], bool]] = None) -> Worker:
    """The running worker under `key` (its backend's name first), else a running one for which
    `serves(its key, worker)` is true (SGLang: a decode profile that covers the one asked for),
    else a new one from `start()`; starting one first closes the idle workers (`close_idle`)."""
    worker = _SHARED.get(key)
    if (worker is None or worker.proc.poll() is not None) and serves is not None:
        worker = next((w for k, w in _SHARED.items() if w.proc.poll() is None and serves(k, w)), None)
    if worker is None or worker.proc.poll() is not None:
        close_idle()
        worker = start()
        worker.key = key
        _SHARED[key] = worker
    return worker


def hold(worker: Worker, build: Callable[[], Any]):
    """The engine over `worker` (built by `build()` once), reset and handed to one more holder;
    the holder's `close()` hands it back."""
    if worker.engine is None:
        worker.engine = build()
    worker.engine.reset()
    worker.holders += 1
    return worker.engine


def close_idle() -> int:
    """Close the shared workers, of any backend, that no engine holds (every engine handed out
    on them was closed: a finished Session's, a sweep's earlier point's); how many."""
    idle = [w for w in list(_SHARED.values()) if w.holders <= 0]
    for worker in idle:
        worker.close()
    return len(idle)


def running() -> list[Worker]:
    """The shared workers now running (tests, doctor)."""
    return [w for w in _SHARED.values() if w.proc.poll() is None]


@atexit.register
def _close_all() -> None:
    for worker in list(_SHARED.values()):
        worker.close()
