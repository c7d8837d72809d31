"""`kvflow serve` against `kvflow run` on the same problems and pipeline (docs/benchmarks.md).

The pipeline is kvflow.testing's tiny one (random-weight Qwen2 base with random eviction,
Llama helper, likelihood scorer, `best` committer; `--problems` GSM8K-style questions), or
`--pipeline FILE` (its dataset's first `--problems` problems). Measured, for one process's
engines each time:

- run: the local executor's decode (a `Session` over every problem, as `kvflow run` decodes
  them, records not written; after one warm-up problem, as the server gets one warm-up
  request): problems per minute, and per problem the time from the start to its first
  committed step and to its end; once with the pipeline's own `run.live_problems` (16: every
  problem in flight) and once per concurrency c with `--set run.live_problems=c` and
  `run.batch_problems=min(c, 8)` (a run that keeps as many problems in flight as c clients
  do: the like-for-like baseline of serve at c);
- serve at each `--concurrency` c: a `kvflow serve` process on 127.0.0.1, c clients each
  streaming its next problem (the run's prompt, `seed` = its index, so the same trajectory)
  through POST /v1/chat/completions until all are answered: problems per minute from the
  first request to the last answer, p50/p95 time to the first committed step (the first SSE
  chunk) and to the end; the ratio to run's problems per minute, at its own live_problems
  (`vs_run`) and at live_problems = c (`vs_run_same_live`);
- where the time goes at each level: the CPU seconds of the server's threads by name (its
  engine thread `kvflow-serve-engines`, the HTTP event loop on the main thread, torch's
  workers), of the clients, which run in a process of their own (`--clients process`, the
  default; `threads` runs them in the bench's process as before), and of the run at the same
  live_problems, over the level's wall time x the CPUs;
- soak (`--soak N`): N more requests at concurrency 8, every 4th closed after its first step
  (a cancellation), the server's resident memory (VmRSS) and /health's engine rows sampled
  every N/10 requests.

    python bench/serve_throughput.py --problems 16 --concurrency 1,4,16 --soak 500 [--max-tokens 256]
    python bench/serve_throughput.py --pipeline pipelines/quickstart.yaml --problems 4 --concurrency 1,4

Prints one JSON object (and writes it to `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from _common import machine_line, write_json  # noqa: E402 - bench/ is on sys.path

KVFLOW = [sys.executable, "-c", "from kvflow.cli import main; main()"]


def tiny(directory: Path, problems: int, max_tokens: int = 64) -> Path:
    """The tiny pipeline over `problems` questions (the four of kvflow.testing, varied), each
    committing at most `max_tokens` tokens (in steps of at most 16)."""
    from kvflow.testing.pipelines import PROBLEMS, tiny_pipeline

    path = tiny_pipeline(directory, problems=4, max_tokens=max_tokens, extra={
        "limits": {"max_steps": max(8, max_tokens // 8)},
        "run": {"threads": 1, "batch_problems": 8, "live_problems": 16},
        "serve": {"queue": 64}})
    data = directory / "bench.jsonl"
    data.write_text("".join(json.dumps({"question": f"{q} (variant {i})", "answer": a}) + "\n"
                            for i in range(problems) for q, a in [PROBLEMS[i % len(PROBLEMS)]]))
    text = path.read_text().replace("path: problems.jsonl", "path: bench.jsonl").replace("limit: 4", f"limit: {problems}")
    path.write_text(text)
    return path


def pct(values, q):
    values = sorted(values)
    if not values:
        return None
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return round(values[lo] + (values[hi] - values[lo]) * (k - lo), 3)


def run_baseline(path: Path, n: int, live: int | None = None) -> tuple[dict, list]:
    """The local executor's decode of the first n problems (at most `live` in flight, when
    given); their messages for the server."""
    from kvflow.config.validate import load_pipeline
    from kvflow.eval.prompts import get_prompt
    from kvflow.registry import get_registry
    from kvflow.runtime.core import load_dataset
    from kvflow.runtime.session import Session

    sets = [f"run.live_problems={live}", f"run.batch_problems={min(live, 8)}"] if live else []
    loaded = load_pipeline(path, sets, registry=get_registry())
    problems = load_dataset(loaded)[:n]
    template = get_prompt(loaded.pipeline.dataset.prompt)
    first, end = {}, {}
    with Session(loaded, get_registry()) as session:
        warm = session.trajectory(problems[0])  # first forwards' one-off costs, as the server's warm-up request
        session.decode([warm], session.forget)
        trajs = {}
        t0 = time.perf_counter()

        def source():
            for p in problems:
                trajs[p.id] = session.trajectory(p)
                yield trajs[p.id]

        def on_tick(live):
            t = time.perf_counter() - t0
            for pid, tr in trajs.items():
                if tr.steps and pid not in first:
                    first[pid] = t

        def on_done(tr):
            t = time.perf_counter() - t0
            first.setdefault(tr.problem_id, t)
            end[tr.problem_id] = t
            session.forget(tr)

        c0 = time.process_time()
        session.decode(source(), on_done, on_tick=on_tick)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    ids = [p.id for p in problems]
    messages = [(int(p.id.rsplit("/", 1)[1]), template.messages(p.question)) for p in problems]
    return ({"problems": n, "live_problems": loaded.pipeline.run.live_problems, "wall_s": round(wall, 3),
             "cpu_s": round(cpu, 3),
             "problems_per_min": round(60 * n / wall, 2),
             "first_step_p50_s": pct([first[i] for i in ids], 0.5), "first_step_p95_s": pct([first[i] for i in ids], 0.95),
             "done_p50_s": pct([end[i] for i in ids], 0.5), "done_p95_s": pct([end[i] for i in ids], 0.95)},
            messages)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_one(httpx, url: str, name: str, seed: int, messages, cancel: bool = False) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=600,
                      json={"model": name, "messages": messages, "seed": seed, "stream": True}) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: {") and first is None and '"kvflow"' in line:
                first = time.perf_counter() - t0
                if cancel:
                    break
    return first if first is not None else time.perf_counter() - t0, time.perf_counter() - t0


def server_clock(httpx, url: str) -> dict[str, float]:
    """The server's own latency histograms' sums and counts (/metrics): from a request's arrival
    in the app to its first step sent, and to its answer's end."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for name in ("kvflow_time_to_first_step_seconds", "kvflow_request_seconds"):
            if line.startswith(name + "_sum") or line.startswith(name + "_count"):
                out[line.split()[0]] = float(line.split()[1])
    return out


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a process's threads: `main` (the server's HTTP event loop,
    uvicorn's, on the main thread) and each other thread by its id (Python does not name OS
    threads: the busiest other one is the engine thread)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = "main" if task.name == str(pid) else f"thread {task.name}"
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_delta(before: dict, after: dict) -> dict:
    return {k: round(after.get(k, 0.0) - before.get(k, 0.0), 2) for k in sorted(set(before) | set(after))
            if after.get(k, 0.0) - before.get(k, 0.0) >= 0.01}


