"""Overlapping engines within one scheduler round (`run.overlap_engines`; see the scheduler's
docstring): each engine that computes in this process steps on a thread of its own while the
engines that stream (decode in a worker process) are read as their tokens arrive."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence

from kvflow.components.engine import Engine
from kvflow.timing import NULL_CLOCK

from kvflow.runtime.plan import Plan


class Overlap:
    """Steps the busy engines of one round together (see the module docstring).

    Each computing engine gets one thread of its own for the whole run (a CUDA context and
    stream stay with it) and steps once per round there; engines that stream (`streams =
    True`) are stepped on the calling thread, again and again, until every computing engine
    has finished its step (at least once each). While they run, every engine's `clock` is a
    private one: the round is one `forward:` phase of the scheduler's clock."""

    def __init__(self, plan: Plan, clock, names: dict[int, str], step: Callable) -> None:
        self.clock, self.names, self._step = clock, names, step  # step(plan, engine): (proposals, forwards, rows)
        self.mode = plan.overlap
        self.threads: dict[int, ThreadPoolExecutor] = {}
        self.order = {id(e): i for i, e in enumerate(plan.engines())}

    def wanted(self, busy: Sequence[Engine]) -> bool:
        if self.mode == "off" or len(busy) < 2:
            return False
        if self.mode == "on":
            return True
        computing = [e for e in busy if not e.streams]
        if len(computing) < len(busy):  # a streaming engine: read it while the others compute
            return True
        devices = {str(e.device) for e in computing}
        return len(devices) == len(computing) and not any(d.startswith("cpu") for d in devices)

    def step(self, plan: Plan, busy: Sequence[Engine]) -> list[tuple]:
        streaming = [e for e in busy if e.streams]
        computing = [e for e in busy if not e.streams]
        private = {id(e): e.clock for e in busy}
        label = "+".join(self.names[id(e)] for e in sorted(busy, key=lambda e: self.order[id(e)]))
        results: dict[int, list] = {id(e): [e, [], 0, 0] for e in busy}
        with self.clock.phase(f"forward:{label}"):
            for e in busy:
                e.clock = NULL_CLOCK
            try:
                futures = [self._thread(e).submit(self._step, plan, e) for e in computing]
                reading = list(streaming)
                while reading:
                    for e in reading:
                        finished, forwards, rows = self._step(plan, e)
                        r = results[id(e)]
                        r[1] += finished
                        r[2] += forwards
                        r[3] += rows
                    # a streaming engine's step waits (briefly) for tokens only while rows decode:
                    # once its proposals are all handed back it would spin, so it rests
                    reading = [e for e in reading if e.busy_rows()]
                    if all(f.done() for f in futures):
                        break
                wait(futures)
                errors = []
                for e, f in zip(computing, futures):
                    try:
                        results[id(e)][1:] = f.result()
                    except BaseException as exc:  # noqa: BLE001 - re-raised below, once every thread is done
                        errors.append(exc)
                if errors:
                    raise errors[0]
            finally:
                for e in busy:
                    e.clock = private[id(e)]
        return [tuple(results[id(e)]) for e in busy]

    def _thread(self, engine: Engine) -> ThreadPoolExecutor:
        pool = self.threads.get(id(engine))
        if pool is None:
            name = f"kvflow-{self.names[id(engine)]}"
            pool = self.threads[id(engine)] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        return pool

    def close(self) -> None:
        for pool in self.threads.values():
            pool.shutdown(wait=True)
        self.threads.clear()
