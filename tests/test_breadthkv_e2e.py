"""BreadthKV through the real CLI on tiny models (kvflow.testing.tiny_pipeline): `kvflow
calibrate-bits` on a calibration split disjoint from the evaluation split, and KV-Rescue
with a quantized base; bytes held are reported in manifest.json."""

from __future__ import annotations

import json
from pathlib import Path

from kvflow.testing import tiny_pipeline
from test_e2e import REPO, kvflow

# tiny Qwen2 in float32: 2 layers x 2 KV heads x head_dim 16 x 2 (K, V) x 4 bytes = 512 bytes/token
BYTES = 16 * 512  # 16 tokens at full precision
EVICTOR = {"kind": "breadthkv", "budget_bytes": BYTES, "buffer": 8, "window": 2, "kernel": 3,
           "quantize": {"bits": 4, "group_size": 8, "residual": 4}}


def test_calibrate_bits_end_to_end(tmp_path):
    path = tiny_pipeline(tmp_path, include=REPO / "pipelines/cpu/breadthkv.yaml", evictor=EVICTOR, problems=4,
                         extra={"dataset": {"limit": 2}})
    proc = kvflow("calibrate-bits", path, "--problems", "2", "--bits", "4,16", cwd=tmp_path)
    assert "chosen:" in proc.stdout
    report = json.loads((tmp_path / "results" / "tiny__calibrate_bits" / "calibrate_bits.json").read_text())
    assert report["byte_budget"] == BYTES and report["calibration"]["offset"] == 2
    rows = {r["bits"]: r for r in report["rows"]}
    assert set(rows) == {4, 16} and all(r["n_problems"] == 2 for r in rows.values())
    # the same bytes buy more tokens at 4 bits: 32 quantized (48 bytes per token and head,
    # scales included) + 4 full precision (128) = 2048 bytes per (layer, KV head)
    assert rows[16]["budget_tokens"] == 16 and rows[4]["budget_tokens"] == 36
    # the rule (kvflow.tools.calibrate_bits.choose), from the rows: accuracy, then fewer length caps, then fewer bits
    expected = sorted(rows.values(), key=lambda r: (-r["accuracy"], r["length_cap_rate"], r["bits"]))[0]["bits"]
    assert report["chosen_bits"] == expected
    calib_ids = set(report["calibration"]["ids"])
    assert calib_ids == {"tiny/2", "tiny/3"}  # the evaluation split is problems 0 and 1
    for bits, r in rows.items():
        run_dir = Path(r["results"])
        recs = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
        assert {x["id"] for x in recs} == calib_ids
        mem = json.loads((run_dir / "manifest.json").read_text())["kv_memory"]["base"]
        assert mem["budget"] == r["budget_tokens"] and mem["kept_bytes"] <= BYTES
        assert mem["bits"] == (None if bits == 16 else 4)

    # overlapping the evaluation split is refused with a located error, exit 2
    bad = kvflow("calibrate-bits", path, "--problems", "2", "--offset", "1", cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "overlaps the evaluation split" in bad.stderr and "Traceback" not in bad.stderr


def test_kv_rescue_with_quantized_base(tmp_path, cli, monkeypatch):
    """KV-Rescue with a 4-bit base through `kvflow run` (in-process, so the caches can be
    watched): the base's caches really hold 32 quantized tokens after each compaction and the
    bytes the manifest reports (not only the manifest's own arithmetic)."""
    from kvflow.backends.hf.cache import BudgetedCache

    seen = []
    original = BudgetedCache.compact

    def watched(self, rows):
        original(self, rows)
        if self.quant:
            seen.append((self.rows.n_quantized[rows].tolist(), self.rows.lengths[rows].tolist(),
                         self.resident_bytes() // self.n_rows, self.layers[0].qstore.bits))

    monkeypatch.setattr(BudgetedCache, "compact", watched)
    path = tiny_pipeline(tmp_path, include=REPO / "pipelines/cpu/breadthkv_rescue.yaml", evictor=EVICTOR, problems=1,
                         max_tokens=64)
    assert cli("run", path).exit_code == 0
    (run_dir,) = (tmp_path / "results").iterdir()
    (record,) = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert record["tokens_generated"]["base"] > 0 and record["tokens_generated"]["helper"] > 0
    mem = json.loads((run_dir / "manifest.json").read_text())["kv_memory"]
    assert mem["base"]["n_quantized"] == 32 and mem["base"]["bits"] == 4
    assert mem["helper"]["budget"] is None and mem["helper"]["n_quantized"] == 0
    # until its store is full a compaction only moves whole key groups (8 tokens) into it; then
    # it evicts, down to the budget with exactly 32 tokens quantized
    assert all(n % 8 == 0 and 0 < n <= 32 for nq, _, _, _ in seen for n in nq)
    evictions = [e for e in seen if set(e[0]) == {32}]
    assert evictions, "the quantized base never evicted"
    for _, lengths, bytes_per_row, bits in evictions:
        assert set(lengths) == {mem["base"]["budget"]} and bits == 4
    assert {b for _, _, b, _ in seen} == {mem["base"]["peak_bytes"]}  # what the cache allocates, per sequence
