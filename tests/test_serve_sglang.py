"""`kvflow serve` with an evicted base on SGLang: one `kvflow serve` process on 127.0.0.1 over
the tiny pipeline whose base (random-weight Qwen2, R-KV at B = 16) decodes in an SGLang worker
and whose helper stays on hf, spoken to through the `openai` SDK and httpx.

What is checked: a streamed answer (one chunk per committed step, kvflow's facts, usage per
proposer) with both engines' rows back to idle after it; a served request equals `kvflow run`
for the same prompt and seed on the same engines; the SGLang worker killed while a request is
in flight: that request ends with 503 (`engine_dead`), the server exits non-zero and leaves no
process behind (the last test: it ends the server).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import require_sglang
from test_serve import KVFLOW, MAX_TOKENS, _descendants, question_messages, start_server, wait_record

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def sglang_serving_pipeline(directory: Path) -> Path:
    from kvflow.testing.pipelines import tiny_pipeline

    return tiny_pipeline(directory, problems=2, max_tokens=MAX_TOKENS,
                         evictor={"kind": "rkv", "budget": 16, "buffer": 8, "window": 4},
                         extra={"models": {"base": {"backend": "sglang"}},
                                "limits": {"max_steps": 10},
                                "run": {"threads": 1, "batch_problems": 4, "live_problems": 4},
                                "serve": {"queue": 8}})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_sglang()
    directory = tmp_path_factory.mktemp("serve-sglang")
    srv = start_server(directory, "--grace", "30", pipeline=sglang_serving_pipeline(directory), timeout=300)
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait(30)


def _sglang_workers(pid: int) -> list[int]:
    found = []
    for child in _descendants(pid):
        try:
            if b"kvflow.backends.sglang.in_worker.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            pass
    return found


def test_a_streamed_answer_from_an_evicted_base_on_sglang(server):
    health = server.get("/health").json()
    assert set(health["rows"]) == {"base", "helper"}, health
    stream = server.client().chat.completions.create(model="tiny", messages=question_messages(1), max_tokens=60,
                                                      seed=5, stream=True)
    chunks = list(stream)
    steps = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert steps and [c.model_extra["kvflow"]["step"] for c in steps] == list(range(len(steps)))
    assert all(c.model_extra["kvflow"]["candidates"] == {"base": 2, "helper": 1} for c in steps)
    last = chunks[-1]
    assert last.choices[0].finish_reason in ("stop", "length")
    assert last.usage.model_extra["tokens_by_proposer"]["base"] > 0
    idle = server.wait_idle()
    assert idle["in_flight"] == 0 and not any(idle["rows"].values()), idle  # the SGLang engine's rows too


def test_served_request_equals_kvflow_run_on_sglang(server, tmp_path):
    """Problem 0 through `kvflow run` (its own SGLang worker, same pipeline) and the same prompt
    with seed 0 through the server: the same committed steps (SGLang samples each row from a
    hash of its seed and position, in any batch)."""
    out = tmp_path / "run"
    done = subprocess.run([*KVFLOW, "run", str(server.pipeline), "--set", f"run.output={out}",
                           "--set", "dataset.limit=1"], capture_output=True, text=True, timeout=600, env=server.env)
    assert done.returncode == 0, done.stderr
    (ran,) = [json.loads(line) for line in next(out.glob("*/samples.jsonl")).read_text().splitlines()]
    reply = server.client().chat.completions.create(model="tiny", messages=question_messages(0), seed=0)
    rec = wait_record(server, reply.id)
    assert rec["prompt"] == ran["prompt"]
    assert [(s["text"], s["source"], s["n_tokens"]) for s in rec["steps"]] == \
           [(s["text"], s["source"], s["n_tokens"]) for s in ran["steps"]]
    assert any(s["source"] == "base" for s in ran["steps"]) or ran["tokens_generated"]["base"] > 0


def test_a_killed_engine_fails_the_request_in_flight_and_the_server_exits_non_zero(server):
    """Last: the SGLang worker is killed while a request decodes on it: that request gets a 503
    naming the dead engine, /health says dead while the server stops, it exits 1, and no
    process of it is left."""
    (worker,) = _sglang_workers(server.proc.pid)
    children = _descendants(server.proc.pid)
    got: dict = {}

    def ask():
        got["reply"] = server.post("/v1/chat/completions", {"model": "tiny", "messages": question_messages(1),
                                                            "seed": 9, "max_tokens": MAX_TOKENS})

    t = threading.Thread(target=ask)
    t.start()
    deadline = time.monotonic() + 60
    while not server.get("/health").json()["rows"].get("base"):  # decoding on SGLang now
        assert time.monotonic() < deadline and t.is_alive(), "the request never reached the SGLang engine"
        time.sleep(0.02)
    os.kill(worker, signal.SIGKILL)
    t.join(120)
    reply = got["reply"]
    assert reply.status_code == 503, reply.text
    assert reply.json()["error"]["code"] == "engine_dead", reply.text
    try:
        health = server.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "dead", health.text
    except httpx.HTTPError:
        pass  # already stopped: the exit code below says the rest
    assert server.proc.wait(60) == 1, server.log.read_text()
    time.sleep(0.5)
    left = [p for p in children if Path(f"/proc/{p}").exists()
            and "zombie" not in Path(f"/proc/{p}/status").read_text().lower()]
    assert not left, left
