"""The kvflow worker, a Ray actor: one job's engines at a time (a kvflow.runtime.session.Session
on the GPUs Ray gives it), the step scheduler over the problems the driver feeds it (continuous
batching inside a worker), each finished problem's record sent back as it finishes. The
messages it takes and sends: the package's docstring (kvflow.runtime.ray_executor).

Test hook: a worker built with `fault=n` (the driver's `KVFLOW_RAY_FAULT=sigkill:<worker>:<n>`)
kills its own process (SIGKILL) once it has finished `n` problems, before the n-th record
leaves it.
"""

from __future__ import annotations

import os
import platform
import queue
import signal
import threading
import traceback
from typing import Any, Optional

from kvflow.errors import KvflowError, UserError


class KvflowWorker:
    """A kvflow worker: one job's engines at a time, the step scheduler over the problems it is
    fed, records out as problems finish (see the module docstring). Runs in a Ray actor."""

    def __init__(self, index: int, cwd: Optional[str] = None, fault: Optional[int] = None) -> None:
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)  # relative model and dataset paths, as on the driver (a shared filesystem)
        self.index, self.fault = index, fault
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._main, name="kvflow-worker", daemon=True)
        self.thread.start()

    def describe(self) -> dict:
        import ray

        return {"worker": self.index, "host": platform.node(), "node_ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def feed(self, items: list) -> int:
        for item in items:
            self.inbox.put(item)
        return len(items)

    def take(self, timeout: float) -> list:
        out = []
        try:
            out.append(self.outbox.get(timeout=timeout))
            while True:
                out.append(self.outbox.get_nowait())
        except queue.Empty:
            pass
        return out

    # ---------------------------------------------------------------- inside the actor

    def _main(self) -> None:
        jobs: dict[str, Any] = {}
        while True:
            item = self.inbox.get()
            if item[0] == "job":
                jobs[item[1]] = item[2]
            elif item[0] == "problem":
                self._session(jobs, item)
            # ("end", key) with nothing running here: nothing to do

    def _session(self, jobs: dict, first: tuple) -> None:
        key = first[1]
        try:
            self._decode(key, jobs[key], first, jobs)
        except UserError as e:
            self.outbox.put(("error", key, "user", e.problems))
        except KvflowError as e:
            self.outbox.put(("error", key, "kvflow", str(e), e.exit_code))
        except BaseException as e:  # noqa: BLE001 - reported to the driver, which stops the run
            self.outbox.put(("error", key, "internal", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        finally:
            import gc

            gc.collect()
            try:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # the next job's engines load into this worker's GPUs
            except Exception:  # noqa: BLE001
                pass

    def _decode(self, key: str, loaded, first: tuple, jobs: dict) -> None:
        from kvflow.registry import get_registry
        from kvflow.runtime.session import Session

        with Session(loaded, get_registry()) as session:
            self.outbox.put(("opened", key, session.facts()))
            count = {"in": 0, "out": 0}

            def source():
                item = first
                while True:
                    if item is None:
                        try:  # block only when nothing is in flight (the scheduler has nothing to decode)
                            item = self.inbox.get() if count["in"] == count["out"] else self.inbox.get_nowait()
                        except queue.Empty:
                            yield None
                            continue
                    kind, item_key = item[0], item[1]
                    if kind == "job":
                        jobs[item_key] = item[2]
                    elif kind == "end" and item_key == key:
                        return
                    elif kind == "problem":
                        count["in"] += 1
                        yield session.trajectory(item[2])
                    item = None

            def on_done(traj) -> None:
                record = session.record(traj)
                count["out"] += 1
                if self.fault is not None and count["out"] >= self.fault:
                    os.kill(os.getpid(), signal.SIGKILL)  # KVFLOW_RAY_FAULT: a worker lost mid-run
                self.outbox.put(("record", key, record))

            session.decode(source(), on_done)
            self.outbox.put(("closed", key, session.summary()))
