"""`run.executor: ray` (kvflow.runtime.ray_executor, docs/cluster.md) on the session's local Ray
cluster (2 CPUs) with tiny models: a run over 2 Ray workers writes the records of the same run
in one process; a worker killed mid-run has its problems re-queued (every problem once); a
driver killed mid-run resumes (a torn last line cut off); a 4-point sweep over 2 workers writes
every point's local directory; bad input (no Ray, an unreachable RAY_ADDRESS) is exit 2 with
nothing written.

Records are compared field by field except the wall-clock ones (`seconds`, `timing`) and with
scores to 6 places: the texts, sources, token counts and finishes are equal; a likelihood score
is the same float32 forward in a batch of another size (a worker holds fewer problems than the
one process), which moves its last bits, as a local run at another `run.batch_problems` does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, require_ray, wait_for_first_record
from kvflow.testing import tiny_pipeline

RAY = ["--set", "run.executor=ray", "--set", "run.workers=2"]


def _records(run_dir: Path) -> dict:
    out = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        r = json.loads(line)
        assert r["id"] not in out, f"{r['id']} recorded twice"
        r.pop("seconds")
        r.pop("timing", None)
        out[r["id"]] = r
    return out


def _differences(got: dict, want: dict) -> list[str]:
    """What differs between two runs' records (scores within 1e-5: see the module docstring)."""
    if got.keys() != want.keys():
        return [f"problems {sorted(got)} != {sorted(want)}"]
    out = []
    for pid, a in got.items():
        b = want[pid]
        for key in sorted(set(a) | set(b)):
            if key == "steps":
                if len(a[key]) != len(b[key]):
                    out.append(f"{pid}: {len(a[key])} steps != {len(b[key])}")
                for i, (x, y) in enumerate(zip(a[key], b[key])):
                    plain = lambda s: {k: v for k, v in s.items() if k != "score"}  # noqa: E731
                    close = (x["score"] is None) == (y["score"] is None) and (
                        x["score"] is None or abs(x["score"] - y["score"]) < 1e-5)
                    if plain(x) != plain(y) or not close:
                        out.append(f"{pid}: step {i}: {x} != {y}")
            elif a.get(key) != b.get(key):
                out.append(f"{pid}: {key}: {str(a.get(key))[:200]} != {str(b.get(key))[:200]}")
    return out


def _only_dir(parent: Path) -> Path:
    (run_dir,) = [p for p in parent.iterdir() if p.is_dir()]
    return run_dir


