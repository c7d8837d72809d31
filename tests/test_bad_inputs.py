"""A catalogue of bad inputs, each tried as a user would, through the CLI: every case is one
clear message naming the file (and line or field), exit code 2, and nothing half-written (a
run that cannot start creates no results directory; no `*.tmp` is left). An unexpected
exception is a short message and a saved traceback, exit 1. Never a raw traceback."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from kvflow.testing import tiny_model_dir, tiny_pipeline


def _run_dir(tmp_path) -> Path:
    (d,) = (tmp_path / "results").iterdir()
    return d


def assert_user_error(result, *needles):
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    for n in needles:
        assert n in result.stderr, (n, result.stderr)


def no_tmp_files(root: Path):
    return not list(root.rglob("*.tmp"))


@pytest.fixture
def finished_run(tmp_path, cli):
    """A finished tiny run: (pipeline path, results directory)."""
    path = tiny_pipeline(tmp_path, problems=2, helper=False, max_tokens=16)
    assert cli("run", path).exit_code == 0
    return path, _run_dir(tmp_path)


# --------------------------------------------------------------------------- results directories

BAD_RESULTS = {
    "config is a YAML list": ("config.resolved.yaml", "- a\n- b\n", "config.resolved.yaml"),
    "metrics is a JSON list": ("metrics.json", "[]", "metrics.json"),
    "metrics is not JSON": ("metrics.json", "{oops", "metrics.json"),
    "a record with only an id": ("samples.jsonl", '{"id": "a"}\n', "samples.jsonl:1"),
    "a record with a wrong-typed field": ("samples.jsonl", None, "field 'correct'"),
    "samples.jsonl is a directory": ("samples.jsonl", "DIR", "samples.jsonl"),
}


def _break(run_dir: Path, case: str) -> None:
    name, content, _ = BAD_RESULTS[case]
    target = run_dir / name
    if content == "DIR":
        target.unlink()
        target.mkdir()
    elif content is None:  # the first record's `correct` becomes a string
        lines = target.read_text().splitlines()
        rec = json.loads(lines[0])
        rec["correct"] = "yes"
        target.write_text("\n".join([json.dumps(rec)] + lines[1:]) + "\n")
    else:
        target.write_text(content)


@pytest.mark.parametrize("case", sorted(BAD_RESULTS))
def test_report_skips_or_refuses_an_unreadable_results_directory(finished_run, tmp_path, cli, case):
    _, run_dir = finished_run
    good = tmp_path / "good"
    import shutil

    shutil.copytree(run_dir, good / run_dir.name)
    _break(run_dir, case)
    needle = BAD_RESULTS[case][2]
    skipped = cli("report", str(run_dir), str(good / run_dir.name))
    assert skipped.exit_code == 0, skipped.output
    assert f"skipping {run_dir}" in skipped.stderr and needle in skipped.stderr
    strict = cli("report", "--strict", str(run_dir), str(good / run_dir.name))
    assert_user_error(strict, needle)
    alone = cli("report", str(run_dir))  # nothing readable left: an error, not an empty report
    assert_user_error(alone, "no readable results directory")


@pytest.mark.parametrize("case", sorted(BAD_RESULTS))
def test_resumed_run_on_a_broken_results_directory_is_refused(finished_run, tmp_path, cli, case):
    path, run_dir = finished_run
    (run_dir / "metrics.json").unlink(missing_ok=True) if not case.startswith("metrics") else None
    _break(run_dir, case)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    result = cli("run", path)
    if case == "config is a YAML list":
        assert_user_error(result, "run.output", "different pipeline")
    else:
        assert_user_error(result, BAD_RESULTS[case][2])
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before  # untouched
    assert no_tmp_files(tmp_path)


def test_a_results_directory_of_another_pipeline_is_refused(finished_run, tmp_path, cli):
    path, run_dir = finished_run
    cfg = run_dir / "config.resolved.yaml"
    cfg.write_text(cfg.read_text().replace("max_tokens: 16", "max_tokens: 17"))
    (run_dir / "metrics.json").unlink()
    assert_user_error(cli("run", path), "different pipeline", "--force")
    assert cli("run", path, "--force").exit_code == 0  # --force replaces it


def test_records_of_problems_outside_the_dataset_are_refused(finished_run, cli):
    path, run_dir = finished_run
    samples = run_dir / "samples.jsonl"
    rec = json.loads(samples.read_text().splitlines()[0])
    samples.write_text(json.dumps({**rec, "id": "tiny/99"}) + "\n")
    (run_dir / "metrics.json").unlink()
    assert_user_error(cli("run", path), "samples.jsonl", "tiny/99")


# --------------------------------------------------------------------------- output paths


def test_run_output_under_an_existing_file(tmp_path, cli):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    path = tiny_pipeline(tmp_path, problems=1, helper=False, extra={"run": {"output": str(blocker / "results")}})
    assert_user_error(cli("run", path), "run.output", "is a file")
    assert blocker.read_text() == "x"


def test_report_out_somewhere_unwritable(finished_run, tmp_path, cli):
    _, run_dir = finished_run
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    assert_user_error(cli("report", str(run_dir), "--out", str(blocker / "report")), "--out", "is a file, not a directory")


def test_cost_png_onto_an_existing_directory(tmp_path, cli):
    (tmp_path / "plot.png").mkdir()
    assert_user_error(cli("cost", "qwen2.5-math-7b", "--png", str(tmp_path / "plot.png")), "--png", "is a directory")
    assert_user_error(cli("cost", "qwen2.5-math-7b", "--png", str(tmp_path / "nodir" / "p.png")), "no such directory")


# --------------------------------------------------------------------------- model files


def _with_base_model(tmp_path, model_id: str) -> Path:
    return tiny_pipeline(tmp_path, problems=1, helper=False, extra={"models": {"base": {"id": model_id}}})


def test_model_directory_with_invalid_config_json(tmp_path, cli):
    d = tiny_model_dir(tmp_path / "m", "qwen2", seed=4)
    (d / "config.json").write_text('{"model_type": "qwen2", ')
    assert_user_error(cli("run", _with_base_model(tmp_path, str(d))), "models.base.id", "config.json", "not valid JSON")
    assert not (tmp_path / "results").exists()


def test_model_directory_without_weights(tmp_path, cli):
    d = tiny_model_dir(tmp_path / "m", "qwen2", seed=4)
    (d / "model.safetensors").unlink()
    assert_user_error(cli("run", _with_base_model(tmp_path, str(d))), "models.base.id", "no weights")
    assert not (tmp_path / "results").exists()


def test_model_that_fails_to_load_leaves_no_results_directory(tmp_path, cli):
    """A config.json that parses but that transformers cannot build (the loader's own error):
    located at the model entry, and still no results directory."""
    d = tiny_model_dir(tmp_path / "m", "qwen2", seed=4)
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_size"] = 63  # not divisible by the heads
    (d / "config.json").write_text(json.dumps(cfg))
    assert_user_error(cli("run", _with_base_model(tmp_path, str(d))), "models.base.id", "could not be loaded")
    assert not (tmp_path / "results").exists()


def test_truncated_gguf(tmp_path, cli):
    import gguf
    import numpy as np

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((64, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path.write_bytes(path.read_bytes()[:9000])  # cut mid-tensor, as an interrupted download
    assert_user_error(cli("run", _with_base_model(tmp_path, str(path))), "models.base.id", "truncated GGUF")
    assert not (tmp_path / "results").exists()


def test_unreadable_cache_directory(tmp_path, cli, monkeypatch):
    """The model cache is a file, not a directory: a catalog model cannot be fetched there."""
    blocker = tmp_path / "cache"
    blocker.write_text("x")
    monkeypatch.setenv("KVFLOW_CACHE", str(blocker))
    path = _with_base_model(tmp_path, "catalog:smollm2-135m-instruct")
    result = cli("run", path)
    assert_user_error(result, "models.base.id", "the model cache", "is a file, not a directory")
    assert "loading models" not in result.stderr  # found before anything loads
    assert not (tmp_path / "results").exists()


# --------------------------------------------------------------------------- datasets


def _with_dataset(tmp_path, content: bytes) -> Path:
    path = tiny_pipeline(tmp_path, problems=2, helper=False)
    (tmp_path / "problems.jsonl").write_bytes(content)
    return path


DATASETS = {
    "duplicate ids": (b'{"id": 1, "question": "q", "answer": "1"}\n{"id": 1, "question": "r", "answer": "2"}\n',
                      ["problems.jsonl:2", "duplicate id 1", "line 1"]),
    "empty file": (b"", ["problems.jsonl", "empty"]),
    "not UTF-8": (b'{"question": "q", "answer": "1"}\n{"question": "\xff\xfe", "answer": "2"}\n',
                  ["problems.jsonl:2", "not UTF-8"]),
    "answers all missing": (b'{"question": "q"}\n{"question": "r"}\n', ["problems.jsonl:1", "missing field 'answer'"]),
    "answers all empty": (b'{"question": "q", "answer": ""}\n{"question": "r", "answer": " "}\n',
                          ["problems.jsonl", "every 'answer' is empty"]),
}


@pytest.mark.parametrize("case", sorted(DATASETS))
def test_bad_datasets_are_refused_before_anything_runs(tmp_path, cli, case):
    content, needles = DATASETS[case]
    path = _with_dataset(tmp_path, content)
    if case == "duplicate ids":  # ids from the records, as a researcher's own file has them
        import yaml

        doc = yaml.safe_load(path.read_text())
        doc["dataset"]["fields"] = {"id": "id"}
        path.write_text(yaml.safe_dump(doc))
    result = cli("run", path)
    assert_user_error(result, "dataset", *needles)
    assert not (tmp_path / "results").exists()


# --------------------------------------------------------------------------- while running


def test_disk_full_during_a_run_stops_cleanly_and_resumes(tmp_path, cli, monkeypatch):
    """The second record's write fails with ENOSPC: a message naming samples.jsonl, exit 2,
    no partial line and no temp file; the same command afterwards finishes the run."""
    import builtins

    from kvflow.results import files as results

    path = tiny_pipeline(tmp_path, problems=3, helper=False, max_tokens=16,
                         extra={"run": {"batch_problems": 1, "live_problems": 1}})
    writes = {"n": 0}
    real_open = builtins.open

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])  # a partial write, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

    def fake_open(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        if str(file).endswith("samples.jsonl") and "a" in mode:
            writes["n"] += 1
            if writes["n"] == 2:
                return Full(f)
        return f

    monkeypatch.setattr(results, "open", fake_open, raising=False)
    result = cli("run", path)
    assert_user_error(result, "samples.jsonl", "No space left on device", "run the same command again")
    run_dir = _run_dir(tmp_path)
    lines = (run_dir / "samples.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 2  # one whole record, nothing partial
    assert no_tmp_files(tmp_path)
    monkeypatch.undo()
    assert cli("run", path).exit_code == 0
    assert len((run_dir / "samples.jsonl").read_text().splitlines()) == 3


def test_a_failed_atomic_write_leaves_no_temp_file(tmp_path, monkeypatch):
    from kvflow.results import files as results

    target = tmp_path / "metrics.json"
    target.write_text("{}")

    def failing_replace(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results.os, "replace", failing_replace)
    with pytest.raises(OSError):
        results._atomic_write(target, '{"a": 1}')
    assert target.read_text() == "{}" and no_tmp_files(tmp_path)


def test_an_unexpected_error_is_a_message_and_a_saved_traceback(tmp_path, cli, monkeypatch):
    from kvflow.runtime import local

    def boom(*a, **k):
        raise RuntimeError("something kvflow did not expect")

    monkeypatch.setattr(local, "decode", boom)
    monkeypatch.setenv("KVFLOW_CACHE", str(tmp_path / "cache"))
    path = tiny_pipeline(tmp_path, problems=1, helper=False)
    result = cli("run", path)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "internal error: RuntimeError: something kvflow did not expect" in result.stderr
    saved = Path(result.stderr.split("the traceback is in ")[1].split(";")[0])
    assert saved.is_file() and "Traceback" in saved.read_text() and "boom" in saved.read_text()
