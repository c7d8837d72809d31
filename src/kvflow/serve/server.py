"""The `kvflow serve` process: a pipeline's engines loaded once, behind uvicorn.

`serve(loaded, ...)` checks what can be checked before any model loads (the bind address
against the API key, the serve extra installed, the models obtainable, the record
directory), enters one `kvflow.runtime.session.Session` for the life of the process, starts
the engine thread (kvflow.serve.loop) and runs uvicorn on the app (kvflow.serve.app) in this
thread. SIGTERM or SIGINT: drain (new requests get 503 and /health says "draining", the
socket stays open), let what was accepted finish within `grace` seconds, cancel the rest
(the engine thread stops, mid-step, once no accepted request has an answer still going),
then stop uvicorn and the engine thread, leave the Session (engines and their worker
processes stopped), return 0. A second SIGINT cuts the drain short. An engine that dies
stops the server too; then it returns 1.

With `record`, every answered request is appended to `<record>/samples.jsonl` as a results
record (kvflow.runtime.core.record: the trajectory, its timing, plus `request_id` and
`served`), in a results directory prepared like a run's (config.resolved.yaml, manifest.json;
metrics.json written at shutdown), so `kvflow view` and `kvflow report` read served traffic.
"""

from __future__ import annotations

import copy
import ipaddress
import os
import sys
from pathlib import Path
from typing import Optional

from kvflow.config.validate import LoadedPipeline
from kvflow.errors import UserError

API_KEY_ENV = "KVFLOW_API_KEY"
LOOPBACK = ("localhost",)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check(loaded: LoadedPipeline, host: str, api_key: Optional[str]) -> None:
    """What `serve` refuses before loading anything (UserError: exit 2)."""
    if not is_loopback(host) and not api_key:
        raise UserError(f"kvflow serve: binding {host} (not this machine's loopback) needs an API key: "
                        f"--api-key KEY or {API_KEY_ENV}; requests then need `Authorization: Bearer KEY`")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise UserError(f"kvflow serve needs the serve extra ({exc.name} is missing): "
                        f"pip install 'kvflow[serve]' (or scripts/install.sh serve)") from None


def context_length(engine) -> Optional[int]:
    """The base model's context in tokens, where the engine says (`Engine.context_length`: hf the
    model config, SGLang and vLLM their resolved settings), else the tokenizer's if it is a real one."""
    n = engine.context_length()
    if n is None:
        n = getattr(engine.tokenizer, "model_max_length", None)
        n = n if isinstance(n, int) and n < 10**7 else None
    return int(n) if n else None


