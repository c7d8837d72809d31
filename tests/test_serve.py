"""`kvflow serve` against a real server: one `kvflow serve` process on 127.0.0.1 (a free port)
over tiny random-weight hf models for the whole module, spoken to through the official
`openai` SDK and raw HTTP (httpx). The last test stops it with SIGTERM.

What is checked: answers (non-streamed and streamed, each committed step one chunk with
kvflow's facts, usage per proposer); a served request equals `kvflow run` for the same prompt
and seed (same committed steps); seed/stop/max_tokens honoured; 32 concurrent clients (each
answered or 429 with Retry-After); every bad request a 4xx and the server still well; the API
key; a client that goes away mid-stream or while waiting for a whole answer (a closed socket,
the SDK's timeout: cancelled, rows back to idle); unknown routes in OpenAI's error shape;
records for `kvflow report`; SIGTERM drains the request in flight (/health says "draining",
new requests get 503) and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import make_dist

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

KEY = "test-key"
MAX_TOKENS = 160
KVFLOW = [sys.executable, "-c", "from kvflow.cli import main; main()"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: a third party's scorer: the likelihood scorer, except that it raises on a prompt saying BOOM;
#: and a pruner that makes a step slow on demand (the drain test)
BOOM_PLUGIN = {
    "boomplug": """
        import os
        import time

        import torch

        from kvflow.components.base import Pruner, PrunerParams
        from kvflow.hookspecs import hookimpl
        from kvflow_builtin.scorers.likelihood import LikelihoodScorer


        class BoomScorer(LikelihoodScorer):
            def score(self, requests):
                if any("BOOM" in r.trajectory.prompt for r in requests):
                    raise RuntimeError("the scorer does not like BOOM")
                return super().score(requests)


        @hookimpl
        def register_scorers(register):
            register("boom_likelihood", "boomplug:BoomScorer")


        class SlowPruner(Pruner):  # stops nothing; once the file $KVFLOW_TEST_SLOW_FLAG exists, 50 ms a token
            Params = PrunerParams
            needs_text = False

            def check(self, trace):
                flag = os.environ.get("KVFLOW_TEST_SLOW_FLAG")
                if flag and os.path.exists(flag):
                    time.sleep(0.05)
                return torch.zeros(len(trace.n_tokens), dtype=torch.bool)


        @hookimpl
        def register_pruners(register):
            register("slow", "boomplug:SlowPruner")
    """,
}


def tiny_serving_pipeline(directory: Path, **serve) -> Path:
    from kvflow.testing.pipelines import tiny_pipeline

    return tiny_pipeline(directory, problems=2, max_tokens=MAX_TOKENS, scorer={"kind": "boom_likelihood"}, extra={
        "limits": {"max_steps": 10},
        "run": {"threads": 1, "batch_problems": 4, "live_problems": 4},
        "serve": {"queue": 8, "max_body_bytes": 4096, "max_prompt_tokens": 300, **serve},
    })


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, pipeline: Path, record: Path, log: Path, env: dict) -> None:
        self.proc, self.port, self.pipeline, self.record, self.log, self.env = proc, port, pipeline, record, log, env
        self.url = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {KEY}"}

    def client(self):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def post(self, path: str, body, **kw):
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.url + path, content=data, headers={**self.headers, "content-type": "application/json",
                                                                  **kw.pop("headers", {})}, timeout=120, **kw)

    def get(self, path: str, **kw):
        return httpx.get(self.url + path, headers=self.headers, timeout=30, **kw)

    def wait_idle(self, timeout: float = 60) -> dict:
        """/health once nothing is in flight and every engine's rows are back to 0."""
        deadline = time.monotonic() + timeout
        while True:
            health = self.get("/health").json()
            if (health["in_flight"] == 0 and health["queued"] == 0 and not any(health["rows"].values())) \
                    or time.monotonic() > deadline:
                return health
            time.sleep(0.05)

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def start_server(directory: Path, *args: str, env: dict | None = None, pipeline: Path | None = None,
                 timeout: float = 180) -> Server:
    """A `kvflow serve` process over `pipeline` (default: the tiny hf one), once /health answers."""
    pipeline = pipeline or tiny_serving_pipeline(directory)
    port = free_port()
    record = directory / "served"
    log = directory / "serve.log"
    plugins = make_dist(directory / "plugins", "boomplug", {"boomplug": "boomplug"}, BOOM_PLUGIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH")])),
           **(env or {})}
    proc = subprocess.Popen([*KVFLOW, "serve", str(pipeline), "--port", str(port), "--record", str(record), *args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**env, "KVFLOW_API_KEY": KEY})
    server = Server(proc, port, pipeline, record, log, env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"kvflow serve exited {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"kvflow serve did not start:\n{log.read_text()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("serve"), "--grace", "30")
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait(30)


def wait_record(server: Server, request_id: str, timeout: float = 30) -> dict:
    """The request's record (appended once its trajectory is released, maybe a step after its answer)."""
    deadline = time.monotonic() + timeout
    while True:
        path = server.record / "samples.jsonl"
        served = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        found = [r for r in served if r["request_id"] == request_id]
        if found or time.monotonic() > deadline:
            assert len(found) == 1, f"no record of {request_id}"
            return found[0]
        time.sleep(0.1)


def question_messages(i: int) -> list[dict]:
    """The messages `kvflow run` renders for problem i of the tiny dataset."""
    from kvflow.eval.prompts import get_prompt
    from kvflow.testing.pipelines import PROBLEMS

    return get_prompt("qwen25-math-cot").messages(PROBLEMS[i][0])


# --------------------------------------------------------------------------- answers


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    health = httpx.get(server.url + "/health").json()  # no key needed
    assert health["status"] == "ok" and set(health["rows"]) == {"base", "helper"}


def test_chat_through_the_openai_sdk(server):
    reply = server.client().chat.completions.create(model="tiny", messages=question_messages(1), max_tokens=40,
                                                     seed=5)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert 0 < usage.completion_tokens <= 40 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert set(usage.model_extra["tokens_by_proposer"]) == {"base", "helper"}
    steps = reply.model_extra["kvflow"]["steps"]
    assert steps and [s["step"] for s in steps] == list(range(len(steps)))
    assert all(s["source"] in ("base", "helper") and s["candidates"] == {"base": 2, "helper": 1} for s in steps)


def test_streaming_one_chunk_per_committed_step(server):
    stream = server.client().chat.completions.create(model="tiny", messages=question_messages(1), max_tokens=40,
                                                      seed=5, stream=True)
    chunks = list(stream)
    steps = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    last = chunks[-1]
    assert steps and all(c.model_extra["kvflow"]["step"] == i for i, c in enumerate(steps))
    assert steps[0].choices[0].delta.role == "assistant"
    assert last.choices[0].finish_reason in ("stop", "length") and last.usage.completion_tokens <= 40
    # the same request, not streamed, gives the same text and steps
    whole = server.client().chat.completions.create(model="tiny", messages=question_messages(1), max_tokens=40,
                                                     seed=5)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    streamed = [c.model_extra["kvflow"] for c in steps]
    facts = whole.model_extra["kvflow"]["steps"]
    assert [dict(f, score=None) for f in streamed] == [dict(f, score=None) for f in facts]
    assert all(a["score"] == pytest.approx(b["score"], abs=1e-4) for a, b in zip(streamed, facts))  # batching noise
    # raw completions stream too (text_completion chunks)
    text = server.client().completions.create(model="tiny", prompt="Question: 1+1?\nAnswer:", max_tokens=20,
                                              stream=True)
    parts = list(text)
    assert parts[-1].choices[0].finish_reason in ("stop", "length") and parts[-1].usage.completion_tokens <= 20


def test_served_request_equals_kvflow_run(server, tmp_path):
    """Problem 0 of the pipeline's dataset through `kvflow run`, and the same prompt with seed 0
    through the server: the same committed steps (text, source, tokens; scores within float noise)."""
    out = tmp_path / "run"
    done = subprocess.run([*KVFLOW, "run", str(server.pipeline), "--set", f"run.output={out}",
                           "--set", "dataset.limit=1"], capture_output=True, text=True, timeout=600, env=server.env)
    assert done.returncode == 0, done.stderr
    (ran,) = [json.loads(line) for line in next(out.glob("*/samples.jsonl")).read_text().splitlines()]
    assert ran["id"] == "tiny/0"
    reply = server.client().chat.completions.create(model="tiny", messages=question_messages(0), seed=0)
    rec = wait_record(server, reply.id)
    assert rec["prompt"] == ran["prompt"]
    assert [(s["text"], s["source"], s["n_tokens"]) for s in rec["steps"]] == \
           [(s["text"], s["source"], s["n_tokens"]) for s in ran["steps"]]
    for a, b in zip(rec["steps"], ran["steps"]):
        assert (a["score"] is None) == (b["score"] is None)
        assert a["score"] is None or abs(a["score"] - b["score"]) < 1e-4
    assert ran["output"].startswith(reply.choices[0].message.content)


def test_seed_stop_and_max_tokens(server):
    client = server.client()
    kw = dict(model="tiny", messages=question_messages(1), seed=11)
    a = client.chat.completions.create(**kw).choices[0].message.content
    assert client.chat.completions.create(**kw).choices[0].message.content == a  # seeded: the same answer
    stop = a[len(a) // 2: len(a) // 2 + 3]
    cut = client.chat.completions.create(**kw, stop=[stop, "never-there"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == a[: a.index(stop)]
    short = client.chat.completions.create(**kw, max_completion_tokens=5)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 5
    assert a.startswith(short.choices[0].message.content)


# --------------------------------------------------------------------------- load, bad requests, keys


def test_32_concurrent_clients(server):
    """Everything is answered, or refused with 429 and Retry-After past live_problems + queue (4 + 8)."""
    def one(i: int):
        return server.post("/v1/chat/completions", {"model": "tiny", "max_tokens": 8, "seed": i,
                                                    "messages": [{"role": "user", "content": f"count to {i}"}]})

    with ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(one, range(32)))
    codes = [r.status_code for r in replies]
    assert set(codes) <= {200, 429}, [(r.status_code, r.text) for r in replies if r.status_code not in (200, 429)]
    assert codes.count(200) >= 4
    for r in replies:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
            assert "12 requests accepted" in r.json()["error"]["message"]  # 4 in flight + 8 queued, however split
            assert "4 decoding at once" in r.json()["error"]["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] <= 8
    health = server.wait_idle()
    assert health["in_flight"] == 0 and health["rows"] == {"base": 0, "helper": 0}, health


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
BAD = [
    ("malformed JSON", b'{"model": "tiny", "messages": [', 400, None),
    ("not an object", [1, 2], 400, None),
    ("empty messages", {**CHAT, "messages": []}, 400, "messages"),
    ("bad role", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0]"),
    ("unknown model", {**CHAT, "model": "gpt-4o"}, 404, "model"),
    ("no model", {"messages": CHAT["messages"]}, 400, "model"),
    ("temperature", {**CHAT, "temperature": 0}, 400, "temperature"),
    ("top_p", {**CHAT, "top_p": 0.5}, 400, "top_p"),
    ("n > 1", {**CHAT, "n": 2}, 400, "n"),
    ("top_logprobs", {**CHAT, "logprobs": True, "top_logprobs": 2}, 400, "top_logprobs"),
    ("tools", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("response_format", {**CHAT, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("unknown field", {**CHAT, "frobnicate": 1}, 400, "frobnicate"),
    ("max_tokens past the limit", {**CHAT, "max_tokens": MAX_TOKENS + 1}, 400, "max_tokens"),
    ("max_tokens zero", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("seed not an int", {**CHAT, "seed": "7"}, 400, "seed"),
    ("five stops", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("prompt too long", {**CHAT, "messages": [{"role": "user", "content": "seven " * 400}]}, 400, "messages"),
    ("oversized body", {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}, 413, None),
]


@pytest.mark.parametrize("what,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_are_4xx(server, what, body, status, param):
    reply = server.post("/v1/chat/completions", body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"] and error["param"] == param
    if param in ("temperature", "top_p", "n", "tools", "response_format"):
        assert f"`{param}` is decided by the pipeline" in error["message"] and "serve.ignore" in error["message"]


def test_bad_completions_and_server_still_well(server):
    for body, param in (({"model": "tiny", "prompt": ""}, "prompt"),
                        ({"model": "tiny", "prompt": [[1], [2]]}, "prompt"),
                        ({"model": "tiny", "prompt": [1, -2]}, "prompt"),
                        ({"model": "tiny", "prompt": "x", "echo": True, "max_tokens": 5}, "max_tokens"),
                        ({"model": "tiny", "prompt": "x", "echo": True, "logprobs": 50}, "logprobs"),
                        ({"model": "tiny", "prompt": "x", "logprobs": 1}, "logprobs"),
                        ({"model": "tiny", "prompt": "x", "best_of": 3}, "best_of")):
        reply = server.post("/v1/completions", body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    for reply, status in ((server.post("/v1/nothing", CHAT), 404), (server.get("/v1/chat/completions"), 405)):
        assert reply.status_code == status
        assert reply.json()["error"]["type"] == "invalid_request_error" if status == 405 else "not_found_error"
        assert reply.json()["error"]["message"]
    assert server.client().chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=4).choices
    assert server.metric('kvflow_requests_total{endpoint="/v1/chat/completions",status="500"}') == 0


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        reply = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=headers)
        assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
        assert httpx.get(server.url + "/metrics", headers=headers).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_another_host_needs_an_api_key(server):
    env = {k: v for k, v in server.env.items() if k != "KVFLOW_API_KEY"}
    done = subprocess.run([*KVFLOW, "serve", str(server.pipeline), "--host", "0.0.0.0", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and "needs an API key" in done.stderr, done.stderr


def test_bad_pipeline_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kvflow: 1\nname: bad\nmodels: {}\nproposers: {base: {model: nowhere}}\nserve: {queue: -1}\n")
    done = subprocess.run([*KVFLOW, "serve", str(bad)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "serve.queue" in done.stderr and "Traceback" not in done.stderr


def test_a_component_fault_fails_its_request_alone(server):
    """The scorer raises on one request's problem: that request gets a 500 naming the scorer,
    the requests decoding beside it are answered, and the server goes on."""
    def ask(content: str):
        return server.post("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": content}],
                                                    "max_tokens": 60, "seed": 1})

    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(ask, ["fine one", "BOOM", "fine two"]))
    assert [r.status_code for r in replies] == [200, 500, 200], [r.text for r in replies]
    error = replies[1].json()["error"]
    assert error["message"].startswith("scorer failed: RuntimeError: the scorer does not like BOOM")
    assert error["code"] == "component_error"
    health = server.wait_idle()
    assert health["status"] == "ok" and health["rows"] == {"base": 0, "helper": 0}, health
    assert ask("fine again").status_code == 200


# --------------------------------------------------------------------------- cancellation, records, shutdown


def test_client_gone_mid_stream_cancels_and_rows_return_to_idle(server):
    before = server.metric("kvflow_requests_cancelled_total")
    steps_before = server.metric('kvflow_committed_steps_total{source="base"}') + \
        server.metric('kvflow_committed_steps_total{source="helper"}')
    for i in range(2):
        with httpx.stream("POST", server.url + "/v1/chat/completions", headers=server.headers, timeout=60,
                          json={**CHAT, "stream": True, "seed": 100 + i}) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    assert json.loads(line[6:])["kvflow"]["step"] == 0
                    break  # leave with the rest of the answer unread: the connection closes
    health = server.wait_idle()
    assert health["in_flight"] == 0 and health["rows"] == {"base": 0, "helper": 0}, health
    assert server.metric("kvflow_requests_cancelled_total") == before + 2
    steps = server.metric('kvflow_committed_steps_total{source="base"}') + \
        server.metric('kvflow_committed_steps_total{source="helper"}')
    assert steps - steps_before < 2 * 10  # each stopped well before its 10 steps


LONG = {**CHAT, "seed": 4}  # 10 committed steps (limits.max_steps), about a second here


def test_client_gone_while_waiting_for_a_whole_answer_cancels(server):
    """Not streamed: a client whose socket closes, and the SDK's timeout, each cancel their request
    at its next step boundary (counted cancelled, answered 499, rows back to idle), instead of
    decoding to the end."""
    before = server.metric("kvflow_requests_cancelled_total")
    closed = server.metric('kvflow_requests_total{endpoint="/v1/chat/completions",status="499"}')
    steps_before = server.metric('kvflow_committed_steps_total{source="base"}') + \
        server.metric('kvflow_committed_steps_total{source="helper"}')
    body = json.dumps(LONG).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.25)
    server.wait_idle()
    with pytest.raises(openai.APITimeoutError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=0.25).chat.completions.create(
            model="tiny", messages=LONG["messages"], seed=LONG["seed"])
    health = server.wait_idle()
    assert health["in_flight"] == 0 and health["rows"] == {"base": 0, "helper": 0}, health
    assert server.metric("kvflow_requests_cancelled_total") == before + 2
    assert server.metric('kvflow_requests_total{endpoint="/v1/chat/completions",status="499"}') == closed + 2
    steps = server.metric('kvflow_committed_steps_total{source="base"}') + \
        server.metric('kvflow_committed_steps_total{source="helper"}')
    assert steps - steps_before < 2 * 10  # each stopped before its 10 steps


def test_records_read_by_kvflow_report(server, tmp_path):
    records = [json.loads(line) for line in (server.record / "samples.jsonl").read_text().splitlines()]
    assert records and all(r["id"] == r["request_id"] and "timing" in r and r["served"]["finish_reason"]
                           for r in records)
    done = subprocess.run([*KVFLOW, "report", str(server.record), "--out", str(tmp_path / "report")],
                          capture_output=True, text=True, timeout=300, env=server.env)
    assert done.returncode == 0, done.stderr
    # served traffic is "served", with no accuracy, and its own table (issue 40)
    import csv

    (run,) = csv.DictReader((tmp_path / "report" / "runs.csv").open())
    assert run["complete"] == "served" and run["accuracy"] == "" and run["degeneration rate"] == ""
    (served,) = csv.DictReader((tmp_path / "report" / "served.csv").open())
    assert int(served["requests"]) == len(records)
    assert int(served["completion tokens"]) == sum(r["served"]["completion_tokens"] for r in records)
    assert int(served["steps: base"]) + int(served["steps: helper"]) == sum(len(r["steps"]) for r in records)
    assert 0 < float(served["latency p50 s"]) <= float(served["latency p95 s"])


def _descendants(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for c in map(int, children):
            out |= {c} | _descendants(c)
    return out


def test_sigterm_drains_and_leaves_no_process(server):
    """Last: SIGTERM while a stream is in flight: the server drains (/health answers 503
    "draining", a new request 503), the stream is answered to its end, the process exits 0
    within the grace period, and none of its child processes is left."""
    children = _descendants(server.proc.pid)  # the grader's worker, once a grade needed it; SGLang's workers
    got: dict = {}
    first = threading.Event()

    def stream():
        chunks = []
        with httpx.stream("POST", server.url + "/v1/chat/completions", headers=server.headers, timeout=120,
                          json={**LONG, "stream": True}) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
                    first.set()
        got["chunks"] = chunks

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while (health := httpx.get(server.url + "/health", timeout=5)).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert health.status_code == 503 and health.json()["status"] == "draining", health.text
    late = server.post("/v1/chat/completions", CHAT)
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    assert server.proc.wait(60) == 0, server.log.read_text()
    t.join(30)
    assert got["chunks"][-1] == "[DONE]" and json.loads(got["chunks"][-2])["choices"][0]["finish_reason"]
    time.sleep(0.5)
    left = [p for p in children if Path(f"/proc/{p}").exists()
            and "zombie" not in Path(f"/proc/{p}/status").read_text().lower()]
    assert not left, left
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url + "/health", timeout=2)


def test_ended_answers_stop_decoding_mid_step_and_a_drain_ends_promptly(tmp_path):
    """Steps made long (a pruner that takes 50 ms a token once a flag file exists, steps of up to
    200 tokens, no delimiter: up to 10 s to a step's end; the seeds' trajectories have steps of
    200 tokens and more, after kvflow.testing's tiny models). A request answered at its first step
    (max_tokens 1) has its trajectory's next step stopped at once (the hf engine's `cancel`):
    nothing in flight, rows 0, within 3 s. Then SIGTERM with `--grace 2` while a streamed answer
    is in a long step: the stream ends with a 503 when the grace period is over and the server
    stops its engines within 5 s of the signal (exit 0), not at the step's end."""
    from kvflow.testing.pipelines import tiny_pipeline

    flag = tmp_path / "slow"
    pipeline = tiny_pipeline(tmp_path, problems=2, max_tokens=1000, max_step_tokens=200,
                             pruners=[{"kind": "slow", "threshold": 1}], extra={"limits": {"max_steps": 10},
                                                                                "run": {"threads": 1, "delimiter": "@@@@"}})
    srv = start_server(tmp_path, "--grace", "2", pipeline=pipeline, env={"KVFLOW_TEST_SLOW_FLAG": str(flag)})
    try:
        answered = srv.post("/v1/chat/completions", {**CHAT, "seed": 4, "max_tokens": 1})
        assert answered.status_code == 200 and answered.json()["choices"][0]["finish_reason"] == "length"
        flag.touch()  # the step being decoded now crawls
        started = time.monotonic()
        while (health := httpx.get(srv.url + "/health").json())["in_flight"] or any(health["rows"].values()):
            assert time.monotonic() - started < 3, health
            time.sleep(0.05)
        assert wait_record(srv, answered.json()["id"])["served"]["finish_reason"] == "length"

        flag.unlink()
        events, first = [], threading.Event()

        def stream():
            with httpx.stream("POST", srv.url + "/v1/chat/completions", headers=srv.headers, timeout=60,
                              json={**CHAT, "seed": 8, "stream": True}) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        flag.touch()
        started = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        while "kvflow: stopped" not in srv.log.read_text() and time.monotonic() - started < 30:
            time.sleep(0.02)
        assert time.monotonic() - started < 5, srv.log.read_text()  # engines stopped (the interpreter's exit follows)
        assert srv.proc.wait(30) == 0, srv.log.read_text()
        reader.join(30)
        assert events[-1].startswith("{") and json.loads(events[-1])["error"]["code"] == "shutting_down", events[-3:]
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait(30)
