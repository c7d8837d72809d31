"""`kvflow doctor` (issue 33): versions, devices, engines, a tiny model through each engine and a
pipeline's placement, one line each, exit 1 on any failure with what to do."""

from __future__ import annotations

from conftest import REPO

from kvflow.tools import doctor


def test_doctor_passes_here_and_shows_a_pipelines_pools(cli):
    result = cli("doctor", str(REPO / "pipelines/sglang/kv_rescue.yaml"), "--gpus", "1x80", "--engines", "hf")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "ok  torch" in out and "hf on cpu" in out and "equals greedy generate" in out
    assert "starts #3" in out and "mem_fraction_static" in out and "tokens" in out
    assert out.rstrip().splitlines()[-1].startswith("ok:")


def test_doctor_fails_with_what_to_do(cli, monkeypatch, tmp_path):
    """A pipeline that does not fit, and an engine whose tokens differ, each fail the run."""
    result = cli("doctor", str(REPO / "pipelines/sglang/gpu/full_kv_72b.yaml"), "--gpus", "1x80", "--engines", "hf")
    assert result.exit_code == 1 and "FAIL" in result.output and "->" in result.output, result.output
    monkeypatch.setattr(doctor, "_hf_exact", lambda directory, device: "tokens differ from generate at position 3")
    result = cli("doctor", "--engines", "hf")
    assert result.exit_code == 1 and "FAIL  hf on cpu" in result.output and "report it" in result.output


def test_the_tested_set_is_read_from_the_shipped_constraints():
    pins = doctor.tested_set()
    assert pins["sglang"] == "0.5.23" and "torch" in pins and "transformers" in pins


def test_doctors_sglang_check_passes_and_leaves_no_engine_behind(tmp_path):
    """The SGLang line of `kvflow doctor`: R-KV on a tiny model decodes hf's tokens and the
    tripwire counted them; its engine is closed after (no SGLang process left)."""
    from conftest import require_sglang

    require_sglang()
    from kvflow.backends.served.worker import _SHARED
    from kvflow.testing.pipelines import tiny_model_dir

    directory = tiny_model_dir(tmp_path, "qwen2", seed=3)
    before = set(_SHARED)
    assert doctor._sglang_parity(directory, "cpu") is None
    # nothing of its own stays; an idle engine of an earlier test may have been closed for it
    assert not set(_SHARED) - before
