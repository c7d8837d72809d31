"""BreadthKV / KIVI quantization: packing, error bounds per bit-width on random tensors,
hand-checked values, and the quantized BudgetedCache (8 bits close to full precision,
bytes held equal to the accounting, fork/join, batch invariance)."""

from __future__ import annotations

import pytest
import torch

from kvflow import kv_memory
from kvflow.backends.hf.quant import (dequantize_keys, dequantize_values, pack, quantize_keys, quantize_values,
                                      unpack)
from kvflow.components.base import QuantizeParams
from kvflow.testing import tiny_runner
from kvflow_builtin.evictors.breadthkv import BreadthKVEvictor
from kvflow_builtin.evictors.snapkv import SnapKVEvictor

BITS = [2, 3, 4, 8]


@pytest.mark.parametrize("bits", BITS)
def test_pack_roundtrip_and_size(bits):
    codes = torch.randint(0, 2**bits, (3, 2, 5, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 2, 5, bits * 16 // 8)
    assert torch.equal(unpack(packed, bits), codes)


def test_pack_layout_by_hand():
    # 8 two-bit codes -> plane 0 (low bits) then plane 1 (high bits), code i at bit i
    codes = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]], dtype=torch.uint8)
    assert pack(codes, 2).tolist() == [[0b10101010, 0b11001100]]


def test_values_per_token_by_hand():
    # one token, one group of 4 channels: min 0, max 3 -> scale 1, codes are the values
    v = torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0, 10.0, 10.0, 10.0]).view(1, 1, 1, 8)
    codes, scale, zero = quantize_values(v, 2, 4)
    assert unpack(codes, 2).tolist() == [[[[0, 1, 2, 3, 0, 0, 0, 0]]]]
    assert scale.flatten().tolist() == [1.0, 0.0] and zero.flatten().tolist() == [0.0, 10.0]
    assert torch.equal(dequantize_values(codes, scale, zero, 2, 4), v)


def test_keys_per_channel_by_hand():
    # two tokens, one group: each channel gets its own min/max over the two tokens
    k = torch.tensor([[0.0] * 8, [3.0, 6.0, 0, 0, 0, 0, 0, 0]]).view(1, 1, 2, 8)
    codes, scale, zero = quantize_keys(k, 2, 2)
    assert scale.shape == (1, 1, 1, 8)
    assert scale.flatten().tolist()[:3] == [1.0, 2.0, 0.0]
    assert unpack(codes, 2)[0, 0, 1, :2].tolist() == [3, 3]
    assert torch.equal(dequantize_keys(codes, scale, zero, 2, 2), k)


@pytest.mark.parametrize("bits", BITS)
def test_error_bound_random(bits):
    """|x - x̂| <= scale / 2 elementwise; the error halves with every extra bit."""
    x = torch.randn(2, 3, 64, 32, generator=torch.Generator().manual_seed(0)) * 3
    kc, ks, kz = quantize_keys(x, bits, 16)
    err_k = (x - dequantize_keys(kc, ks, kz, bits, 16)).abs()
    assert (err_k <= ks.repeat_interleave(16, dim=2) / 2 + 1e-5).all()
    vc, vs, vz = quantize_values(x, bits, 16)
    err_v = (x - dequantize_values(vc, vs, vz, bits, 16)).abs()
    assert (err_v <= vs.repeat_interleave(16, dim=3) / 2 + 1e-5).all()
    # uniform rounding: the error is uniform on [-scale/2, scale/2], so its RMS is scale/sqrt(12)
    # (a dequantize that returned zeros, or the wrong bit width, is far from that)
    for err, scale, dim in ((err_k, ks, 2), (err_v, vs, 3)):
        ratio = err.pow(2).mean().sqrt() / (scale.repeat_interleave(16, dim=dim).pow(2).mean().sqrt() / 12**0.5)
        assert 0.8 < float(ratio) < 1.2, f"{bits} bits: error RMS is {float(ratio):.2f} x scale/sqrt(12)"


