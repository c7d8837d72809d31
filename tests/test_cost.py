"""`kvflow cost`: formulas checked by hand on the paper's constants, shapes from configs, the CLI."""

from __future__ import annotations

import json
import struct

import pytest

from kvflow.tools.cost import cost_rows, parse_lengths
from kvflow.models.shapes import PRESETS, decode_flops, kv_bytes, kv_bytes_per_token, resolve_shape, shape_from_config
from kvflow.errors import UserError

M7, M72, M15 = PRESETS["qwen2.5-math-7b"], PRESETS["qwen2.5-math-72b"], PRESETS["qwen2.5-math-1.5b"]


def test_presets_are_the_paper_constants():
    assert (M7.n_layers, M7.d_model, M7.n_kv_heads, M7.head_dim, M7.d_ffn, M7.n_params) == (28, 3584, 4, 128, 18944, 7.62e9)
    assert (M72.n_layers, M72.d_model, M72.n_kv_heads, M72.head_dim, M72.d_ffn, M72.n_params) == (80, 8192, 8, 128, 29568, 72.7e9)
    assert (M15.n_layers, M15.d_model, M15.n_kv_heads, M15.head_dim, M15.d_ffn, M15.n_params) == (28, 1536, 2, 128, 8960, 1.54e9)
    assert (M7.n_q_heads, M72.n_q_heads, M15.n_q_heads) == (28, 64, 12)  # d / d_h


def test_kv_bytes_by_hand():
    # 2 (K and V) * L * h_kv * d_h * 2 bytes (bf16)
    assert kv_bytes_per_token(M7) == 2 * 28 * 4 * 128 * 2 == 57_344  # 56 KiB
    assert kv_bytes_per_token(M72) == 2 * 80 * 8 * 128 * 2 == 327_680  # 320 KiB
    assert kv_bytes_per_token(M15) == 2 * 28 * 2 * 128 * 2 == 28_672  # 28 KiB
    assert kv_bytes(M7, 4096) == 57_344 * 4096 == 224 * 2**20  # 224 MiB at 4k
    assert kv_bytes(M7, 4096, budget=512, buffer=128) == 57_344 * 640 == 35 * 2**20
    assert kv_bytes(M7, 300, budget=512, buffer=128) == 57_344 * 300  # short contexts are not cut
    assert kv_bytes(M72, 8192) == 2560 * 2**20
    assert kv_bytes_per_token(M7, bytes_per_elem=1) == 28_672


def test_decode_flops_by_hand():
    # 2P + 2 * L * n_q * d_h * (2 * T)
    assert decode_flops(M7, 4096) == 2 * 7.62e9 + 2 * 28 * 28 * 128 * 2 * 4096  # 15.24e9 + 1.644e9
    assert decode_flops(M7, 4096) == pytest.approx(16.884e9, rel=1e-4)
    assert decode_flops(M7, 8192, budget=512, buffer=128) == 2 * 7.62e9 + 4 * 28 * 28 * 128 * 640
    assert decode_flops(M72, 1024) == 2 * 72.7e9 + 4 * 80 * 64 * 128 * 1024
    assert decode_flops(M15, 2048) == 2 * 1.54e9 + 4 * 28 * 12 * 128 * 2048


def test_cost_rows_sum_evicted_base_and_helper():
    (row,) = cost_rows([M7], M15, 512, 128, [8192])
    assert row["full_kv_bytes"] == 448 * 2**20
    assert row["evicted_kv_bytes"] == 35 * 2**20
    assert row["helper_kv_bytes"] == 224 * 2**20
    assert row["combined_kv_bytes"] == 259 * 2**20
    assert row["kv_ratio"] == pytest.approx(259 / 448)
    assert row["combined_flops"] == decode_flops(M7, 8192, 512, 128) + decode_flops(M15, 8192)
    assert row["flops_ratio"] == pytest.approx(row["combined_flops"] / decode_flops(M7, 8192))
    (alone,) = cost_rows([M72], None, 512, 128, [4096])
    assert "helper_kv_bytes" not in alone and alone["kv_ratio"] == pytest.approx(640 / 4096)


