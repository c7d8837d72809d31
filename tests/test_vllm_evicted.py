"""Evicted proposers on the `vllm` backend where vLLM's prefix cache meets them (`evict.py`).

The engine contract (tests/test_engine_contract.py: a budget above the sequence equals plain
greedy `generate`, adopt, ingest, fork) and the evictor contract's engine axis
(tests/test_evictor_contract.py: the same greedy steps, log-probabilities and kept keys as `hf`
for every registered evictor) run on vLLM too. Here: the two places where an evicted request and
vLLM's prefix cache share blocks, on a prompt longer than one KV block (128 tokens on a CPU):
- a full-context request after an evicted one over the same tokens reads only full-context
  keys from the cache (the evicted request's blocks past its stand-ins are never cached);
- an evicted state whose ingestion (one request, run by vLLM in chunks that end at the
  compaction points) crosses a block a full-context request cached takes no cache hit (the
  evicted request's KV sees every token), and decodes and compacts as on `hf`;
- evicted candidates take no block of vLLM's KV pool (a pool full-context ones fill), and those vLLM
  preempts for full-context ones run again and decode as on `hf`.
(H2O's statistic, kept in the forward by the worker's table, is compared with `hf`'s slot for
slot by the evictor contract's engine axis: `engine_parity.assert_same_as_hf`.)

Every test shares the vLLM worker of tests/test_vllm.py (`load_engine("vllm")`, one per process).
"""

from __future__ import annotations

import pytest

from conftest import pin_for_session, require_vllm
from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest
from kvflow.registry import get_registry
from kvflow.testing.engine_contract import full_cache, run_to_end
from kvflow.testing.engine_parity import NEVER, QUESTION, backend_model_dir, chat_prompt, load_engine

BLOCK = 128  # vLLM's KV block on a CPU


@pytest.fixture(scope="module")
def vllm_engine():
    require_vllm()
    engine = pin_for_session(load_engine("vllm"))
    assert engine.worker.info["settings"]["block_size"] == BLOCK
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_engine():
    return load_engine("hf", backend_model_dir("vllm"))


def _long_prompt(engine) -> str:
    """A chat prompt of more than one KV block."""
    questions = " ".join(f"({i}) {QUESTION}" for i in range(5))
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": questions}], tokenize=False,
                                                add_generation_prompt=True)
    assert BLOCK + 16 < len(engine.encode(text)) < 2 * BLOCK
    return text


def _rkv(buffer: int = 8):
    cls = get_registry().get("evictors", "rkv")
    return cls(cls.Params(budget=16, buffer=buffer, window=4))


def _greedy(engine, state, tokens: int):
    (p,) = run_to_end(engine, [ProposeRequest(state, "base", SamplingSpec(1, 0.0, 1.0, tokens, NEVER), 0, 400)])
    return p.candidates[0]


def test_a_full_context_request_after_an_evicted_one_reads_no_evicted_block(vllm_engine, hf_engine):
    import torch
    from transformers import AutoModelForCausalLM

    from kvflow.backends.served.engine import FullState

    prompt = _long_prompt(vllm_engine)
    (state,) = vllm_engine.start([StartRequest(prompt, _rkv(), 3)])
    # the candidate's tokens fill the prompt's second block: vLLM's kernel wrote its own keys there
    evicted = _greedy(vllm_engine, state, 2 * BLOCK - len(state.ids) + 8)
    vllm_engine.release([state])
    ids = state.ids + list(evicted.token_ids)
    assert len(ids) > 2 * BLOCK
    got = _greedy(vllm_engine, FullState(ids), 12)
    model = AutoModelForCausalLM.from_pretrained(backend_model_dir("vllm"), dtype=torch.float32)
    want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, output_scores=True,
                          return_dict_in_generate=True)
    assert got.token_ids == want.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(want.scores, got.token_ids)]
    assert max(abs(a - b) for a, b in zip(got.logprobs, logprobs)) < 1e-4


def test_an_evicted_ingest_takes_no_cache_hit_past_its_evicted_part(vllm_engine, hf_engine):
    prompt = _long_prompt(vllm_engine)
    # a full-context request caches the prompt's first block ...
    (full,) = vllm_engine.start([StartRequest(prompt, full_cache(), 0)])
    _greedy(vllm_engine, full, 4)
    # ... which the evicted state's ingestion crosses: one request, which vLLM's scheduler runs
    # in chunks that end at the compaction points (22, then 6 at a time: 28, ..., 124, 130)
    evictor = _rkv(buffer=6)
    got = {}
    for engine in (hf_engine, vllm_engine):
        before = vllm_engine.stats()["ingest_requests"]
        (state,) = engine.start([StartRequest(prompt, evictor, 5)])
        if engine is vllm_engine:
            assert engine.stats()["ingest_requests"] == before + 1, "the prompt took a chain of requests"
        cand = _greedy(engine, state, 20)
        got[engine.backend] = (cand.token_ids, cand.logprobs, engine.kept_kv(state))
        engine.release([state])
    assert got["vllm"][0] == got["hf"][0]
    assert max(abs(a - b) for a, b in zip(got["vllm"][1], got["hf"][1])) < 1e-4
    (keys_v, _, compactions_v), (keys_h, _, compactions_h) = got["vllm"][2], got["hf"][2]
    assert compactions_v == compactions_h > 0
    for layer_v, layer_h in zip(keys_v, keys_h):
        for head_v, head_h in zip(layer_v, layer_h):
            assert (head_v - head_h).abs().max() < 1e-4


