"""The kvflow side of the SGLang worker (`worker.py`): start it, send requests, read replies.

`Worker.start(engine_kwargs)` launches `python -m kvflow.backends.sglang.worker` with this
interpreter, waits for its engine, and reads its replies on a thread into a queue, so that
`poll()` never blocks the scheduler for longer than asked. Workers are shared per set of
engine arguments within a process (`shared()`): model entries that name the same weights
and settings, and every test of a session, reuse one engine.

A worker that dies (SGLang kills it when one of its own processes dies) turns into an
`EngineError` naming the model entry and the end of the worker's log.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Optional

from kvflow.backends.sglang.worker import read_frame, write_frame
from kvflow.errors import EngineError  # noqa: F401 - raised here, imported from here by the engine

_START_TIMEOUT_S = 600


def cpu_binding(engine_kwargs: dict) -> Optional[str]:
    """Cores per rank for SGLang's CPU path with several ranks (`SGLANG_CPU_OMP_THREADS_BIND`):
    this process's cores in equal contiguous groups ("0|1" for tp_size 2 on two cores).
    SGLang's own default binds a rank per NUMA node and refuses more ranks than nodes."""
    ranks = 1
    for key in ("tp_size", "dp_size", "pp_size"):
        ranks *= int(engine_kwargs.get(key) or 1)
    if engine_kwargs.get("device") != "cpu" or ranks < 2:
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        return None  # SGLang's message says what to set
    per = len(cores) // ranks
    groups = [cores[i * per : (i + 1) * per] for i in range(ranks)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


class Worker:
    def __init__(self, proc: subprocess.Popen, log_path: str, where: str) -> None:
        self.proc, self.log_path, self.where = proc, log_path, where
        self.replies: queue.Queue = queue.Queue()
        self.info: dict = {}
        self.key: Optional[tuple] = None  # its entry in the shared workers, if any
        self.evict: Optional[str] = None  # the decode profile it was started with (JSON), None: no kvflow hook
        self.engine: Any = None  # the SGLangEngine over it, built once (`loading.load_engine`)
        self.holders = 0  # times that engine was handed out and not closed (`load_engine`, `SGLangEngine.close`)
        self._ids = itertools.count()
        self._lock = threading.Lock()

    @classmethod
    def start(cls, engine_kwargs: dict, where: str, evict: Optional[str] = None) -> "Worker":
        log = tempfile.NamedTemporaryFile(prefix="kvflow-sglang-", suffix=".log", delete=False)
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # SGLang's torch threads must not spin between ops while an `hf` engine in this
        # process decodes on the same cores
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        binding = cpu_binding(engine_kwargs)
        if binding and "SGLANG_CPU_OMP_THREADS_BIND" not in env:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = binding
        proc = subprocess.Popen([sys.executable, "-m", "kvflow.backends.sglang.worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        log.close()
        worker = cls(proc, log.name, where)
        write_frame(proc.stdin, {"engine": engine_kwargs, "evict": evict})
        first = _read_with_timeout(proc.stdout, _START_TIMEOUT_S)
        if not first or first[0] != "ready":
            message = first[2] if first and first[0] == "error" else "the worker exited"
            worker.close()
            raise EngineError(f"{where}: SGLang engine did not start: {message.strip().splitlines()[0]}"
                              f"\n{worker.log_tail()}")
        worker.info = first[1]
        worker.evict = evict  # its decode profile (graph.Profile as JSON; None: no kvflow hook)
        threading.Thread(target=worker._read, daemon=True).start()
        return worker

    def _read(self) -> None:
        while True:
            msg = read_frame(self.proc.stdout)
            self.replies.put(msg if msg is not None else ("dead",))
            if msg is None:
                return

    def new_rid(self, prefix: str) -> str:
        return f"{prefix}-{os.getpid()}-{next(self._ids)}"

    def send(self, *msg) -> None:
        if self.proc.poll() is not None:
            self.fail()
        with self._lock:
            try:
                write_frame(self.proc.stdin, msg)
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
                raise EngineError(f"{self.where}: SGLang worker failed: {msg[2]}")
        return out

    def fail(self) -> None:
        code = self.proc.wait(timeout=30) if self.proc.poll() is None else self.proc.returncode
        self._kill_group()
        tripwire = self.log_line("kvflow tripwire:")
        if tripwire:  # kvflow's own plugin stopped the scheduler: say why first
            raise EngineError(f"{self.where}: {tripwire}\n{self.log_tail()}")
        raise EngineError(f"{self.where}: the SGLang worker exited (code {code}); rerun to resume.\n{self.log_tail()}")

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
                with self._lock:
                    write_frame(self.proc.stdin, ("shutdown",))
                self.proc.wait(timeout=60)
            except Exception:  # noqa: BLE001 - shutting down regardless
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self._kill_group()
        _SHARED.pop(self.key, None)

    def _kill_group(self) -> None:
        """SGLang's scheduler and detokenizer are in the worker's process group (its own
        session): none may outlive the worker, which kills them only when it exits cleanly."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _read_with_timeout(stream, timeout: float) -> Optional[Any]:
    box: list = []
    t = threading.Thread(target=lambda: box.append(read_frame(stream)), daemon=True)
    t.start()
    t.join(timeout)
    return box[0] if box else None


_SHARED: dict[tuple, Worker] = {}


def shared(engine_kwargs: dict, where: str, evict: Optional[str] = None) -> Worker:
    """The running worker for these engine arguments and decode profile (`evict`: a
    `graph.Profile` as JSON for an engine that serves evicted proposers, None for one that
    does not: no kvflow hook then), started on first use (closed at exit). A running worker
    with the same arguments whose profile covers the one asked for (`graph.Profile.covers`)
    serves too: a sweep, or a test session, starts one engine, not one per budget or evictor;
    a full-context engine only ever shares a worker without kvflow's hooks. Starting a new
    worker first closes the idle ones (`close_idle`)."""
    args = tuple(sorted((k, repr(v)) for k, v in engine_kwargs.items()))
    key = (*args, ("kvflow_evict", evict))
    worker = _SHARED.get(key)
    if (worker is None or worker.proc.poll() is not None) and evict is not None:
        worker = _covering(args, evict)
    if worker is None or worker.proc.poll() is not None:
        close_idle()  # before the new one sizes its KV pool from the memory left free
        worker = Worker.start(engine_kwargs, where, evict)
        worker.key = key
        _SHARED[key] = worker
    return worker


def close_idle() -> int:
    """Close the shared workers no engine holds (every engine handed out on them was closed:
    a finished Session's, a sweep's earlier point's); how many. An idle worker is kept for
    reuse only until another worker has to start: on a GPU its memory would otherwise shrink
    the next engine's KV pool (SGLang sizes it from the memory free at start), and on a CPU
    every engine a process ever started would stay resident."""
    idle = [w for w in list(_SHARED.values()) if w.holders <= 0]
    for worker in idle:
        worker.close()
    return len(idle)


def _covering(args: tuple, evict: str) -> Optional[Worker]:
    from kvflow.backends.sglang.graph import Profile

    asked = Profile.from_json(evict)
    for key, worker in _SHARED.items():
        theirs = key[-1][1]
        if key[:-1] == args and theirs is not None and worker.proc.poll() is None \
                and Profile.from_json(theirs).covers(asked):
            return worker
    return None


@atexit.register
def _close_all() -> None:
    for worker in list(_SHARED.values()):
        worker.close()