def _same_run(ray_dir: Path, local_dir: Path) -> None:
    assert ray_dir.name == local_dir.name  # the executor is not part of the run's hash
    diff = _differences(_records(ray_dir), _records(local_dir))
    assert not diff, "\n".join(diff)
    metrics = json.loads((ray_dir / "metrics.json").read_text())
    assert metrics["n_problems"] == len(_records(local_dir))
    assert metrics["accuracy"] == json.loads((local_dir / "metrics.json").read_text())["accuracy"]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The tiny pipeline (4 problems, a random-evicted sampled base and a helper) and its run in
    this process: (pipeline path, results directory)."""
    from typer.testing import CliRunner

    from kvflow.cli import app

    root = tmp_path_factory.mktemp("ray")
    path = tiny_pipeline(root, problems=4, extra={"run": {"batch_problems": 2}})
    result = CliRunner().invoke(app, ["run", str(path), "--set", f"run.output={root / 'local'}"])
    assert result.exit_code == 0, result.output
    return path, _only_dir(root / "local")


def test_two_ray_workers_write_the_records_of_one_process(local_run, ray_cluster, tmp_path, cli):
    path, local_dir = local_run
    result = cli("run", path, *RAY, "--set", f"run.output={tmp_path}")
    assert result.exit_code == 0, result.output
    run_dir = _only_dir(tmp_path)
    _same_run(run_dir, local_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["executor"]["kind"] == "ray"
    workers = manifest["workers"]
    assert sorted(w["worker"] for w in workers) == [0, 1] and all(w["device"] == "cpu" for w in workers)
    assert sum(w["problems"] for w in workers) == 4 and all(w["problems"] > 0 for w in workers)
    assert "[4/4]" in result.output and "(worker " in result.output  # live lines, as a local run's
    # resumable either way: the local directory is complete for a Ray run of it, and vice versa
    again = cli("run", path, *RAY, "--set", f"run.output={local_dir.parent}")
    assert again.exit_code == 0 and "already complete" in again.output


def test_a_worker_killed_mid_run_has_its_problems_requeued(local_run, ray_cluster, tmp_path, cli, monkeypatch):
    """Worker 0 SIGKILLs its own process once it has finished its first problem, before that
    record leaves it: that problem and its others are decoded again elsewhere, once each."""
    path, local_dir = local_run
    monkeypatch.setenv("KVFLOW_RAY_FAULT", "sigkill:0:1")
    result = cli("run", path, *RAY, "--set", f"run.output={tmp_path}")
    assert result.exit_code == 0, result.output
    assert "worker 0" in result.output and "re-queued" in result.output, result.output
    run_dir = _only_dir(tmp_path)
    _same_run(run_dir, local_dir)
    workers = json.loads((run_dir / "manifest.json").read_text())["workers"]
    assert 0 not in [w["worker"] for w in workers if w.get("problems")]  # its record never arrived


def test_a_driver_killed_mid_run_resumes(local_run, ray_cluster, tmp_path, cli):
    """`kvflow run` (a driver of its own, joining the session's cluster) killed with SIGKILL after
    its first record; a torn line at the end of samples.jsonl, as a kill mid-write leaves; the
    same command again finishes the run: nothing lost, nothing twice."""
    path, local_dir = local_run
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    env["RAY_ADDRESS"] = ray_cluster
    # one worker, one problem at a time: the kill lands between records
    args = ["--set", "run.executor=ray", "--set", "run.workers=1", "--set", f"run.output={tmp_path}",
            "--set", "run.live_problems=1"]
    code = "import sys\nfrom kvflow.cli import main\nsys.argv = ['kvflow'] + sys.argv[1:]\nmain()\n"
    proc = subprocess.Popen([sys.executable, "-c", code, "run", str(path), *args], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_first_record(tmp_path, proc, timeout=240)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    run_dir = _only_dir(tmp_path)
    before = (run_dir / "samples.jsonl").read_bytes().count(b"\n")
    assert 1 <= before < 4, "the driver was to be killed mid-run"
    with open(run_dir / "samples.jsonl", "ab") as f:
        f.write(b'{"id": "tiny/')  # a record cut short by the kill
    result = cli("run", path, *args, "--ray-address", ray_cluster)
    assert result.exit_code == 0, result.output
    assert "incomplete last line" in result.output and f"{before} done" in result.output, result.output
    _same_run(run_dir, local_dir)


def test_a_sweep_over_two_workers_writes_each_points_local_directory(ray_cluster, tmp_path, cli):
    """4 points (greedy and sampled, two budgets) on one pool of 2 workers."""
    path = tiny_pipeline(tmp_path, problems=3, extra={"run": {"batch_problems": 2}})
    sweep = ["--sweep", "proposers.base.sampling.temperature=0,1", "--sweep", "proposers.base.evictor.budget=12,16"]
    local = cli("run", path, *sweep, "--set", f"run.output={tmp_path / 'local'}")
    assert local.exit_code == 0, local.output
    started = time.monotonic()
    result = cli("run", path, *sweep, *RAY, "--set", f"run.output={tmp_path / 'ray'}")
    assert result.exit_code == 0, result.output
    print(f"sweep of 4 points on 2 Ray workers: {time.monotonic() - started:.1f} s")
    local_dirs = sorted((tmp_path / "local").iterdir())
    ray_dirs = sorted((tmp_path / "ray").iterdir())
    assert len(local_dirs) == len(ray_dirs) == 4
    for a, b in zip(ray_dirs, local_dirs):
        _same_run(a, b)
    assert result.output.count(": done") == 4, result.output
    again = cli("run", path, *sweep, *RAY, "--set", f"run.output={tmp_path / 'ray'}")
    assert again.exit_code == 0 and again.output.count("skipped (complete)") >= 4


def test_without_ray_an_executor_ray_run_is_refused_naming_the_field(tmp_path, cli, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    path = tiny_pipeline(tmp_path, problems=1)
    for extra in ([], ["--sweep", "proposers.base.evictor.budget=12,16"]):
        result = cli("run", path, "--set", "run.executor=ray", *extra)
        assert result.exit_code == 2, result.output
        assert "run.executor" in result.output and "kvflow[ray]" in result.output, result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "results").exists()


def test_an_unreachable_ray_address_is_refused_naming_it(tmp_path, cli, monkeypatch):
    require_ray()
    path = tiny_pipeline(tmp_path, problems=1)
    with socket_that_refuses() as address:
        monkeypatch.setenv("RAY_ADDRESS", address)
        result = cli("run", path, "--set", "run.executor=ray")
        assert result.exit_code == 2 and "RAY_ADDRESS" in result.output and address in result.output, result.output
        monkeypatch.delenv("RAY_ADDRESS")
        result = cli("run", path, "--set", "run.executor=ray", "--ray-address", address)
        assert result.exit_code == 2 and "--ray-address" in result.output, result.output
        result = cli("run", path, "--ray-address", address)  # a local run given a cluster
        assert result.exit_code == 2 and "run.executor" in result.output, result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "results").exists()


def test_the_executor_settings_are_not_part_of_the_run_hash(tmp_path):
    from kvflow.config.validate import load_pipeline

    path = tiny_pipeline(tmp_path, problems=1)
    plain = load_pipeline(path)
    on_ray = load_pipeline(path, sets=["run.executor=ray", "run.workers=3", "run.worker_gpus=2"])
    assert on_ray.pipeline.run.executor == "ray" and on_ray.hash == plain.hash


class socket_that_refuses:
    """host:port of a port nothing listens on (bound, never listening: connections are refused)."""

    def __enter__(self) -> str:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.sock.close()