def test_error_halves_with_every_extra_bit():
    """Compares bit widths: one more bit halves the step (range / (2^bits - 1)), so the RMS
    error of 3 bits is 3/7 of 2 bits', of 4 bits 7/15 of 3 bits'; 8 bits is ~1/85 of 2 bits'."""
    x = torch.randn(2, 3, 64, 32, generator=torch.Generator().manual_seed(1)) * 3
    rms = {}
    for bits in (2, 3, 4, 8):
        vc, vs, vz = quantize_values(x, bits, 16)
        rms[bits] = float((x - dequantize_values(vc, vs, vz, bits, 16)).pow(2).mean().sqrt())
    for lo, hi in ((2, 3), (3, 4), (2, 8)):
        expected = (2**lo - 1) / (2**hi - 1)
        assert rms[hi] / rms[lo] == pytest.approx(expected, rel=0.15), (lo, hi, rms)


def _feed(runner, cache, lens_per_step, seed=0):
    """Run forwards with ragged per-row step lengths; returns the last logits [rows, vocab]."""
    g = torch.Generator().manual_seed(seed)
    out = None
    for lens in lens_per_step:
        ids = [torch.randint(5, 300, (n,), generator=g).tolist() for n in lens]
        runner.ingest(cache, [x[:-1] for x in ids])  # chunks so no row passes a compaction point
        out = runner.forward(cache, [x[-1:] for x in ids])
    return out


SCHEDULE = [[9, 3, 6]] + [[1, 1, 1]] * 60 + [[4, 0, 2]] + [[1, 1, 1]] * 30


def _params(bits, **kw):
    base = dict(budget=40, buffer=16, window=4, kernel=3)
    base.update(kw)
    q = None if bits is None else QuantizeParams(bits=bits, group_size=8, residual=8)
    return BreadthKVEvictor.Params(quantize=q, **base) if q else SnapKVEvictor.Params(**base)


def test_eight_bits_close_to_full_precision():
    runner = tiny_runner("qwen2")
    full = runner.new_cache(SnapKVEvictor(_params(None)), 3)
    quant = runner.new_cache(BreadthKVEvictor(_params(8)), 3)
    a, b = _feed(runner, full, SCHEDULE), _feed(runner, quant, SCHEDULE)
    assert int(quant.rows.compactions.min()) >= 2 and int(quant.rows.n_quantized.min()) == 32
    torch.testing.assert_close(b, a, rtol=0, atol=2e-2 * float(a.abs().max()))
    assert torch.equal(quant.rows.lengths, full.rows.lengths)


@pytest.mark.parametrize("bits", BITS)
def test_error_grows_as_bits_shrink(bits):
    runner = tiny_runner("qwen2")
    full = runner.new_cache(SnapKVEvictor(_params(None)), 3)
    ref = _feed(runner, full, SCHEDULE)
    quant = runner.new_cache(BreadthKVEvictor(_params(bits)), 3)
    err = (_feed(runner, quant, SCHEDULE) - ref).abs().max() / ref.abs().max()
    assert float(err) < {2: 1.0, 3: 0.5, 4: 0.25, 8: 0.02}[bits]