def serve(loaded: LoadedPipeline, registry, *, host: str = "127.0.0.1", port: int = 8000, grace: float = 30.0,
          api_key: Optional[str] = None, record: Optional[Path] = None, quiet: bool = False,
          metrics_public: bool = False, progress: float = 30.0) -> int:
    """Serve `loaded` until SIGTERM/SIGINT (0) or an engine dies (1). See the module docstring."""
    from kvflow.runtime import compile as compile_
    from kvflow.runtime.core import say

    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    check(loaded, host, api_key)
    compile_.check_models(loaded, registry)
    store = None
    if record is not None:
        from kvflow.outputs import output_dir_problem
        from kvflow.results.files import ResultsDir

        why = output_dir_problem(Path(record))
        if why:
            raise UserError(f"kvflow serve: --record {record}: {why}")
        store = ResultsDir(Path(record))

    import uvicorn

    from kvflow.runtime.core import append_record, manifest
    from kvflow.runtime.session import Session
    from kvflow.serve.app import Service, build_app
    from kvflow.serve.loop import Loop, logprobs_problem
    from kvflow.serve.metrics import Metrics
    from kvflow.serve.protocol import now

    pipe = loaded.pipeline
    on_load = lambda key: say(quiet, f"loading models.{key}: {pipe.models[key].id}")  # noqa: E731
    with Session(loaded, registry, on_load=on_load) as session:
        if store is not None:
            store.prepare(loaded.resolved, {**manifest(loaded, registry), "served": True})
            store.update_manifest(**session.facts())
        base = session.base
        context = context_length(base)
        max_prompt = pipe.serve.max_prompt_tokens or (max(1, context - pipe.limits.max_tokens) if context else 8192)
        metrics = Metrics()
        holder: dict = {}
        loop = Loop(session, metrics, queue=pipe.serve.queue,
                    record=(lambda r: append_record(store, r)) if store is not None else None,
                    on_dead=lambda: _stop(holder.get("server")))
        metrics.gauges = loop.gauges
        service = Service(name=pipe.name, loop=loop, metrics=metrics, tokenizer=copy.deepcopy(base.tokenizer),
                          max_tokens=pipe.limits.max_tokens, max_prompt_tokens=max_prompt,
                          max_body_bytes=pipe.serve.max_body_bytes, ignore=frozenset(pipe.serve.ignore),
                          retry_after=pipe.serve.retry_after, api_key=api_key, created=now(),
                          clamp_max_tokens=pipe.serve.clamp_max_tokens, metrics_public=metrics_public,
                          context=context, logprobs_problem=logprobs_problem(session.plan))
        app = build_app(service)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=max(1, int(grace) + 5), lifespan="off")
        server = _make_server(config, loop, grace)
        holder["server"] = server
        loop.start()
        from kvflow.runtime.admission import describe_admission

        say(quiet, f"serving {pipe.name} on http://{host}:{port}/v1 ({describe_admission(session.plan)}, "
                   f"{pipe.serve.queue} queued"
                   f"{', API key required' if api_key else ''})")
        reporter = _Progress(metrics, progress, quiet)
        try:
            try:
                server.run()
            except SystemExit:  # uvicorn could not start (the port in use): said below
                pass
        finally:
            reporter.stop()
            loop.drain(0 if loop.dead else grace)
            loop.join(grace + 30)
            if store is not None:
                _write_metrics(loaded, store, session)
        if not server.started and not loop.dead:
            raise UserError(f"kvflow serve: could not listen on {host}:{port} (in use?)")
    say(quiet, "stopped" + (f": {loop.dead}" if loop.dead else ""))
    return 1 if loop.dead else 0


class _Progress:
    """Every `seconds`, a progress line on stderr while there is traffic (as `kvflow run`
    prints one per problem): nothing when the server is idle, so a quiet server stays quiet."""

    def __init__(self, metrics, seconds: float, quiet: bool) -> None:
        import threading
        import time

        self._done = threading.Event()
        self._thread = None
        if seconds <= 0 or quiet:
            return

        def report() -> None:
            from kvflow.runtime.core import say

            line, snapshot = metrics.progress(None, time.monotonic())
            while not self._done.wait(seconds):
                line, snapshot = metrics.progress(snapshot, time.monotonic())
                if line:
                    say(False, line)

        self._thread = threading.Thread(target=report, name="kvflow-serve-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(5)


def _stop(server) -> None:
    if server is not None:
        server.should_exit = True


def _write_metrics(loaded: LoadedPipeline, store, session) -> None:
    from kvflow.runtime.compile import pruner_owners
    from kvflow.runtime.core import merge_occupancy, now
    from kvflow.results.files import compute_metrics

    try:
        summary = session.summary()
        store.update_manifest(occupancy=merge_occupancy(store.manifest().get("occupancy"), summary["occupancy"]),
                              finished=now())
        records = store.load()
        if records:
            store.write_metrics(compute_metrics(records, list(loaded.pipeline.proposers), pruner_owners(loaded),
                                                occupancy=store.manifest().get("occupancy")))
    except (OSError, UserError) as exc:
        print(f"kvflow serve: could not write {store.path}'s metrics: {exc}", file=sys.stderr)


def _make_server(config, loop, grace: float):
    """uvicorn's server, whose SIGTERM/SIGINT drains instead of closing the socket at once: the
    engine thread's drain starts (new requests get 503, /health says "draining"), and uvicorn is
    told to exit once the engine thread has answered or cancelled everything it accepted (within
    `grace`); a second SIGINT cuts that short. The signal is not raised again once the server
    has stopped (as uvicorn would): the Session must still be left, its engines stopped."""
    import signal
    import threading

    import uvicorn

    class _Server(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame) -> None:
            if self.draining:
                if sig == signal.SIGINT:
                    loop.drain(0)
                    self.should_exit = self.force_exit = True
                return
            self.draining = True
            loop.drain(grace)
            threading.Thread(target=self._exit_once_drained, name="kvflow-serve-drain", daemon=True).start()

        def _exit_once_drained(self) -> None:
            loop.join()
            self.should_exit = True

    return _Server(config)
