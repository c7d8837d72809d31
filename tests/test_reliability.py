"""Interrupted runs (DESIGN.md §8): SIGKILL at random moments resumes to exactly the dataset's
problems (no duplicates, no torn line); SIGINT stops with a message and exit 130; a torn tail
is repaired; a corrupt middle line is reported (exit 2), never merged.

The kill-loop test drives the real `kvflow run` (results directory, resume logic, appends)
with the model decode replaced by a fast fake, so it can be killed dozens of times; the
`e2e` tests do the same with the real SmolLM2-135M catalog model.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvflow.errors import UserError
from kvflow.results.files import ResultsDir

REPO = Path(__file__).resolve().parents[1]
QUICK = REPO / "pipelines" / "quickstart.yaml"
TEST_CACHE = Path.home() / ".cache" / "kvflow-test"


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **extra)
    if not os.environ.get("KVFLOW_CACHE") and TEST_CACHE.is_dir():
        env["KVFLOW_CACHE"] = str(TEST_CACHE)  # the warm test cache of tests/test_models.py
    return env


def _lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), "torn last line"
    return [json.loads(line) for line in data.decode("utf-8").splitlines()]


def _record(i: int, **kw) -> dict:
    rec = {"id": f"p{i}", "question": "q", "gold": "1", "prediction": "1", "correct": True, "output": "x",
           "steps": [], "step_counts": {"base": 0}, "output_tokens": 0, "tokens_generated": {"base": 0},
           "candidates": {}, "pruned": {}, "finish": "eos", "degenerate": False, "seconds": 0.0}
    rec.update(kw)
    return rec


# -- the results file ------------------------------------------------------------------------

def test_torn_tail_is_cut_off_and_appends_continue(tmp_path, capsys):
    store = ResultsDir(tmp_path / "run")
    store.path.mkdir()
    for i in range(3):
        store.append(_record(i))
    good = store.samples.read_bytes()
    with open(store.samples, "ab") as f:
        f.write(json.dumps(_record(3)).encode()[:25])  # killed mid-write
    assert [r["id"] for r in store.load()] == ["p0", "p1", "p2"]
    assert "incomplete last line" in capsys.readouterr().err
    assert store.samples.read_bytes() == good  # repaired on disk
    store.append(_record(3))
    assert [r["id"] for r in _lines(store.samples)] == ["p0", "p1", "p2", "p3"]


def test_complete_last_record_without_newline_is_kept(tmp_path):
    store = ResultsDir(tmp_path / "run")
    store.path.mkdir()
    store.samples.write_text(json.dumps(_record(0)) + "\n" + json.dumps(_record(1)))
    assert [r["id"] for r in store.load()] == ["p0", "p1"]
    store.append(_record(2))
    assert [r["id"] for r in _lines(store.samples)] == ["p0", "p1", "p2"]


def test_corrupt_middle_line_and_duplicates_are_errors(tmp_path):
    store = ResultsDir(tmp_path / "run")
    store.path.mkdir()
    lines = [json.dumps(_record(i)) for i in range(3)]
    store.samples.write_text("\n".join([lines[0], lines[1][:30], lines[2]]) + "\n")
    before = store.samples.read_bytes()
    with pytest.raises(UserError, match=r"samples.jsonl:2: samples: corrupt record"):
        store.load()
    assert store.samples.read_bytes() == before  # nothing merged or cut
    store.samples.write_text("\n".join([lines[0], lines[1], lines[1]]) + "\n")
    with pytest.raises(UserError, match="duplicate records"):
        store.load()


def test_cli_reports_a_corrupt_middle_line_with_exit_2(tmp_path, cli):
    from kvflow.config.validate import load_pipeline
    from kvflow.runtime.runner import results_path

    sets = ["models.base.id=catalog:smollm2-135m-instruct", "models.helper.id=catalog:smollm2-135m-instruct",
            "dataset.limit=3", f"run.output={tmp_path}"]
    run_dir = results_path(load_pipeline(QUICK, sets=sets))
    run_dir.mkdir(parents=True)
    good = [json.dumps(_record(i, id=f"gsm8k/{i}")) for i in range(2)]
    (run_dir / "samples.jsonl").write_text(good[0] + "\n{not json\n" + good[1] + "\n")
    before = (run_dir / "samples.jsonl").read_bytes()
    args = ["run", QUICK] + [a for s in sets for a in ("--set", s)]
    res = cli(*args, env={"HF_HUB_OFFLINE": "1"})
    assert res.exit_code == 2, res.output
    assert "samples.jsonl:2: samples: corrupt record" in res.stderr and "--force" in res.stderr
    assert "Traceback" not in res.output
    assert (run_dir / "samples.jsonl").read_bytes() == before


# -- killed runs with a fake decode -----------------------------------------------------------

FAKE = textwrap.dedent('''
    """`kvflow run` with the model decode replaced by a fast fake (records of random size)."""
    import random, sys, time
    from kvflow.runtime import compile as compile_, core, local

    def fake_decode(loaded, registry, store, todo, quiet):
        store.prepare(loaded.resolved, core.manifest(loaded, registry))  # as local.decode does once models load
        rng = random.Random()
        for p in todo:
            time.sleep(rng.uniform(0.05, 0.25))  # 40 problems outlast the longest kill timeout
            with core.sigint_deferred():
                store.append({"id": p.id, "question": p.question, "gold": p.gold, "prediction": "0",
                              "correct": False, "output": "x" * rng.randint(10, 200_000), "steps": [],
                              "step_counts": {"base": 0, "helper": 0}, "output_tokens": 0,
                              "tokens_generated": {"base": 0, "helper": 0}, "candidates": {}, "pruned": {},
                              "finish": "eos", "degenerate": False, "seconds": 0.0})

    local.decode = fake_decode
    compile_.check_models = lambda loaded, registry=None: None
    from kvflow.cli import main
    sys.argv = ["kvflow"] + sys.argv[1:]
    main()
''')


def test_sigkill_at_random_moments_resumes_exactly(tmp_path):
    fake = tmp_path / "fake_kvflow.py"
    fake.write_text(FAKE)
    n = 40
    out = tmp_path / "results"
    cmd = [sys.executable, str(fake), "run", str(QUICK), "--set", f"dataset.limit={n}", "--set", f"run.output={out}"]
    rng = random.Random(1234)
    kills = 0
    progress: list[int] = []  # records on disk after each kill
    start = time.monotonic()
    while True:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
        try:
            proc.wait(timeout=rng.uniform(0.5, 2.5) if kills < 15 else 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            kills += 1
            run_dirs = list(out.glob("quickstart__*"))
            if run_dirs and (run_dirs[0] / "samples.jsonl").exists():
                progress.append(len(ResultsDir(run_dirs[0]).load()))  # every state loads (torn tail at most)
            continue
        finally:
            proc.stderr.close()
        assert proc.returncode == 0
        break
    assert time.monotonic() - start < 120
    (run_dir,) = out.glob("quickstart__*")
    records = _lines(run_dir / "samples.jsonl")
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) == n
    assert set(ids) == {f"gsm8k/{i}" for i in range(n)}  # exactly the dataset's first n problems
    assert json.loads((run_dir / "metrics.json").read_text())["n_problems"] == n
    assert kills >= 3 and any(0 < k < n for k in progress), progress  # killed mid-run, not only at startup
    print("records after each kill:", progress)
    # complete now: a rerun is skipped
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 0 and "already complete" in proc.stderr


def test_sigint_stops_cleanly_with_exit_130_and_resumes(tmp_path):
    fake = tmp_path / "fake_kvflow.py"
    fake.write_text(FAKE)
    out = tmp_path / "results"
    cmd = [sys.executable, str(fake), "run", str(QUICK), "--set", "dataset.limit=60", "--set", f"run.output={out}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)
    run_dir = _wait_for_records(out, 3, proc, timeout=60)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal signals the whole process group
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "kvflow: interrupted; finished problems are saved, run the same command again to resume" in stderr
    assert "Traceback" not in stderr
    done = _lines(run_dir / "samples.jsonl")  # no torn line
    assert 3 <= len(done) < 60 and not (run_dir / "metrics.json").exists()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 0 and f"{len(done)} done, {60 - len(done)} to go" in proc.stderr
    ids = [r["id"] for r in _lines(run_dir / "samples.jsonl")]
    assert sorted(ids, key=lambda i: int(i.split("/")[1])) == [f"gsm8k/{i}" for i in range(60)]


def test_sigint_is_held_while_a_record_is_written():
    from kvflow.runtime.core import sigint_deferred

    reached = False
    with pytest.raises(KeyboardInterrupt):
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            reached = True  # still inside: the signal was held
    assert reached
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    with sigint_deferred():  # no signal: nothing happens
        pass


# -- the real model ---------------------------------------------------------------------------

SMALL = [
    "--set", "models.base.id=catalog:smollm2-135m-instruct",
    "--set", "models.helper.id=catalog:smollm2-135m-instruct",
    "--set", "proposers.base.n=1", "--set", "proposers.helper.n=1",
    "--set", "proposers.base.sampling.max_step_tokens=16",
    "--set", "proposers.helper.sampling.max_step_tokens=16",
    "--set", "limits.max_tokens=32", "--set", "run.batch_problems=1",
]


def _start(out: Path, limit: int) -> subprocess.Popen:
    # one problem at a time, so that a signal after the k-th record lands while the next decodes
    cmd = [sys.executable, "-m", "kvflow.cli", "run", str(QUICK), *SMALL, "--set", f"dataset.limit={limit}",
           "--set", f"run.output={out}", "--set", "run.batch_problems=1", "--set", "run.live_problems=1"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)


def _wait_for_records(out: Path, count: int, proc: subprocess.Popen, timeout: float = 400) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in out.glob("quickstart__*"):
            s = d / "samples.jsonl"
            if s.exists() and s.read_bytes().count(b"\n") >= count:
                return d
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("no record appeared in time")


@pytest.mark.e2e
def test_real_run_killed_and_interrupted_resumes(tmp_path):
    """One real run: SIGKILL at a random moment after its first problem, then resume and stop
    with SIGINT (Ctrl-C to the process group) after another, then resume to the end."""
    out = tmp_path / "results"
    limit = 3
    proc = _start(out, limit)
    run_dir = _wait_for_records(out, 1, proc)
    time.sleep(random.uniform(0.0, 1.0))  # a random moment while the next problem decodes
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    done = {r["id"] for r in ResultsDir(run_dir).load()}
    assert 1 <= len(done) < limit

    proc = _start(out, limit)
    _wait_for_records(out, len(done) + 1, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    stdout, stderr = proc.communicate(timeout=120)
    if proc.returncode == 0:  # the last problem finished before the signal landed
        assert "accuracy" in stdout
    else:
        assert proc.returncode == 130, stderr
        assert "interrupted" in stderr and "run the same command again to resume" in stderr
        assert "Traceback" not in stderr
        assert f"resuming {run_dir}: {len(done)} done" in stderr

    proc = _start(out, limit)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    records = _lines(run_dir / "samples.jsonl")
    ids = [r["id"] for r in records]
    assert sorted(ids) == [f"gsm8k/{i}" for i in range(limit)] and len(set(ids)) == limit
    assert json.loads((run_dir / "metrics.json").read_text())["n_problems"] == limit
