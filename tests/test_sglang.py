"""The `sglang` backend on a CPU: parity with `hf` (greedy tokens, likelihood scores, the
steps a KV-Rescue run commits), pruners that abort candidates in the engine, the prefix
cache, engine settings checked against SGLang's server arguments, a crashed worker.

The engine-protocol contract itself runs over every backend in tests/test_engine_contract.py.
Tests on `shared_tiny_qwen` share one SGLang engine (one worker process) for the session.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, committed_steps, require_sglang, run_shrunk_quickstart, wait_for_first_record
from kvflow.components.base import Trajectory
from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest, SyncRequest
from kvflow.testing import tiny_pipeline
from kvflow.testing.engine_contract import StopAt, full_cache, run_to_end

from kvflow.testing.engine_parity import QUESTION
from kvflow.testing.engine_parity import chat_prompt as _prompt


def test_steps_with_a_delimiter_equal_hf_token_for_token(sglang_engine, hf_engine):
    # greedy, the real delimiter of a step (a space here: the tiny model rarely writes "\n\n")
    spec = SamplingSpec(2, 0.0, 1.0, 16, " ")
    got = {}
    for engine in (hf_engine, sglang_engine):
        (state,) = engine.start([StartRequest(_prompt(engine), full_cache(), 1)])
        steps = []
        for _ in range(3):
            (p,) = run_to_end(engine, [ProposeRequest(state, "helper", spec, 0, 100)])
            steps.append([(c.token_ids, c.finish, c.text) for c in p.candidates])
            (state,) = engine.sync([SyncRequest(state, p, 0, p.candidates[0].text)])
        got[engine.backend] = steps
    assert got["sglang"] == got["hf"]
    assert any(f == "delimiter" for step in got["hf"] for _, f, _ in step)


def test_likelihood_scores_equal_hf(sglang_engine, hf_engine):
    traj = Trajectory(problem_id="p", question=QUESTION, prompt=_prompt(hf_engine))
    texts = [" She sold 48 / 2 = 24 clips in May.", " 72"]
    scores = {e.backend: e.scoring_session().token_logprobs([traj, traj], texts) for e in (hf_engine, sglang_engine)}
    for a, b in zip(scores["hf"], scores["sglang"]):
        assert len(a) == len(b) and b == pytest.approx(a, abs=1e-4)


def test_a_cpu_pool_is_max_total_tokens(sglang_engine):
    """kvflow's CPU default pool, to the slot (plugin._cpu_pool_budget; with a fraction SGLang's
    own profile refuses: test_sglang_evicted.py's full-pool test)."""
    from kvflow.backends.sglang.settings import CPU

    assert sglang_engine.server_state()["kv_slots_total"] == CPU["max_total_tokens"]


def test_a_pruned_candidate_is_aborted_in_the_engine(sglang_engine):
    spec = SamplingSpec(2, 1.0, 1.0, 400, "\x00\x01", pruners=(("stop4", StopAt(4)),))
    (state,) = sglang_engine.start([StartRequest(_prompt(sglang_engine), full_cache(), 1)])
    run_to_end(sglang_engine, [ProposeRequest(state, "base", SamplingSpec(2, 1.0, 1.0, 4, "\x00\x01"), 4, 1000)])
    before = dict(sglang_engine.counters)  # (after a first sampled step: SGLang's own warm-up)
    (p,) = run_to_end(sglang_engine, [ProposeRequest(state, "base", spec, 5, 1000)])
    assert [c.finish for c in p.candidates] == ["pruned:stop4"] * 2
    assert [c.n_tokens for c in p.candidates] == [4, 4]
    assert sglang_engine.counters["aborted"] - before["aborted"] == 2
    deadline = time.monotonic() + 30  # the engine reports how far each got before the abort landed
    while sglang_engine._used and time.monotonic() < deadline:
        sglang_engine.step()
    after_stop = sglang_engine.counters["tokens_after_stop"] - before["tokens_after_stop"]
    assert after_stop < 2 * 100, "the aborted candidates ran on towards max_step_tokens"


