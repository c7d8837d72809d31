"""`kvflow serve`'s memory over many requests: a bounded soak on 127.0.0.1 (docs/benchmarks.md).

A `kvflow serve` process over kvflow.testing's tiny pipeline (as bench/serve_throughput.py's,
`--max-tokens` committed tokens per problem) gets `--requests` streamed chat requests from 8
clients in this process, every 4th closed after its first committed step (a cancellation).
`--samples` times over the soak (every tenth of the way by default), once /health shows
nothing in flight and every engine's rows at 0, the server's resident memory is sampled:
VmRSS, and its two parts, RssAnon (the heap: what a leak grows) and RssFile (mapped files,
which the kernel may drop and read back). `--env NAME=VALUE` sets the server's environment
(an allocator by `LD_PRELOAD`, `MALLOC_ARENA_MAX`, ...). With `--tracemalloc`, the server runs under
tracemalloc from the first request on (`--frames` deep; its own bookkeeping inflates VmRSS, so
the RSS figure is the run without it) and dumps a snapshot after the first tenth (the warm-up)
and at the end (signalled with SIGUSR1); the largest growths between the two, by source line, are printed:
what Python objects the server kept. Memory torch allocates for tensors is not seen by
tracemalloc; RSS is.

    python bench/serve_soak.py --requests 1000                 # RSS samples
    python bench/serve_soak.py --requests 3000 --samples 30    # every 100 requests: does it plateau?
    python bench/serve_soak.py --env LD_PRELOAD=/path/to/libjemalloc.so   # another allocator
    python bench/serve_soak.py --requests 1000 --tracemalloc   # + where Python memory grew

Prints one JSON object (and writes it to `--out`). Traffic goes to 127.0.0.1 only and stops
after `--requests` (each client request has a 600 s timeout).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from _common import machine_line
from serve_throughput import free_port, stream_one, tiny

#: the server under tracemalloc: the first SIGUSR1 starts tracing (once the models are loaded:
#: tracing a model's loading would take minutes), each later one dumps a snapshot to
#: <prefix>.<k>; then kvflow's CLI
WRAPPER = """
import os, signal, sys, tracemalloc
frames, prefix, dumped = int(sys.argv[1]), sys.argv[2], [0]
def on_signal(sig, frame):
    if not tracemalloc.is_tracing():
        tracemalloc.start(frames)
        open(f"{prefix}.started", "w").close()
        return
    tracemalloc.take_snapshot().dump(f"{prefix}.{dumped[0]}.tmp")
    os.replace(f"{prefix}.{dumped[0]}.tmp", f"{prefix}.{dumped[0]}")
    dumped[0] += 1
signal.signal(signal.SIGUSR1, on_signal)
sys.argv = ["kvflow"] + sys.argv[3:]
from kvflow.cli import main
main()
"""


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory in MiB: VmRSS (all of it), RssAnon (its heap: what a leak
    grows) or RssFile (mapped files: shared libraries, which the kernel may drop under memory
    pressure and read back, so VmRSS can fall below its starting size on a shared machine)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def snapshot(proc, prefix: Path, k) -> tracemalloc.Snapshot:
    """Signal the server (k = "started": start tracing) and wait for what it writes."""
    proc.send_signal(signal.SIGUSR1)
    path = Path(f"{prefix}.{k}")
    if k == "started":
        for _ in range(600):
            if path.exists():
                return None
            time.sleep(0.1)
    for _ in range(1200):
        if path.exists():
            return tracemalloc.Snapshot.load(str(path))
        time.sleep(0.1)
    raise RuntimeError(f"no tracemalloc snapshot at {path}")


def soak(pipeline: Path, requests: int, traced: bool, frames: int, workdir: Path, env: dict | None = None,
         samples_n: int = 10) -> dict:
    import httpx

    from kvflow.testing.pipelines import PROBLEMS

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    prefix = workdir / f"snapshot-{port}"
    cmd = ([sys.executable, "-c", WRAPPER, str(frames), str(prefix)] if traced
           else [sys.executable, "-c", "from kvflow.cli import main; main()"])
    log = open(workdir / f"serve-{port}.log", "w")
    proc = subprocess.Popen([*cmd, "serve", str(pipeline), "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    messages = [[{"role": "user", "content": f"{q} (variant {i})"}] for i, (q, _) in enumerate(PROBLEMS)]
    try:
        for _ in range(1200):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"kvflow serve did not start: see {log.name}")

        if traced:
            snapshot(proc, prefix, "started")

        def one(i: int):
            return stream_one(httpx, url, "tiny", 1000 + i, messages[i % len(messages)], cancel=(i % 4 == 3))

        def idle() -> dict:
            deadline = time.time() + 60
            while True:  # cancelled requests are released at their next step boundary
                health = httpx.get(url + "/health").json()
                if (not any(health["rows"].values()) and not health["in_flight"]) or time.time() > deadline:
                    return health

        every = max(1, requests // samples_n)
        samples, snaps = [], []
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            for start in range(0, requests, every):
                list(pool.map(one, range(start, min(requests, start + every))))
                health = idle()
                samples.append({"requests": min(requests, start + every), "rss_mib": rss_mib(proc.pid),
                                "anon_mib": rss_mib(proc.pid, "RssAnon"), "file_mib": rss_mib(proc.pid, "RssFile"),
                                "rows": health["rows"], "in_flight": health["in_flight"]})
                print(json.dumps(samples[-1]), file=sys.stderr, flush=True)
                if traced and start == 0:
                    snaps.append(snapshot(proc, prefix, 0))
        wall = time.perf_counter() - t0
        out = {"requests": requests, "env": env or {}, "concurrency": 8, "cancelled_every": 4, "tracemalloc": traced,
               "wall_s": round(wall, 1), "samples": samples,
               "rss_growth_mib": round(samples[-1]["rss_mib"] - samples[0]["rss_mib"], 1),
               "anon_growth_mib": round(samples[-1]["anon_mib"] - samples[0]["anon_mib"], 1)}
        if traced:
            snaps.append(snapshot(proc, prefix, 1))
            diff = snaps[1].compare_to(snaps[0], "lineno")
            out["python_growth_kib"] = round(sum(d.size_diff for d in diff) / 1024, 1)
            out["top_growth"] = [{"where": str(d.traceback[0]), "kib": round(d.size_diff / 1024, 1),
                                  "blocks": d.count_diff} for d in diff[:12]]
        return out
    finally:
        proc.terminate()
        proc.wait(120)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=64, help="committed tokens per problem (steps of at most 16)")
    ap.add_argument("--tracemalloc", action="store_true", help="also run the server under tracemalloc")
    ap.add_argument("--frames", type=int, default=8, help="tracemalloc's traceback depth")
    ap.add_argument("--samples", type=int, default=10, help="RSS samples over the soak (one every requests/samples)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="set in the server's environment (e.g. LD_PRELOAD=..., MALLOC_ARENA_MAX=2); repeatable")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvflow-soak-"))
    pipeline = tiny(workdir, problems=4, max_tokens=args.max_tokens)
    env = dict(item.split("=", 1) for item in args.env)
    result = {"bench": "serve_soak", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "machine": machine_line(),
              "load_average": os.getloadavg(), "max_tokens": args.max_tokens,
              "plain": soak(pipeline, args.requests, False, args.frames, workdir, env, args.samples)}
    if args.tracemalloc:
        result["traced"] = soak(pipeline, args.requests, True, args.frames, workdir, env, args.samples)
    result["load_average_after"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
