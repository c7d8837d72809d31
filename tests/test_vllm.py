"""The `vllm` backend on a CPU: parity with `hf` (greedy steps, likelihood scores, the steps a
KV-Rescue run commits), pruners that abort candidates in the engine, the prefix cache, and a
worker that leaves nothing running when closed.

The engine-protocol contract itself runs over every backend in tests/test_engine_contract.py.
Every test here shares one vLLM worker (the one `kvflow.testing.engine_parity.load_engine("vllm")`
starts on the head_dim-32 tiny Qwen2 vLLM's CPU attention serves), with vLLM's CPU defaults:
a 1 GiB KV cache, eager, one torch thread.
"""

from __future__ import annotations

import os

import pytest

from conftest import REPO, committed_steps, pin_for_session, require_vllm, run_shrunk_quickstart
from kvflow.components.base import Trajectory
from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest, SyncRequest
from kvflow.testing import tiny_pipeline
from kvflow.testing.engine_contract import StopAt, full_cache, run_to_end
from kvflow.testing.engine_parity import QUESTION, backend_model_dir, chat_prompt, load_engine


@pytest.fixture(scope="module")
def vllm_engine():
    require_vllm()
    engine = pin_for_session(load_engine("vllm"))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_on_vllm_model():
    """The `hf` engine on the model the vLLM tests run (float32, CPU), to compare with."""
    return load_engine("hf", backend_model_dir("vllm"))


def test_steps_with_a_delimiter_equal_hf_token_for_token(vllm_engine, hf_on_vllm_model):
    # greedy, the real delimiter of a step (a space here: the tiny model rarely writes "\n\n"),
    # adopting candidate 0 after each step
    spec = SamplingSpec(2, 0.0, 1.0, 16, " ")
    got = {}
    for engine in (hf_on_vllm_model, vllm_engine):
        (state,) = engine.start([StartRequest(chat_prompt(engine), full_cache(), 1)])
        steps = []
        for k in range(3):
            (p,) = run_to_end(engine, [ProposeRequest(state, "helper", spec, 0, 100)])
            steps.append([(c.token_ids, c.finish, c.text) for c in p.candidates])
            (state,) = engine.sync([SyncRequest(state, p, 0 if k < 2 else None, p.candidates[0].text)])
        got[engine.backend] = steps
    assert got["vllm"] == got["hf"]
    assert any(f == "delimiter" for step in got["hf"] for _, f, _ in step)


def test_likelihood_scores_equal_hf(vllm_engine, hf_on_vllm_model):
    traj = Trajectory(problem_id="p", question=QUESTION, prompt=chat_prompt(hf_on_vllm_model))
    texts = [" She sold 48 / 2 = 24 clips in May.", " 72"]
    scores = {e.backend: e.scoring_session().token_logprobs([traj, traj], texts)
              for e in (hf_on_vllm_model, vllm_engine)}
    for a, b in zip(scores["hf"], scores["vllm"]):
        assert len(a) == len(b) and b == pytest.approx(a, abs=1e-4)


def test_a_pruned_candidate_is_aborted_in_the_engine(vllm_engine):
    """A candidate kvflow prunes at its 4th token stops in vLLM too: of the 400 tokens it may
    make, vLLM makes only the few it had decoded before the abort arrived (counted, not used).
    (A row that vLLM ended itself, on EOS, before kvflow read its 4th token needs no abort.)"""
    spec = SamplingSpec(2, 1.0, 1.0, 400, "\x00\x01", pruners=(("stop4", StopAt(4)),))
    (state,) = vllm_engine.start([StartRequest(chat_prompt(vllm_engine), full_cache(), 1)])
    before = dict(vllm_engine.counters)
    (p,) = run_to_end(vllm_engine, [ProposeRequest(state, "base", spec, 5, 1000)])
    vllm_engine.drain()
    assert [c.finish for c in p.candidates] == ["pruned:stop4"] * 2
    assert [c.n_tokens for c in p.candidates] == [4, 4]
    after = vllm_engine.counters
    assert 1 <= after["aborted"] - before["aborted"] <= 2, (before, after)
    made_after_stop = after["tokens_after_stop"] - before["tokens_after_stop"]
    # 1 to 33 seen here on a loaded machine (the worker steps on while kvflow reads); ~400 without the abort
    assert 0 <= made_after_stop < 200, f"vLLM made {made_after_stop} tokens after the stop: the abort did not reach it"


