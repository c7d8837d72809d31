"""BreadthKV end to end on SmolLM2-135M: `kvflow calibrate-bits` on a calibration split
disjoint from the evaluation split, and KV-Rescue with a quantized base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_e2e import REPO, kvflow

SMOL = [
    "--set", "models.base.id=catalog:smollm2-135m-instruct",
    "--set", "models.helper.id=catalog:smollm2-135m-instruct",
    "--set", "proposers.base.n=2",
    "--set", "proposers.base.sampling.max_step_tokens=16",
    # SmolLM2: 30 layers x 3 KV heads x head_dim 64 x 2 bytes -> 23040 bytes per full-precision token
    "--set", "proposers.base.evictor.budget_bytes=368640",  # 16 tokens at full precision
    "--set", "proposers.base.evictor.buffer=16", "--set", "proposers.base.evictor.window=4",
    "--set", "proposers.base.evictor.quantize={bits: 4, group_size: 16, residual: 8}",
    "--set", "limits.max_tokens=40",
]


@pytest.mark.e2e
def test_calibrate_bits_on_smollm2(tmp_path):
    out = tmp_path / "results"
    proc = kvflow("calibrate-bits", REPO / "pipelines/cpu/breadthkv.yaml", "--problems", "1", "--bits", "4,16",
                  *SMOL, "--set", "dataset.limit=3", "--set", f"run.output={out}", cwd=tmp_path)
    assert "chosen:" in proc.stdout
    report = json.loads((out / "cpu_breadthkv__calibrate_bits" / "calibrate_bits.json").read_text())
    assert report["byte_budget"] == 368640 and report["calibration"]["offset"] == 3
    rows = {r["bits"]: r for r in report["rows"]}
    assert set(rows) == {4, 16} and all(r["n_problems"] == 1 for r in rows.values())
    # the same bytes buy more tokens at 4 bits than at full precision
    assert rows[16]["budget_tokens"] == 16 and rows[4]["budget_tokens"] > 16
    assert report["chosen_bits"] in (4, 16)
    # the calibration problem is not an evaluation problem (GSM8K test item 3, not 0..2)
    calib_ids = set(report["calibration"]["ids"])
    for r in rows.values():
        run_dir = Path(r["results"])
        recs = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
        assert {x["id"] for x in recs} == calib_ids
        manifest = json.loads((run_dir / "manifest.json").read_text())
        mem = manifest["kv_memory"]["base"]
        assert mem["kept_bytes"] <= 368640 and mem["budget"] == r["budget_tokens"]

    # overlapping the evaluation split is refused with a located error, exit 2
    bad = kvflow("calibrate-bits", REPO / "pipelines/cpu/breadthkv.yaml", "--problems", "2", "--offset", "1",
                 *SMOL, "--set", "dataset.limit=3", "--set", f"run.output={out}", cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "overlaps the evaluation split" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.e2e
def test_kv_rescue_with_quantized_base(tmp_path):
    out = tmp_path / "results"
    kvflow("run", REPO / "pipelines/cpu/breadthkv_rescue.yaml", *SMOL, "--set", "dataset.limit=1",
           "--set", "proposers.helper.n=1", "--set", "proposers.helper.sampling.max_step_tokens=16",
           "--set", f"run.output={out}", cwd=tmp_path)
    (run_dir,) = out.iterdir()
    (record,) = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert record["tokens_generated"]["base"] > 0 and record["tokens_generated"]["helper"] > 0
    mem = json.loads((run_dir / "manifest.json").read_text())["kv_memory"]
    assert mem["base"]["n_quantized"] > 0 and mem["helper"]["n_quantized"] == 0
