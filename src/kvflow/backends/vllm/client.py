"""The kvflow side of the vLLM worker (`worker.py`): start it in vLLM's environment, send
requests, read replies.

`Worker.start(engine_kwargs)` runs `worker.py` by its path with vLLM's interpreter
(`settings.vllm_python()`), waits for its engine, and reads its replies on a thread into a
queue, so that `poll()` never blocks the scheduler for longer than asked. Workers are shared
per set of engine arguments within a process (`shared()`): model entries that name the same
weights and settings, and every test of a module, reuse one engine. A worker that dies turns
into an `EngineError` naming the model entry and the end of the worker's log; every worker is
stopped at exit (its whole process group).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional

from kvflow.errors import EngineError  # noqa: F401 - raised here, imported from here by the engine

_START_TIMEOUT_S = 900
WORKER = Path(__file__).with_name("worker.py")


class Worker:
    def __init__(self, proc: subprocess.Popen, log_path: str, where: str) -> None:
        self.proc, self.log_path, self.where = proc, log_path, where
        self.replies: queue.Queue = queue.Queue()
        self.info: dict = {}
        self.key: Optional[tuple] = None  # its entry in the shared workers
        self.engine: Any = None  # the VLLMEngine over it, built once (`loading.load_engine`)
        self.holders = 0  # times that engine was handed out and not closed
        self._ids = itertools.count()
        self._lock = threading.Lock()

    @classmethod
    def start(cls, python: Path, engine_kwargs: dict, env: dict, where: str) -> "Worker":
        log = tempfile.NamedTemporaryFile(prefix="kvflow-vllm-", suffix=".log", delete=False)
        proc = subprocess.Popen([str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log, env=env, start_new_session=True, text=True, bufsize=1)
        log.close()
        worker = cls(proc, log.name, where)
        worker._write({"engine": engine_kwargs, "paths": import_roots()})
        first = _read_with_timeout(proc.stdout, _START_TIMEOUT_S)
        if not first or first[0] != "ready":
            message = first[2] if first and first[0] == "error" else "the worker exited"
            worker.close()
            raise EngineError(f"{where}: vLLM engine did not start: {message.strip().splitlines()[0]}"
                              f"\n{worker.log_tail()}")
        worker.info = first[1]
        threading.Thread(target=worker._read, daemon=True).start()
        return worker

    def _write(self, obj) -> None:
        with self._lock:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.strip():
                self.replies.put(json.loads(line))
        self.replies.put(["dead", None])

    def new_rid(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

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
                raise EngineError(f"{self.where}: vLLM worker failed: {msg[2]}")
        return out

    def fail(self) -> None:
        code = self.proc.wait(timeout=30) if self.proc.poll() is None else self.proc.returncode
        self._kill_group()
        raise EngineError(f"{self.where}: the vLLM worker exited (code {code}); rerun to resume.\n{self.log_tail()}")

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
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - shutting down regardless
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._kill_group()
        _SHARED.pop(self.key, None)

    def _kill_group(self) -> None:
        """Anything vLLM started in the worker's process group (its own session) goes with it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def import_roots() -> list[str]:
    """The directories the worker appends to its `sys.path` for kvflow's evicted requests
    (`evict.py`): this process's own import path but the standard library (kvflow's source,
    its plugins, editable installs, its environment's packages), so that an evictor's module
    imports in the worker as it does here. Appended: vLLM's own packages (torch, transformers,
    pydantic) stay first."""
    import sys

    base = str(Path(sys.base_prefix).resolve()) + "/"  # the interpreter's own installation: its standard library
    roots = []
    for entry in sys.path:
        path = Path(entry).resolve() if entry else None
        if path is None or not path.is_dir():
            continue
        if str(path).startswith(base) and path.name not in ("site-packages", "dist-packages"):
            continue
        roots.append(str(path))
    return list(dict.fromkeys(roots))


def _read_with_timeout(stream, timeout: float) -> Optional[Any]:
    box: list = []

    def first() -> None:
        for line in stream:
            if line.strip():
                box.append(json.loads(line))
                return

    t = threading.Thread(target=first, daemon=True)
    t.start()
    t.join(timeout)
    return box[0] if box else None


_SHARED: dict[tuple, Worker] = {}


def shared(python: Path, engine_kwargs: dict, env: dict, where: str) -> Worker:
    """The running worker for these engine arguments, started on first use (closed at exit).
    Starting a new worker first closes the idle ones (`close_idle`): each holds its own KV cache."""
    key = (str(python), *sorted((k, repr(v)) for k, v in engine_kwargs.items()))
    worker = _SHARED.get(key)
    if worker is None or worker.proc.poll() is not None:
        close_idle()
        worker = Worker.start(python, engine_kwargs, env, where)
        worker.key = key
        _SHARED[key] = worker
    return worker


def close_idle() -> int:
    """Close the shared workers no engine holds; how many."""
    idle = [w for w in list(_SHARED.values()) if w.holders <= 0]
    for worker in idle:
        worker.close()
    return len(idle)


@atexit.register
def _close_all() -> None:
    for worker in list(_SHARED.values()):
        worker.close()
