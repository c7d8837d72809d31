"""The step scheduler through the real `kvflow run`: a killed run whose problems finish out of
order resumes without losing or duplicating one (and with the records an uninterrupted run
writes), proposers whose tokenizers differ, progress lines."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys

from conftest import wait_for_first_record
from kvflow.testing import tiny_model_dir, tiny_pipeline

STABLE = ("id", "prediction", "correct", "output", "steps", "step_counts", "output_tokens", "tokens_generated",
          "candidates", "pruned", "finish")


class _Score(float):
    """A step score that equals another within float32 noise: a likelihood batched with other
    problems differs in the 8th digit in float32 (the trajectories themselves are identical),
    which rounding cannot absorb (two such scores fall on either side of a rounding boundary)."""

    def __eq__(self, other):
        return isinstance(other, (int, float)) and math.isclose(self, other, rel_tol=1e-6, abs_tol=1e-9)

    def __ne__(self, other):
        return not self == other

    __hash__ = float.__hash__


def _records(run_dir):
    """Records by id without timings; step scores compared within float32 noise (`_Score`)."""
    out = {}
    for r in map(json.loads, (run_dir / "samples.jsonl").read_text().splitlines()):
        rec = {k: r[k] for k in STABLE}
        rec["steps"] = [{**s, "score": None if s["score"] is None else _Score(s["score"])} for s in r["steps"]]
        out[r["id"]] = rec
    return out


def _pipeline(tmp_path, name="long"):
    # 4 problems of different lengths in flight at once: they finish out of order
    return tiny_pipeline(tmp_path, name=name, problems=4, n=2, max_tokens=120,
                         extra={"limits": {"max_steps": 40}, "run": {"batch_problems": 2, "live_problems": 4}})


def test_sigkill_while_problems_finish_out_of_order_resumes_exactly(tmp_path, cli):
    reference = _pipeline(tmp_path / "reference")
    assert cli("run", reference).exit_code == 0
    (ref_dir,) = (tmp_path / "reference" / "results").iterdir()
    expected = _records(ref_dir)
    order = list(expected)  # the order problems finished in
    dataset_order = [f"tiny/{i}" for i in range(4)]
    assert sorted(order) == dataset_order and order != dataset_order  # out of order

    path = _pipeline(tmp_path / "killed")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvflow.cli", "run", str(path)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    out = tmp_path / "killed" / "results"
    wait_for_first_record(out, proc, timeout=120)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    (run_dir,) = out.iterdir()
    partial = _records(run_dir)
    assert 1 <= len(partial) < 4, "the run was not killed mid-way"
    assert cli("run", path).exit_code == 0  # resume: only the problems not yet recorded
    lines = (run_dir / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 4 and len({json.loads(x)["id"] for x in lines}) == 4
    assert _records(run_dir) == expected  # the same records, whatever ran alongside


def test_proposers_with_different_tokenizers_run_end_to_end(tmp_path, cli):
    """Base and helper tokenize differently (text is the source of truth): the helper's
    committed steps are re-tokenized by the base, committed-token counts use the base's
    tokenizer, and the run completes through `kvflow run`."""
    from transformers import AutoTokenizer

    # the base's tokenizer knows hardly more than bytes: the helper's merged tokens split
    other = tiny_model_dir(tmp_path / "models", "qwen2", seed=1, vocab_size=270)
    path = tiny_pipeline(tmp_path, problems=2, scorer={"kind": "random"},
                         extra={"models": {"base": {"id": str(other)}}, "limits": {"max_steps": 8}})
    result = cli("run", path)
    assert result.exit_code == 0, result.output
    (run_dir,) = (tmp_path / "results").iterdir()
    records = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    base_tok = AutoTokenizer.from_pretrained(other)
    helper_tok = AutoTokenizer.from_pretrained(tmp_path / "models" / "tiny-llama-2")
    helper_steps = [s for r in records for s in r["steps"] if s["source"] == "helper"]
    assert helper_steps, "no helper step was committed"
    differ = 0
    for s in helper_steps:
        base_ids = base_tok(s["text"], add_special_tokens=False)["input_ids"]
        assert s["n_tokens"] == len(base_ids)  # counted with the base's tokenizer
        differ += base_ids != helper_tok(s["text"], add_special_tokens=False)["input_ids"]
    assert differ, "the two tokenizers never disagreed: the test proves nothing"
    for r in records:
        assert r["output"] == "".join(s["text"] for s in r["steps"])


def test_a_line_per_finished_problem_when_stderr_is_not_a_terminal(tmp_path, cli):
    path = tiny_pipeline(tmp_path, problems=3, helper=False)
    result = cli("run", path)
    assert result.exit_code == 0
    lines = [x for x in result.stderr.splitlines() if x.startswith("kvflow: [")]
    assert len(lines) == 3
    assert lines[-1].startswith("kvflow: [3/3] tiny/") and " steps, " in lines[-1] and " tokens, " in lines[-1]
    assert "acc " in lines[-1]
    assert re.search(r"decode occupancy: base .* [\d.]+% \([\d.]+ of 8 rows, \d+ forwards\)", result.stdout)


def test_a_larger_limit_grows_the_run_and_a_smaller_one_reports_its_prefix(tmp_path, cli):
    """dataset.limit is not part of the run's identity (its results directory): 2 -> 4 adds only
    problems 2 and 3 to the same directory, with the records a fresh 4-problem run writes;
    4 -> 1 reports on the first problem and writes nothing."""
    path = tiny_pipeline(tmp_path / "grown", problems=4, n=2, extra={"dataset": {"limit": 2}})
    first = cli("run", path)
    assert first.exit_code == 0
    (run_dir,) = (tmp_path / "grown" / "results").iterdir()
    two = _records(run_dir)
    assert sorted(two) == ["tiny/0", "tiny/1"]
    grown = cli("run", path, "--set", "dataset.limit=4")
    assert grown.exit_code == 0 and "2 done, 2 to go" in grown.stderr
    assert [p.name for p in (tmp_path / "grown" / "results").iterdir()] == [run_dir.name]  # the same run
    four = _records(run_dir)
    assert sorted(four) == [f"tiny/{i}" for i in range(4)] and {k: four[k] for k in two} == two
    import yaml

    assert yaml.safe_load((run_dir / "config.resolved.yaml").read_text())["dataset"]["limit"] == 4
    assert json.loads((run_dir / "metrics.json").read_text())["n_problems"] == 4
    fresh = tiny_pipeline(tmp_path / "fresh", problems=4, n=2, extra={"dataset": {"limit": 4}})
    assert cli("run", fresh).exit_code == 0
    (fresh_dir,) = (tmp_path / "fresh" / "results").iterdir()
    assert _records(fresh_dir) == four
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    prefix = cli("run", path, "--set", "dataset.limit=1")
    assert prefix.exit_code == 0 and "over the first 1" in prefix.stderr and "problems" in prefix.stdout
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