@pytest.mark.parametrize("bits", BITS)
def test_bytes_held_match_accounting(bits):
    runner = tiny_runner("qwen2")
    params = _params(bits)
    cache = runner.new_cache(BreadthKVEvictor(params), 3)
    _feed(runner, cache, SCHEDULE[:20])
    cfg = runner.model.config
    lay = kv_memory.layout(params, cfg.num_hidden_layers, cfg.num_key_value_heads,
                           cfg.hidden_size // cfg.num_attention_heads, 4)
    assert cache.resident_bytes() == 3 * lay.peak_bytes
    plain = runner.new_cache(SnapKVEvictor(_params(None)), 3)
    _feed(runner, plain, SCHEDULE[:20])
    assert cache.resident_bytes() < plain.resident_bytes()


def test_quantize_only_phase_then_evict():
    """A row within budget moves whole key groups to the quantized store when its
    full-precision region fills; later compactions evict to exactly `budget`."""
    runner = tiny_runner("qwen2")
    params = _params(4, budget=64, buffer=16)  # residual region: 64 - 56 = 8 tokens
    cache = runner.new_cache(BreadthKVEvictor(params), 1)
    _feed(runner, cache, [[10]] + [[1]] * 14)  # 24 tokens: full-precision region (8 + 16) full
    assert int(cache.rows.n_quantized[0]) == 16 and int(cache.rows.lengths[0]) == 24
    assert int(cache.rows.compactions[0]) == 0
    _feed(runner, cache, [[1]] * 60)
    assert int(cache.rows.compactions[0]) >= 1 and int(cache.rows.n_quantized[0]) == 56


def test_alone_equals_batched_and_fork():
    runner = tiny_runner("qwen2")
    ev = BreadthKVEvictor(_params(4))
    batch = runner.new_cache(ev, 3)
    out = _feed(runner, batch, SCHEDULE)
    # a fork of row 1 continues exactly like row 1
    fork = batch.select([1, 1])
    nxt = [[17], [17]]
    torch.testing.assert_close(runner.forward(fork, nxt)[0], runner.forward(batch.select([1]), [[17]])[0],
                               rtol=0, atol=1e-5)
    # row 2 alone (same tokens) equals row 2 in the batch
    g = torch.Generator().manual_seed(0)
    ids_per_step = [[torch.randint(5, 300, (n,), generator=g).tolist() for n in lens] for lens in SCHEDULE]
    alone = runner.new_cache(ev, 1)
    for step in ids_per_step:
        if step[2]:
            runner.ingest(alone, [step[2][:-1]])
            last = runner.forward(alone, [step[2][-1:]])
    torch.testing.assert_close(last[0], out[2], rtol=1e-4, atol=1e-4)


def test_budget_bytes_conversion_and_equal_memory():
    cfg = dict(n_layers=24, n_kv_heads=2, head_dim=64, elem=2)  # Qwen2.5-0.5B in bf16
    plain = SnapKVEvictor.Params(budget_bytes=64 * 24 * 2 * 64 * 2 * 2)  # exactly 64 full-precision tokens
    assert kv_memory.budget_for_bytes(plain, **cfg) == 64
    quant = BreadthKVEvictor.Params(budget_bytes=plain.budget_bytes, quantize=QuantizeParams(bits=2))
    tokens = kv_memory.budget_for_bytes(quant, **cfg)
    lay = kv_memory.layout(quant, **cfg, budget=tokens)
    assert lay.kept_bytes <= plain.budget_bytes and tokens > 2 * 64
    with pytest.raises(ValueError, match="either budget"):
        SnapKVEvictor.Params(budget=32, budget_bytes=1000)
    resolved = quant.with_budget(tokens)
    assert resolved.budget == tokens and resolved.budget_bytes is None and resolved.quantize.bits == 2


@pytest.mark.parametrize("kw, match", [
    (dict(budget=20, quantize=dict(residual=8, group_size=16)), "nothing would be quantized"),
    (dict(budget=64, buffer=8, quantize=dict(group_size=16)), "buffer"),
])
def test_invalid_quantize_params(kw, match):
    with pytest.raises(ValueError, match=match):
        BreadthKVEvictor.Params(**kw)


def test_none_rejects_quantize():
    from kvflow_builtin.evictors.none import NoEviction

    with pytest.raises(ValueError, match="evicting method"):
        NoEviction.Params(quantize=dict(bits=4))


def test_eviction_cadence_matches_unquantized():
    """Quantized rows evict at exactly budget + buffer resident tokens, down to budget, like
    unquantized ones; in between only whole key groups move to the quantized store."""
    runner = tiny_runner("qwen2")
    params = _params(4, budget=24, buffer=8)  # store: 16 slots, residual 8, full-precision region 8 + 8
    cache = runner.new_cache(BreadthKVEvictor(params), 1)
    before_comp = 0
    for _ in range(70):
        length_before = int(cache.rows.lengths[0])
        _feed(runner, cache, [[1]])
        comp = int(cache.rows.compactions[0])
        if comp > before_comp:
            assert length_before + 1 == 24 + 8 and int(cache.rows.lengths[0]) == 24
            before_comp = comp
        assert int(cache.rows.n_quantized[0]) % 8 == 0 and int(cache.rows.lengths[0]) < 32
    assert before_comp >= 4
