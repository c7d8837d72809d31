"""Admission by KV memory (`run.kv_memory`, issue 39) through the real `kvflow run` on tiny
models: the bytes reserved by the problems in flight never exceed the bound, the records are
those of admission by count for the same seeds, a problem larger than the bound by itself is
refused before anything is written (exit 2, naming run.kv_memory), and `kvflow explain` says
how many problems fit."""

from __future__ import annotations

import json

from test_scheduler_runs import _records

from kvflow.testing import tiny_pipeline

# the tiny base (2 layers x 2 KV heads x head_dim 16, float32): 512 bytes per token; an evicted
# row at budget 16 + buffer 8 + a scratch slot is 25 x 512 = 12,800 bytes, a problem with n = 2
# holds 3 rows (2 candidates + its state): 38,400 bytes
EVICTED = {"kind": "random", "budget": 16, "buffer": 8, "window": 4}
PROBLEM_BYTES = 3 * 25 * 512


def _pipeline(directory, kv_memory=None, helper=False, count=None):
    run = {"kv_memory": kv_memory, "batch_problems": None} if kv_memory is not None else dict(count or {})
    return tiny_pipeline(directory, problems=4, n=2, max_tokens=24, evictor=EVICTED, helper=helper,
                         extra={"limits": {"max_steps": 4}, "run": run})


def _run_dir(directory):
    (run_dir,) = (directory / "results").iterdir()
    return run_dir


def test_admission_never_exceeds_the_bound_and_fills_it(tmp_path, cli):
    bound = 2 * PROBLEM_BYTES + PROBLEM_BYTES // 2  # room for two problems, not three
    path = _pipeline(tmp_path, kv_memory=bound)
    result = cli("run", path)
    assert result.exit_code == 0, result.output
    manifest = json.loads((_run_dir(tmp_path) / "manifest.json").read_text())
    kv = manifest["kv_admission"]
    assert kv["bound"] == bound
    assert kv["peak_bytes"] <= bound  # never more than the bound reserved
    assert kv["peak_bytes"] == 2 * PROBLEM_BYTES and kv["peak_problems"] == 2  # and the room was used
    assert kv["peak_rows"] == 4
    assert len((_run_dir(tmp_path) / "samples.jsonl").read_text().splitlines()) == 4


def test_records_equal_those_of_admission_by_count(tmp_path, cli):
    """An evicted base and a full-context helper: memory admits 2 problems of 4 at a time where
    count admits all 4, and every record is the same (the seeding is per problem)."""
    by_count = _pipeline(tmp_path / "count", helper=True, count={"batch_problems": 4, "live_problems": 4})
    assert cli("run", by_count).exit_code == 0
    by_memory = _pipeline(tmp_path / "memory", helper=True, kv_memory="500KiB")
    result = cli("run", by_memory)
    assert result.exit_code == 0, result.output
    kv = json.loads((_run_dir(tmp_path / "memory") / "manifest.json").read_text())["kv_admission"]
    assert kv["peak_bytes"] <= 500 * 1024 and 1 < kv["peak_problems"] < 4
    assert _records(_run_dir(tmp_path / "memory")) == _records(_run_dir(tmp_path / "count"))


def test_a_problem_larger_than_the_bound_is_refused_before_anything_is_written(tmp_path, cli):
    path = _pipeline(tmp_path, kv_memory=PROBLEM_BYTES - 1)
    for command in ("validate", "run"):  # from the models' configs, before any model loads
        result = cli(command, path)
        assert result.exit_code == 2, result.output
        assert f"{path}:" in result.output and "run.kv_memory" in result.output
        assert f"needs {PROBLEM_BYTES} bytes" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "results").exists()


def test_a_prompt_too_long_for_the_bound_is_refused_once_tokenized(tmp_path, cli):
    """A full-context helper's rows grow with the prompt: the bound holds an empty prompt (so
    `validate` passes) but not the dataset's first one, which `run` finds after loading the
    models and before writing anything."""
    path = _pipeline(tmp_path, kv_memory="120KiB", helper=True)
    assert cli("validate", path).exit_code == 0
    result = cli("run", path)
    assert result.exit_code == 2, result.output
    assert "run.kv_memory" in result.output and "for problem tiny/0" in result.output
    assert not (tmp_path / "results").exists()


def test_bad_kv_memory_values_are_refused_with_the_field(tmp_path, cli):
    path = _pipeline(tmp_path, kv_memory="lots")
    result = cli("validate", path)
    assert result.exit_code == 2 and "run.kv_memory" in result.output and "not a byte size" in result.output


