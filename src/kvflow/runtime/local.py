"""The local executor (`run.executor: local`): a run's problems decoded by this process's
engines (one `kvflow.runtime.session.Session`), each record appended the moment its problem
finishes, in any order. A `kvflow.runtime.core.Decode`; progress on stderr: a live bar when
stderr is a terminal (problems done, accuracy, tokens/s, ETA), else one line per finished
problem, ending with the same figures, and a heartbeat (kvflow.runtime.progress).
"""

from __future__ import annotations

import time

from kvflow.config.validate import LoadedPipeline
from kvflow.errors import UserError
from kvflow.runtime.core import append_record, manifest, merge_occupancy, say
from kvflow.runtime.admission import describe_admission
from kvflow.results.files import ResultsDir

HEARTBEAT_S = 10.0  # seconds between "in flight" lines when no problem has finished


def decode(loaded: LoadedPipeline, registry, store: ResultsDir, todo, quiet: bool) -> None:
    from kvflow.runtime.progress import Progress, clock_text
    from kvflow.runtime.session import Session

    pipe = loaded.pipeline
    on_load = lambda key: say(quiet, f"loading models.{key}: {pipe.models[key].id}")  # noqa: E731
    with Session(loaded, registry, on_load=on_load) as session:
        session.check_kv_memory(todo)  # run.kv_memory: every problem fits by itself, before anything is written
        # the results directory is created only now that every model has loaded
        store.prepare(loaded.resolved, manifest(loaded, registry))
        store.update_manifest(**session.facts())
        with Progress(len(todo), enabled=not quiet) as progress:
            tally = progress.tally  # done, correct, tokens generated, ETA
            heartbeat = {"last": time.time(), "start": time.time()}

            def on_done(traj) -> None:
                record = session.record(traj)
                append_record(store, record)  # Ctrl-C lands after the line is written, never inside it
                progress.record(record)
                heartbeat["last"] = time.time()
                if not quiet and not progress.live:
                    say(False, f"[{tally.done}/{len(todo)}] {record['id']}: "
                               f"{'correct' if record['correct'] else 'wrong'}, {len(traj.steps)} steps, "
                               f"{traj.committed_tokens} tokens, {record['seconds']:.1f} s; {tally.status()}")

            def on_tick(live: int) -> None:  # a sign of life between finished problems (logs, CI)
                t = time.time()
                if quiet or progress.live or t - heartbeat["last"] < HEARTBEAT_S:
                    return
                heartbeat["last"] = t
                say(False, f"[{tally.done}/{len(todo)}] {live} in flight, {t - heartbeat['start']:.0f} s, "
                           f"ETA {clock_text(tally.eta())}")

            say(quiet, f"decoding {len(todo)} problems ({describe_admission(session.plan)})")
            try:
                session.decode((session.trajectory(p) for p in todo), on_done, on_tick=on_tick)
            finally:
                try:  # best effort: must not hide why the run stopped (e.g. a full disk)
                    # engines that count their own work (SGLang: prefix-cache hits, tokens after a
                    # stop) report it for this invocation of the run
                    summary = session.summary()
                    stats = summary["engine_stats"]
                    store.update_manifest(occupancy=merge_occupancy(store.manifest().get("occupancy"),
                                                                    summary["occupancy"]),
                                          **({"engine_stats": stats} if stats else {}),
                                          **({"kv_admission": summary["kv_admission"]}
                                             if "kv_admission" in summary else {}))
                except (OSError, UserError):
                    pass