def test_a_proposal_that_ends_while_scoring_is_still_handed_back(sglang_engine):
    # scoring polls the same worker, so a proposal's rows can end outside step(); the engine
    # must stay busy until step() hands the proposal back, or the scheduler never asks again
    # (200 tokens: the rows must outlast step()'s first poll, 20 ms, on a fast tiny model)
    spec = SamplingSpec(2, 0.0, 1.0, 200, "\x00\x01")
    (state,) = sglang_engine.start([StartRequest(_prompt(sglang_engine), full_cache(), 1)])
    request = ProposeRequest(state, "helper", spec, 0, 1000)
    sglang_engine.submit([request])
    assert sglang_engine.step() == []  # admitted: its requests are in the engine
    traj = Trajectory(problem_id="scored", question=QUESTION, prompt=_prompt(sglang_engine))
    session = sglang_engine.scoring_session()
    deadline = time.monotonic() + 60
    while any(row.finish is None for r in sglang_engine.running for row in r.rows):
        assert time.monotonic() < deadline
        session.token_logprobs([traj], [" 72"])
    assert sglang_engine.busy_rows() > 0
    (p,) = sglang_engine.step()  # the next step hands it back
    assert p.request is request and all(c.n_tokens == 200 or c.finish == "eos" for c in p.candidates)
    assert sglang_engine.busy_rows() == 0


def test_the_prefix_is_served_from_the_radix_cache(sglang_engine):
    spec = SamplingSpec(2, 0.0, 1.0, 8, "\x00\x01")
    (state,) = sglang_engine.start([StartRequest(_prompt(sglang_engine), full_cache(), 1)])
    (p,) = run_to_end(sglang_engine, [ProposeRequest(state, "base", spec, 0, 100)])
    (state,) = sglang_engine.sync([SyncRequest(state, p, 0, p.candidates[0].text)])
    sglang_engine.drain()  # ends of earlier tests' stopped candidates must not count here
    before = dict(sglang_engine.counters)
    (q,) = run_to_end(sglang_engine, [ProposeRequest(state, "base", spec, 0, 100)])
    sglang_engine.drain()
    prompt = sglang_engine.counters["prompt_tokens"] - before["prompt_tokens"]
    cached = sglang_engine.counters["cached_tokens"] - before["cached_tokens"]
    assert prompt == 2 * len(state.ids)
    # the second step's input is the first step's: only the newest committed token is new
    assert cached >= prompt - 2 * (1 + 1)


# -- through `kvflow run` -----------------------------------------------------------------------


def _greedy_rescue(tmp_path, helper_backend: str, helper_dir, **kw):
    extra = {"models": {"helper": {"backend": helper_backend, "id": str(helper_dir)}},
             "proposers": {"base": {"sampling": {"temperature": 0}}, "helper": {"sampling": {"temperature": 0}}},
             "scorer": {"kind": "likelihood", "model": "helper"}}
    return tiny_pipeline(tmp_path, name=f"rescue_{helper_backend}", problems=2, n=2, max_tokens=48,
                         extra=extra, **kw)


def test_kv_rescue_with_the_helper_on_sglang_commits_what_hf_commits(tmp_path, cli, shared_tiny_qwen):
    require_sglang()
    from kvflow.backends.served.worker import _SHARED

    runs = {}
    for backend in ("hf", "sglang"):  # the helper on the session's model: its SGLang engine is running
        path = _greedy_rescue(tmp_path, backend, shared_tiny_qwen)
        held = {key: w.holders for key, w in _SHARED.items()}
        result = cli("run", path)
        assert result.exit_code == 0, result.output
        # the finished run's Session closed its engines: it holds no worker any more
        assert {key: w.holders for key, w in _SHARED.items()} == {key: held.get(key, 0) for key in _SHARED}
        (run_dir,) = [d for d in (tmp_path / "results").iterdir() if d.name.startswith(f"rescue_{backend}")]
        runs[backend] = committed_steps(run_dir)
        occupancy = json.loads((run_dir / "manifest.json").read_text())["occupancy"]
        # run.overlap_engines auto: SGLang's stream is read while hf computes (two hf models on this CPU: not)
        assert ("overlapped_steps" in occupancy["helper"]) == (backend == "sglang"), occupancy
    assert runs["sglang"] == runs["hf"]
    assert any(src == "helper" for steps in runs["hf"].values() for _, src, _ in steps)


