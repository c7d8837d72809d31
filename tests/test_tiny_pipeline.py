"""`kvflow.testing.tiny_pipeline`: the pipeline files it writes validate and run through the
real `kvflow run` (models loaded from the saved tiny directories, results directory written)."""

from __future__ import annotations

import json

from conftest import REPO
from kvflow.config import load_pipeline
from kvflow.testing import tiny_pipeline


def test_default_pipeline_runs_end_to_end(tmp_path, cli):
    path = tiny_pipeline(tmp_path, pruners=[{"kind": "entropy", "threshold": 4.0, "min_tokens": 4}], problems=3)
    result = cli("run", path)
    assert result.exit_code == 0, result.output
    (run_dir,) = (tmp_path / "results").iterdir()
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 3
    for r in records:
        assert set(r["tokens_generated"]) == {"base", "helper"} and r["tokens_generated"]["base"] > 0
        assert set(r["pruned"]) == {"entropy"}
        assert r["output_tokens"] >= 1
    assert json.loads((run_dir / "metrics.json").read_text())["n_problems"] == 3


def test_run_threads_are_set_for_the_run_and_restored(tmp_path, cli):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        path = tiny_pipeline(tmp_path, problems=1, helper=False, extra={"run": {"threads": 1}})
        result = cli("run", path)
        assert result.exit_code == 0, result.output
        (run_dir,) = (tmp_path / "results").iterdir()
        assert json.loads((run_dir / "manifest.json").read_text())["threads"] == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_include_shrinks_a_shipped_pipeline(tmp_path):
    path = tiny_pipeline(tmp_path, include=REPO / "pipelines" / "kv_rescue.yaml", helper=False,
                         evictor={"kind": "streaming", "budget": 12}, scorer={"kind": "random"},
                         extra={"run": {"seed": 5}})
    pipe = load_pipeline(path).pipeline
    assert list(pipe.proposers) == ["base"]
    base = pipe.proposers["base"]
    assert base.evictor.kind == "streaming" and base.evictor.params["budget"] == 12
    assert [p.kind for p in base.pruners] == ["entropy", "gzip"]  # kept from kv_rescue.yaml
    assert base.n == 2 and base.sampling.max_step_tokens == 16
    assert all(m.id.startswith(str(tmp_path)) for m in pipe.models.values())
    assert pipe.scorer.kind == "random" and pipe.run.seed == 5 and pipe.dataset.limit == 2
    assert pipe.run.output == str(tmp_path.resolve() / "results")


def test_another_model_for_every_entry(tmp_path):
    path = tiny_pipeline(tmp_path, include=REPO / "pipelines" / "quickstart.yaml", model="catalog:smollm2-135m-instruct")
    pipe = load_pipeline(path).pipeline
    assert {m.id for m in pipe.models.values()} == {"catalog:smollm2-135m-instruct"}
    assert not (tmp_path / "models").exists()