def clients(url: str, name: str, c: int, messages) -> tuple[list, float, float]:
    """c streaming clients over `messages` until all are answered: [(first step s, end s)], the
    CPU seconds they took (this process's) and the wall seconds from the first request sent to
    the last answer (a client process's start-up left out)."""
    import httpx

    todo = list(messages)
    lock = threading.Lock()
    results = []

    def client():
        while True:
            with lock:
                if not todo:
                    return
                seed, msgs = todo.pop(0)
            results.append(stream_one(httpx, url, name, seed, msgs))

    c0, t0 = time.process_time(), time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.process_time() - c0, time.perf_counter() - t0


def clients_main(spec: str) -> None:
    """`--clients-for SPEC`: a client process (SPEC: a JSON file {url, name, c, messages, and
    with `start_at`, the wall-clock time to start at}); prints {"results", "cpu_s", "wall_s",
    "end_at"}."""
    job = json.loads(Path(spec).read_text())
    import httpx  # noqa: F401 - imported before the start, not in the measured time

    if job.get("start_at"):
        time.sleep(max(0.0, job["start_at"] - time.time()))
    results, cpu, wall = clients(job["url"], job["name"], job["c"], job["messages"])
    print(json.dumps({"results": results, "cpu_s": cpu, "wall_s": wall, "end_at": time.time()}))