def test_parse_lengths():
    assert parse_lengths("1k,2k,4k,8k") == [1024, 2048, 4096, 8192]
    assert parse_lengths("500, 1.5k") == [500, 1536]
    with pytest.raises(UserError):
        parse_lengths("abc")


QWEN7_CONFIG = {"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
                "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
                "tie_word_embeddings": False}


def test_shape_from_config_estimates_the_parameter_count():
    m = shape_from_config(QWEN7_CONFIG, "q7")
    assert (m.n_layers, m.n_q_heads, m.n_kv_heads, m.head_dim, m.d_ffn) == (28, 28, 4, 128, 18944)
    assert m.n_params == pytest.approx(7.62e9, rel=0.01)  # the published count
    assert kv_bytes_per_token(m) == kv_bytes_per_token(M7)


def test_resolve_config_file_dir_and_safetensors(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    by_file, by_dir = resolve_shape(str(tmp_path / "config.json")), resolve_shape(str(tmp_path))
    assert by_file.n_params == by_dir.n_params and "estimated" in by_dir.source
    assert (by_dir.head_dim, by_dir.n_kv_heads) == (16, 2)
    # tensors at hand: P is counted from the safetensors header
    header = json.dumps({"a": {"dtype": "BF16", "shape": [10, 20], "data_offsets": [0, 400]},
                         "b": {"dtype": "BF16", "shape": [7], "data_offsets": [400, 414]},
                         "__metadata__": {"format": "pt"}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 414)
    assert resolve_shape(str(tmp_path)).n_params == 207


def test_resolve_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="not a preset"):
        resolve_shape("qwen-nonsense")
    with pytest.raises(UserError, match="not in the local Hugging Face cache"):
        resolve_shape("kvflow-test/not-cached-anywhere")
    with pytest.raises(UserError, match="no config.json"):
        resolve_shape(str(tmp_path))
    with pytest.raises(UserError, match="unknown catalog model"):
        resolve_shape("catalog:nope")


def test_catalog_converted_dir(tmp_path, monkeypatch):
    from kvflow.models.catalog import get_entry

    monkeypatch.setenv("KVFLOW_CACHE", str(tmp_path))
    entry = get_entry("smollm2-135m-instruct")
    with pytest.raises(UserError, match="kvflow models pull"):
        resolve_shape("catalog:smollm2-135m-instruct")
    conv = entry.path().parent / "hf-bfloat16"
    conv.mkdir(parents=True)
    (conv / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
                                                  "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                                                  "intermediate_size": 1536, "vocab_size": 49152,
                                                  "tie_word_embeddings": True}))
    m = resolve_shape("catalog:smollm2-135m-instruct")
    assert (m.n_layers, m.n_kv_heads, m.head_dim) == (30, 3, 64)
    assert m.n_params == pytest.approx(134.5e6, rel=0.02)


def test_cli_cost_table_json_and_png(cli, tmp_path):
    res = cli("cost", "qwen2.5-math-7b", "--helper", "qwen2.5-math-1.5b", "--budget", "512", "--buffer", "128",
              "--lengths", "1k,8k", "--png", tmp_path / "cost.png")
    assert res.exit_code == 0, res.output
    assert "qwen2.5-math-7b" in res.stdout and "448.0" in res.stdout and "259.0" in res.stdout
    assert (tmp_path / "cost.png").read_bytes()[:4] == b"\x89PNG"
    res = cli("cost", "qwen2.5-math-72b", "--lengths", "4k", "--json")
    rows = json.loads(res.stdout)
    assert rows[0]["full_kv_bytes"] == 1280 * 2**20 and rows[0]["helper"] is None
    bad = cli("cost", "nope-model", "--lengths", "1k")
    assert bad.exit_code == 2 and "not a preset" in bad.stderr


def test_cost_command_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys; from kvflow.tools.cost import cost_command; "
            "cost_command(['qwen2.5-math-7b'], budget=64, buffer=64, lengths='1k', helper=None, png=None, echo=lambda s: None); "
            "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, capture_output=True)