def test_engine_settings_are_checked_against_sglang_server_arguments(tmp_path, cli):
    require_sglang()
    cases = [
        ({"models": {"helper": {"backend": "sglang", "engine": {"tp_sise": 2}}}},
         "models.helper.engine.tp_sise", "did you mean 'tp_size'"),
        ({"models": {"helper": {"backend": "sglang", "engine": {"dtype": "float16"}}}},
         "models.helper.engine.dtype", "set by kvflow"),
        ({"models": {"helper": {"engine": {"tp_size": 2}}}}, "models.helper.engine", "takes no engine settings"),
    ]
    for i, (extra, where, words) in enumerate(cases):
        path = tiny_pipeline(tmp_path / str(i), problems=1, extra=extra)
        result = cli("run", path)
        assert result.exit_code == 2, (where, result.output)
        assert where in result.output and words in result.output, result.output
        assert not (tmp_path / str(i) / "results").exists()  # nothing written


def test_prm_scores_on_the_helpers_sglang_engine(tmp_path, cli, shared_tiny_qwen):
    """`prm` (math-shepherd) runs on backend sglang, sharing the helper's engine (issue 26;
    was refused at models.helper.backend): every committed step gets a score."""
    require_sglang()
    path = tiny_pipeline(tmp_path, problems=1, scorer={"kind": "prm", "model": "helper", "protocol": "math-shepherd"},
                         extra={"models": {"helper": {"backend": "sglang", "id": str(shared_tiny_qwen)}}})
    result = cli("run", path)
    assert result.exit_code == 0, result.output
    steps = [s for r in committed_steps(next((tmp_path / "results").glob("*"))).values() for s in r]
    assert steps and all(score is not None for _, _, score in steps), steps


def test_a_crashed_worker_stops_the_run_clearly_and_the_rerun_resumes(tmp_path, cli, shared_tiny_qwen):
    require_sglang()
    # sampled (seeded) candidates; the evicted base and the helper on one SGLang engine (their
    # states, snapshots in the scheduler included, die with it); in-process runs use the
    # session's running engine, the run that is killed starts its own
    helper = {"backend": "sglang", "id": str(shared_tiny_qwen)}
    models = {"base": helper, "helper": helper}
    reference = tiny_pipeline(tmp_path / "reference", name="crash", problems=3, n=2, max_tokens=32,
                              extra={"models": models, "run": {"batch_problems": 1}})
    assert cli("run", reference).exit_code == 0
    (ref_dir,) = (tmp_path / "reference" / "results").iterdir()
    expected = committed_steps(ref_dir)

    path = tiny_pipeline(tmp_path / "crashed", name="crash", problems=3, n=2, max_tokens=32,
                         extra={"models": models, "run": {"batch_problems": 1}})
    proc = subprocess.Popen([sys.executable, "-m", "kvflow.cli", "run", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                            start_new_session=True)
    out = tmp_path / "crashed" / "results"
    wait_for_first_record(out, proc)
    workers = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "kvflow.backends.sglang.in_worker.worker"],
                             capture_output=True, text=True).stdout.split()
    assert workers, "no SGLang worker under the run"
    os.kill(int(workers[0]), signal.SIGKILL)  # what SGLang does to it when one of its processes dies
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr
    assert "SGLang worker exited" in stderr and "rerun to resume" in stderr and "Traceback" not in stderr
    deadline = time.monotonic() + 10  # killed at once; reaping by init may take a moment
    while (left := subprocess.run(["pgrep", "-g", workers[0]], capture_output=True, text=True).stdout.split()):
        assert time.monotonic() < deadline, f"SGLang processes outlived their worker: {left}"
        time.sleep(0.2)
    (run_dir,) = out.iterdir()
    assert 1 <= len(committed_steps(run_dir)) < 3
    assert cli("run", path).exit_code == 0
    lines = (run_dir / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 3 and len({json.loads(x)["id"] for x in lines}) == 3
    assert committed_steps(run_dir) == expected


@pytest.mark.e2e
def test_the_sglang_quickstart_runs_end_to_end_on_a_catalog_checkpoint(tmp_path, cli):
    """pipelines/sglang/quickstart.yaml (evicted base, helper and scorer on SGLang), shrunk, on SmolLM2-135M."""
    require_sglang()
    manifest = run_shrunk_quickstart(tmp_path, cli, REPO / "pipelines" / "sglang" / "quickstart.yaml")
    assert manifest["versions"]["sglang"] == "0.5.23"