def client_processes(url: str, name: str, c: int, messages, port: int) -> tuple[list, float, float]:
    """c client processes of one streaming client each (no client shares a GIL with another),
    started together once all have imported: results, their CPU, the wall from the start to
    the last answer."""
    start_at = time.time() + 3.0 + 0.25 * c
    procs = []
    for i in range(c):
        spec = Path(tempfile.gettempdir()) / f"kvflow-serve-bench-clients-{port}-{i}.json"
        spec.write_text(json.dumps({"url": url, "name": name, "c": 1, "messages": messages[i::c],
                                    "start_at": start_at}))
        procs.append(subprocess.Popen([sys.executable, __file__, "--clients-for", str(spec)], stdout=subprocess.PIPE,
                                      text=True))
    answers = [json.loads(pr.communicate()[0].strip().splitlines()[-1]) for pr in procs]
    return ([r for a in answers for r in a["results"]], sum(a["cpu_s"] for a in answers),
            max(a["end_at"] for a in answers) - start_at)


def serve_levels(path: Path, name: str, messages, levels, soak: int, client_process="process") -> tuple[list, dict]:
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(Path(tempfile.gettempdir()) / f"kvflow-serve-bench-{port}.log", "w")
    record = Path(tempfile.mkdtemp(prefix="kvflow-serve-bench-record-"))
    # --record: each answered request's record has its server-side seconds (arrival to its
    # trajectory's end), set against the clients' own times (the HTTP path and the clients)
    proc = subprocess.Popen([*KVFLOW, "serve", str(path), "--port", str(port), "--record", str(record)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        stream_one(httpx, url, name, 10**6, messages[0][1])  # warm-up, as the run's
        out = []
        for c in levels:
            server_before, clock_before = thread_cpu(proc.pid), server_clock(httpx, url)
            if client_process == "processes":  # one process per client: no client shares a GIL
                results, client_cpu, wall = client_processes(url, name, c, messages, port)
            elif client_process:  # the clients in a process of their own: not on the bench's GIL
                spec = Path(tempfile.gettempdir()) / f"kvflow-serve-bench-clients-{port}.json"
                spec.write_text(json.dumps({"url": url, "name": name, "c": c, "messages": messages}))
                done = subprocess.run([sys.executable, __file__, "--clients-for", str(spec)], capture_output=True,
                                      text=True, check=True)
                answer = json.loads(done.stdout.strip().splitlines()[-1])
                results, client_cpu, wall = answer["results"], answer["cpu_s"], answer["wall_s"]
            else:
                results, client_cpu, wall = clients(url, name, c, messages)
            server_cpu = cpu_delta(server_before, thread_cpu(proc.pid))
            clock = {k: v - clock_before.get(k, 0.0) for k, v in server_clock(httpx, url).items()}
            answered = clock.get("kvflow_request_seconds_count") or 1
            time.sleep(0.5)  # a record is appended once its trajectory is released, maybe a step after its answer
            lines = (record / "samples.jsonl").read_text().splitlines() if (record / "samples.jsonl").exists() else []
            server_done = [json.loads(x)["seconds"] for x in lines[-len(results):]]
            out.append({"concurrency": c, "problems": len(results), "wall_s": round(wall, 3),
                        "problems_per_min": round(60 * len(results) / wall, 2),
                        "first_step_p50_s": pct([r[0] for r in results], 0.5),
                        "first_step_p95_s": pct([r[0] for r in results], 0.95),
                        "done_p50_s": pct([r[1] for r in results], 0.5),
                        "done_p95_s": pct([r[1] for r in results], 0.95),
                        "server_done_p50_s": pct(server_done, 0.5), "server_done_p95_s": pct(server_done, 0.95),
                        "client_first_step_mean_s": round(sum(r[0] for r in results) / len(results), 3),
                        "server_first_step_mean_s": round(clock.get("kvflow_time_to_first_step_seconds_sum", 0) / answered, 3),
                        "client_done_mean_s": round(sum(r[1] for r in results) / len(results), 3),
                        "server_done_mean_s": round(clock.get("kvflow_request_seconds_sum", 0) / answered, 3),
                        "server_cpu_s": server_cpu, "clients_cpu_s": round(client_cpu, 2),
                        "clients": {"process": "one process", "processes": "a process each"}.get(client_process,
                                                                                                   "bench threads")})
            print(json.dumps(out[-1]), file=sys.stderr, flush=True)
        soaked = {}
        if soak:
            samples = []

            def rss() -> int:
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) // 1024
                return 0

            def one(i):
                seed, msgs = messages[i % len(messages)]
                return stream_one(httpx, url, name, 1000 + i, msgs, cancel=(i % 4 == 3))

            every = max(1, soak // 10)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                for start in range(0, soak, every):
                    list(pool.map(one, range(start, min(soak, start + every))))
                    deadline = time.time() + 30
                    while True:  # the cancelled ones are released at their next step boundary
                        health = httpx.get(url + "/health").json()
                        if not any(health["rows"].values()) or time.time() > deadline:
                            break
                        time.sleep(0.1)
                    samples.append({"requests": min(soak, start + every), "rss_mib": rss(), "rows": health["rows"],
                                    "in_flight": health["in_flight"]})
            cancelled = [ln for ln in httpx.get(url + "/metrics").text.splitlines()
                         if ln.startswith("kvflow_requests_cancelled_total ")]
            soaked = {"requests": soak, "cancelled_every": 4, "concurrency": 8,
                      "wall_s": round(time.perf_counter() - t0, 1), "samples": samples,
                      "cancelled_total": float(cancelled[0].split()[1]) if cancelled else None}
        return out, soaked
    finally:
        proc.terminate()
        proc.wait(120)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipeline", type=Path, help="a pipeline file (default: kvflow.testing's tiny one)")
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64,
                    help="the tiny pipeline's committed tokens per problem (longer problems: less of a "
                         "request's time is HTTP and streaming)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--soak", type=int, default=0, help="requests of the memory/rows soak (0: none)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/bench/serve_throughput.json"))
    ap.add_argument("--clients", choices=("process", "processes", "threads"), default="process",
                    help="run the clients as threads of a process of their own (default), one process each, or "
                         "as threads of this one")
    ap.add_argument("--clients-for", help=argparse.SUPPRESS)  # the client process (internal)
    args = ap.parse_args()
    if args.clients_for:
        clients_main(args.clients_for)
        return
    import torch  # noqa: E402 - not needed by the client process

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.pipeline or tiny(Path(tmp), args.problems, args.max_tokens)
        from kvflow.config.validate import load_pipeline

        name = load_pipeline(path).pipeline.name
        concurrency = [int(c) for c in args.concurrency.split(",")]
        run, messages = run_baseline(path, args.problems)
        print(json.dumps({"run": run}), file=sys.stderr, flush=True)
        same_live = {}
        for c in concurrency:
            same_live[c] = run_baseline(path, args.problems, live=c)[0]
            print(json.dumps({"run_live": same_live[c]}), file=sys.stderr, flush=True)
        levels, soak = serve_levels(path, name, messages, concurrency, args.soak,
                                    False if args.clients == "threads" else args.clients)
    for lv in levels:
        lv["vs_run"] = round(lv["problems_per_min"] / run["problems_per_min"], 3)
        lv["run_same_live"] = same_live[lv["concurrency"]]
        lv["vs_run_same_live"] = round(lv["problems_per_min"] / same_live[lv["concurrency"]]["problems_per_min"], 3)
    result = {"bench": "serve_throughput", "command": " ".join(["python"] + sys.argv),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_line(),
              "load_avg": os.getloadavg(), "pipeline": str(args.pipeline or "kvflow.testing tiny (bench.jsonl)"),
              "run": run, "serve": levels, **({"soak": soak} if soak else {})}
    write_json(args.out, result, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