def test_the_prefix_is_served_from_the_prefix_cache(vllm_engine):
    """A problem's trajectory is a prefix every request of it shares: its second proposal reads
    the prompt's whole KV blocks (128 tokens each on a CPU) from vLLM's prefix cache."""
    question = " ".join([QUESTION] * 12)  # a prompt longer than two blocks
    prompt = vllm_engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                       add_generation_prompt=True)
    (state,) = vllm_engine.start([StartRequest(prompt, full_cache(), 1)])
    assert len(state.ids) > 256
    spec = SamplingSpec(2, 1.0, 1.0, 4, "\x00\x01")
    run_to_end(vllm_engine, [ProposeRequest(state, "base", spec, 1, 100)])
    vllm_engine.drain()
    before = dict(vllm_engine.counters)
    run_to_end(vllm_engine, [ProposeRequest(state, "base", spec, 2, 100)])
    vllm_engine.drain()
    cached = vllm_engine.counters["cached_tokens"] - before["cached_tokens"]
    prompt_tokens = vllm_engine.counters["prompt_tokens"] - before["prompt_tokens"]
    assert prompt_tokens == 2 * len(state.ids)
    assert cached >= 2 * 256, f"{cached} of {prompt_tokens} prompt tokens came from the prefix cache"
    assert vllm_engine.stats()["prefix_cache_hit_rate"] > 0


def test_kv_rescue_with_the_helper_on_vllm_commits_what_hf_commits(tmp_path, cli, vllm_engine):
    """The same greedy KV-Rescue run (base evicted, helper and likelihood scorer on the helper's
    model; both models the one vLLM serves) with the helper on hf and on vllm, and with the
    evicted base on vllm too, commits the same steps, from both sources."""
    from kvflow.backends.served.worker import _SHARED

    model = str(backend_model_dir("vllm"))
    runs = {}
    for backend, base in (("hf", "hf"), ("vllm", "hf"), ("vllm", "vllm")):
        extra = {"models": {"helper": {"backend": backend, "id": model}, "base": {"backend": base, "id": model}},
                 "proposers": {"base": {"sampling": {"temperature": 0}}, "helper": {"sampling": {"temperature": 0}}},
                 "scorer": {"kind": "likelihood", "model": "helper"}}
        name = f"rescue_{backend}_{base}"
        path = tiny_pipeline(tmp_path, name=name, problems=2, n=2, max_tokens=48, extra=extra)
        workers = set(_SHARED)
        result = cli("run", path)
        assert result.exit_code == 0, result.output
        assert set(_SHARED) == workers, "the run started a vLLM worker of its own instead of sharing the running one"
        (run_dir,) = [d for d in (tmp_path / "results").iterdir() if d.name.startswith(name)]
        runs[backend, base] = committed_steps(run_dir)
    assert runs["vllm", "hf"] == runs["hf", "hf"]
    assert runs["vllm", "vllm"] == runs["hf", "hf"]
    assert any(src == "helper" for steps in runs["hf", "hf"].values() for _, src, _ in steps)
    assert any(src == "base" for steps in runs["hf", "hf"].values() for _, src, _ in steps)


def test_a_killed_worker_stops_the_engine_clearly_and_leaves_no_process(vllm_engine):
    """A worker that dies mid-proposal (killed here) turns into an EngineError naming the model
    entry, the exit and the end of its log, and nothing of its process group is left."""
    import signal

    from kvflow.errors import EngineError

    (state,) = vllm_engine.start([StartRequest(chat_prompt(vllm_engine), full_cache(), 1)])
    vllm_engine.submit([ProposeRequest(state, "base", SamplingSpec(2, 1.0, 1.0, 400, "\x00\x01"), 3, 1000)])
    vllm_engine.step()
    pid = vllm_engine.worker.proc.pid
    os.killpg(pid, signal.SIGKILL)
    with pytest.raises(EngineError) as err:
        for _ in range(10_000):
            vllm_engine.step()
    message = str(err.value)
    assert "backend vllm" in message and "the vLLM worker exited" in message and "rerun to resume" in message
    assert "end of the worker's log" in message
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)


def test_a_closed_worker_leaves_no_process():
    """Closing a worker stops it and everything in its process group (the last test here, on a
    worker of its own: the one before killed the shared one)."""
    require_vllm()
    engine = pin_for_session(load_engine("vllm"))
    worker = engine.worker
    pid = worker.proc.pid
    assert worker.proc.poll() is None
    worker.close()
    assert worker.proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # no process of its group is left


@pytest.mark.e2e
def test_the_vllm_quickstart_runs_end_to_end_on_a_catalog_checkpoint(tmp_path, cli):
    """pipelines/vllm/quickstart.yaml (evicted base, helper and scorer on vLLM), shrunk, on SmolLM2-135M."""
    require_vllm()
    manifest = run_shrunk_quickstart(tmp_path, cli, REPO / "pipelines" / "vllm" / "quickstart.yaml")
    # vLLM lives in its own environment: its version is the worker's, recorded with each engine's settings
    assert {manifest["engine_settings"][m]["vllm"] for m in ("base", "helper")} == {"0.32.0"}
