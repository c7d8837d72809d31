"""The served-engine core (kvflow.backends.served): one message format and one registry of
worker processes for every backend. The workers here are real processes speaking the wire
format (a few lines of Python, no engine): what is tested is the registry and the wire, which
the SGLang and vLLM suites then run under real engines."""

from __future__ import annotations

import io
import math
import sys

import pytest

from kvflow.backends.served import wire
from kvflow.backends.served.worker import Worker, _SHARED, close_idle, hold, shared
from kvflow.errors import EngineError

#: a worker that says ready and answers "generate" with one token and an end, until "shutdown"
ECHO = r"""
import sys
from kvflow.backends.served.wire import read_message, write_message
hello = read_message(sys.stdin)
if hello.get("fail"):
    write_message(sys.stdout, ["error", None, "asked to fail"])
    sys.exit(1)
write_message(sys.stdout, ["ready", {"version": "0", "settings": {"who": hello["who"]}}])
while True:
    msg = read_message(sys.stdin)
    if msg is None or msg[0] == "shutdown":
        break
    if msg[0] == "generate":
        write_message(sys.stdout, ["tokens", msg[1], [7], [-0.5], [[[-0.5, 7]]]])
        write_message(sys.stdout, ["end", msg[1], "length", {"prompt_tokens": 3, "completion_tokens": 1}])
    if msg[0] == "die":
        sys.exit(3)
"""


def _start(who: str, **hello):
    return lambda: Worker.start([sys.executable, "-c", ECHO], None, {"who": who, **hello},
                                where=f"worker {who}", engine_name=who, timeout=60)


@pytest.fixture
def registry():
    before = dict(_SHARED)
    yield
    for key, worker in list(_SHARED.items()):
        if key not in before:
            worker.close()


def test_a_message_is_one_json_line_and_arrays_go_as_lists():
    import torch

    out = io.StringIO()
    wire.write_message(out, ["scored", "r", {"values": torch.tensor([[1.5, math.nan]])}, {"n": 1}])
    assert out.getvalue().count("\n") == 1
    back = wire.read_message(io.StringIO("\n" + out.getvalue()))
    assert back[:2] == ["scored", "r"] and back[2]["values"][0][0] == 1.5 and math.isnan(back[2]["values"][0][1])
    assert wire.read_message(io.StringIO("")) is None
    with pytest.raises(TypeError, match="cannot cross"):
        wire.write_message(io.StringIO(), [object()])


def test_sglang_finish_reasons_become_the_shared_words():
    from kvflow.backends.sglang.in_worker.worker import finish_of

    assert finish_of({"type": "stop", "matched": 151643}, {})[0] == wire.STOP_TOKEN
    assert finish_of({"type": "stop", "matched": "\n\n"}, {})[0] == wire.STOP_STRING
    assert finish_of({"type": "length", "length": 8}, {})[0] == wire.LENGTH
    word, meta = finish_of({"type": "abort", "message": "too long"}, {"prompt_tokens": 1})
    assert word == wire.ABORT and meta == {"prompt_tokens": 1, "message": "too long"}


def test_one_registry_closes_idle_workers_of_every_backend_before_a_new_one_starts(registry):
    sglang = shared(("sglang", "a"), _start("SGLang"))
    sglang.holders = 1  # an engine handed out on it
    vllm = shared(("vllm", "b"), _start("vLLM"))
    vllm.holders = 1
    assert shared(("sglang", "a"), _start("SGLang")) is sglang, "the same arguments share the running worker"
    sglang.holders = vllm.holders = 0  # both engines closed: the workers are idle
    held = shared(("vllm", "c"), _start("vLLM"))  # idle workers of both backends go first
    assert sglang.proc.poll() is not None and vllm.proc.poll() is not None, "an idle worker outlived a new start"
    assert ("sglang", "a") not in _SHARED and ("vllm", "b") not in _SHARED
    held.holders = 1
    fresh = shared(("sglang", "d"), _start("SGLang"))
    assert held.proc.poll() is None and fresh.proc.poll() is None, "a held worker was closed"
    held.holders = 0
    assert close_idle() == 2 and held.proc.poll() is not None and fresh.proc.poll() is not None


def test_a_worker_answers_and_its_death_is_an_engine_error(registry):
    worker = shared(("echo", "e"), _start("Echo"))
    assert worker.info["settings"] == {"who": "Echo"}
    assert hold(worker, lambda: _Idle()) is hold(worker, lambda: _Idle()) and worker.holders == 2
    worker.send("generate", "r1", [1, 2, 3], {})
    got = []
    while len(got) < 2:
        got += worker.poll(5.0)
    assert [m[0] for m in got] == ["tokens", "end"] and got[1][2] == wire.LENGTH
    worker.send("die", "x")
    with pytest.raises(EngineError, match="worker Echo: the Echo worker exited"):
        for _ in range(100):
            worker.poll(0.1)


def test_a_worker_that_cannot_start_says_why(registry):
    with pytest.raises(EngineError, match="Echo engine did not start: asked to fail"):
        _start("Echo", fail=True)()


class _Idle:
    """What `hold` resets between holders (the engine object a backend builds over a worker)."""

    def reset(self) -> None:
        pass