def test_explain_prints_bytes_per_row_and_problems_that_fit(tmp_path, cli):
    path = _pipeline(tmp_path, kv_memory="100KiB", helper=True)
    out = cli("explain", path).output
    assert "run: seed=0, kv_memory=100KiB," in out
    assert "KV admission: run.kv_memory 100KiB = 102400 bytes (100.0 KiB):" in out
    assert ("base: 12.5 KiB per evicted row (budget + buffer + scratch slot), x 3 rows (n=2 + the problem's state) "
            "= 37.5 KiB per problem; 2 problems fit on its rows alone") in out
    # the helper (2 layers x 3 KV heads x head_dim 16, float32: 768 bytes per token), full context
    # at a typical 256-token prompt + limits.max_tokens 24 + 1 = 281 tokens, 2 rows (n = 1 + its state)
    assert "helper: 210.8 KiB per full-context row (prompt 256 + limits.max_tokens 24 + 1 tokens), x 2 rows" in out
    assert "per problem 459.0 KiB: 0 problems in flight at this memory" in out
    unset = cli("explain", _pipeline(tmp_path / "count", helper=True, count={"batch_problems": 4})).output
    assert "KV admission: by count (run.kv_memory unset)" in unset


def test_served_requests_are_admitted_by_kv_memory(tmp_path):
    """`kvflow serve`'s engine thread (`kvflow.serve.loop.Loop`, no HTTP) under run.kv_memory:
    6 requests at once, at most 2 in flight by memory, all answered; a prompt too long to fit
    by itself is refused with a 400 naming run.kv_memory before it is queued."""
    import asyncio

    from kvflow.config.validate import load_pipeline
    from kvflow.registry import get_registry
    from kvflow.runtime.session import Session
    from kvflow.serve.loop import Job, Loop
    from kvflow.serve.metrics import Metrics
    from kvflow.serve.protocol import ApiError, Request

    bound = 2 * PROBLEM_BYTES + PROBLEM_BYTES // 2
    loaded = load_pipeline(_pipeline(tmp_path, kv_memory=bound))
    with Session(loaded, get_registry()) as session:
        loop = Loop(session, Metrics(), queue=8)
        assert loop.max_live == 2  # the most run.kv_memory can admit: sizes the queue past which 429
        loop.start()

        async def ask(i: int, prompt: str):
            job = Job(Request("completion", "m", max_tokens=1000, seed=i, prompt=prompt), prompt, 0,
                      asyncio.get_running_loop(), prompt)
            loop.submit(job)
            while True:
                event = await job.events.get()
                if event[0] in ("end", "error"):
                    return event[0]

        async def main():
            return await asyncio.gather(*(ask(i, f"Question {i}: what is {i} + {i}?") for i in range(6)))

        assert asyncio.run(main()) == ["end"] * 6
        kv = session.occupancy.kv
        assert kv["bound"] == bound and kv["peak_problems"] == 2 and kv["peak_bytes"] <= bound
        # an evicted-only pipeline's rows do not grow with the prompt: refuse by a helper's instead
        loop.drain(0)
        assert loop.join(30)
    loaded = load_pipeline(_pipeline(tmp_path / "helper", kv_memory="300KiB", helper=True))
    with Session(loaded, get_registry()) as session:
        loop = Loop(session, Metrics(), queue=8)
        long = "many words " * 200
        job = Job(Request("completion", "m", max_tokens=10, prompt=long), long, 0, None, long)
        try:
            loop.submit(job)
        except ApiError as e:
            assert e.status == 400 and "run.kv_memory" in e.message
        else:
            raise AssertionError("a prompt too long for run.kv_memory was accepted")


def test_worker_pools_are_sized_from_kv_memory(tmp_path):
    """On SGLang the worker's pool is the bound: a model a proposer runs on gets
    `max_total_tokens` = kv_memory / its KV bytes per token, unless its entry sizes the pool
    itself; `auto` leaves SGLang to size it (nothing started here)."""
    from kvflow.config.validate import load_pipeline
    from kvflow.runtime.kv_budget import kv_memory_engines

    path = tiny_pipeline(tmp_path, problems=1, n=2, evictor=EVICTED, extra={
        "models": {"base": {"backend": "sglang"}, "helper": {"backend": "sglang", "engine": {"max_total_tokens": 99}}},
        "run": {"kv_memory": "1MiB"}})
    models = kv_memory_engines(load_pipeline(path)).pipeline.models
    assert models["base"].engine["max_total_tokens"] == 2**20 // 512  # 512 bytes per token (float32 tiny Qwen2)
    assert models["helper"].engine == {"max_total_tokens": 99}  # its own pool
    auto = kv_memory_engines(load_pipeline(path, sets=["run.kv_memory=auto"])).pipeline.models
    assert "max_total_tokens" not in auto["base"].engine
