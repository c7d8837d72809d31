"""Float32 linear layers for multi-token bf16 forwards on CPUs with slow bf16 GEMMs."""

from __future__ import annotations

import torch

from kvflow.backends.hf import matmul
from kvflow.backends.hf.engine import HFRunner
from kvflow.testing import tiny_runner
from kvflow_builtin.evictors.none import NoEviction


def test_fp32_linear_matches_bf16_linear():
    torch.manual_seed(0)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16)
    with matmul.fp32_linear():
        up = torch.nn.functional.linear(x, w, b)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert up.dtype == torch.bfloat16
    torch.testing.assert_close(up.float(), ref, rtol=1e-2, atol=1e-2)  # one bf16 rounding

    # what the mode does, not only that the result is close: the GEMM itself runs on float32
    # operands inside it, and on the bf16 ones outside it or when disabled (breaking the mode's
    # upcast makes the first assertion fail; the closeness above holds either way)
    class Spy(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.linears = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.linear:
                self.linears.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
            return func(*args, **(kwargs or {}))

    for enabled, dtype in ((True, torch.float32), (False, torch.bfloat16)):
        with Spy() as spy, matmul.fp32_linear(enabled=enabled):
            out = torch.nn.functional.linear(x, w, b)
        assert spy.linears == [(dtype,) * 3] and out.dtype == torch.bfloat16


def test_switch_and_where_it_applies(monkeypatch):
    runner = tiny_runner("qwen2", dtype="bfloat16")
    monkeypatch.setenv("KVFLOW_CPU_FP32_MATMUL", "0")
    assert matmul.fp32_min_tokens(runner.model) is None
    monkeypatch.setenv("KVFLOW_CPU_FP32_MATMUL", "1")
    assert matmul.fp32_min_tokens(runner.model) == matmul.MIN_TOKENS
    assert matmul.fp32_min_tokens(tiny_runner("qwen2", dtype="float32").model) is None  # only bf16
    runner = HFRunner(runner.model, runner.tokenizer)
    seen = []
    original = matmul._Fp32Linear.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            seen.append(args[0].shape[:-1].numel())
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(matmul._Fp32Linear, "__torch_function__", spy)
    ids = runner.encode("Natalia sold clips to 48 of her friends in April, and then half as many in May. " * 3)
    assert len(ids) >= matmul.MIN_TOKENS
    cache = runner.new_cache(NoEviction(NoEviction.Params()), 2)
    pending = runner.prefill(cache, [ids, ids[:10]])  # 2 rows x (len - 1) tokens: upcast
    assert seen and min(seen) >= matmul.MIN_TOKENS
    seen.clear()
    runner.forward(cache, pending[:, None])  # a decode step of 2 rows: native bf16
    assert seen == []


def test_upcast_prefill_decodes_like_native_bf16(monkeypatch):
    """Greedy continuation after a prefill with float32 linears equals native bf16 on a tiny
    model (the two differ at most in the last bit of some activations)."""
    runner = tiny_runner("qwen2", dtype="bfloat16")
    ids = runner.encode("Weng earns $12 an hour for babysitting. Yesterday, she did 50 minutes of babysitting.")
    outs = []
    for setting in ("0", "1"):
        monkeypatch.setenv("KVFLOW_CPU_FP32_MATMUL", setting)
        r = HFRunner(runner.model, runner.tokenizer)
        cache = r.new_cache(NoEviction(NoEviction.Params()), 1)
        pending = r.prefill(cache, [ids])
        toks = []
        for _ in range(8):
            pending = r.forward(cache, pending[:, None]).argmax(-1)
            toks.append(int(pending[0]))
        outs.append(toks)
    assert outs[0] == outs[1]