def _tight_engine(hf_engine):
    """A vLLM engine whose KV cache has 4 usable blocks (5: vLLM keeps one, the null block)."""
    from kvflow.config.schema import ModelConfig

    require_vllm()
    layers, kv_heads, head_dim, elem = hf_engine.kv_shape()
    tight = {"kv_cache_memory_bytes": 5 * BLOCK * 2 * layers * kv_heads * head_dim * elem, "max_model_len": 4 * BLOCK}
    loader = get_registry().get("backends", "vllm")
    engine = loader.load(ModelConfig(backend="vllm", id=str(backend_model_dir("vllm")), dtype="float32",
                                     device="cpu", engine=tight))
    assert engine.worker.info["settings"]["kv_blocks"] == 5
    return engine


def _decode(engine, requests):
    """Each proposal's candidates as (token ids, logprobs), the requests run together."""
    return _released(engine, requests, run_to_end(engine, requests))


def _released(engine, requests, proposals):
    """The requests' states released; each proposal's candidates as (token ids, logprobs)."""
    engine.release([r.state for r in requests], proposals)
    return [[(c.token_ids, c.logprobs) for c in p.candidates] for p in proposals]


def _decode_behind(engine, first, behind):
    """`_decode` of two requests, `behind` submitted once `first` has decoded a few steps: its
    candidates then run after `first`'s in vLLM's queue, the ones vLLM preempts first when
    `first`'s need blocks (submitted together, which candidates vLLM admitted first depended on
    when the worker read them: CI once saw no evicted candidate preempted)."""
    engine.submit([first])
    done = {}
    for step in range(100_000):
        if step == 3:
            engine.submit([behind])
        done.update((id(p.request), p) for p in engine.step())
        if len(done) == 2:
            break
    return _released(engine, [first, behind], [done[id(first)], done[id(behind)]])


def _same(got, want):
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(got, want, strict=True):
        assert tokens_a == tokens_b
        assert max(abs(a - b) for a, b in zip(lps_a, lps_b)) < 1e-4


def test_evicted_candidates_hold_the_blocks_their_budget_needs_where_full_context_ones_fill_the_pool(hf_engine):
    """4 candidates of 231 tokens in a KV cache of 4 usable blocks: evicted ones (R-KV 16 + 8)
    hold one block each (their KV compacted in place every 8 tokens), the prompt's snapshot leaves the
    pool for the fourth (a snapshot holds blocks only while nobody waits for them), and all four
    run together, unpreempted, as on `hf`; full-context ones (2 blocks each) fill the pool."""
    spec = SamplingSpec(4, 0.0, 1.0, BLOCK + 64, NEVER)
    engine = _tight_engine(hf_engine)
    try:
        want = _decode(hf_engine, [ProposeRequest(hf_engine.start([StartRequest(chat_prompt(hf_engine), _rkv(), 9)])[0],
                                                  "base", spec, 0, 400)])
        got = _decode(engine, [ProposeRequest(engine.start([StartRequest(chat_prompt(engine), _rkv(), 9)])[0],
                                              "base", spec, 0, 400)])
        engine.drain()  # every candidate's end counted (its counters come with it)
        stats = engine.stats()
        assert stats["evicted_blocks_peak"] == 1 and stats["evicted_preemptions"] == 0
        assert stats["evicted_compactions"] >= 4 * (BLOCK + 64) // 8 - 4 and stats["snapshot_spills"] == 1
        _same(got[0], want[0])
        (full,) = engine.start([StartRequest(chat_prompt(engine), full_cache(), 0)])
        _decode(engine, [ProposeRequest(full, "base", spec, 0, 400)])
        engine.drain()
        assert engine.stats()["kv_blocks_peak"] == 4  # the subject's contrast: full context fills the pool
    finally:
        engine.worker.close()


def test_an_evicted_request_vllm_preempts_for_a_full_context_one_decodes_as_on_hf(hf_engine):
    """Full-context candidates short of blocks make vLLM preempt the running requests after them,
    evicted ones included: a preempted evicted request's KV (its block, compacted) waits outside the
    pool and comes back into fresh blocks when vLLM runs it again (not recomputed: its evicted
    tokens are gone), and every candidate decodes as on `hf`."""
    engine = _tight_engine(hf_engine)
    try:
        runs = {}
        for e in (hf_engine, engine):
            # the full-context candidate's second block (at its token 128) is one the evicted ones hold
            (full,) = e.start([StartRequest(chat_prompt(e), full_cache(), 0)])
            (evicted,) = e.start([StartRequest(chat_prompt(e), _rkv(), 9)])
            runs[e.backend] = _decode_behind(e, ProposeRequest(full, "base", SamplingSpec(1, 0.0, 1.0, BLOCK + 64, NEVER),
                                                               0, 400),
                                             ProposeRequest(evicted, "base", SamplingSpec(3, 0.0, 1.0, BLOCK + 64, NEVER),
                                                            0, 400))
        engine.drain()
        assert engine.stats()["evicted_preemptions"] > 0, "vLLM preempted no evicted candidate: the test tested nothing"
    finally:
        engine.worker.close()
    for got, want in zip(runs["vllm"], runs["hf"]):
        _same(got, want)

