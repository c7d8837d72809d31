"""Bytes kvflow's part of vLLM's attention moves per decode step, counted on meta tensors (no GPU needed).

`bench/vllm_decode_bytes.py`'s `hook_bytes` runs one layer of `InBlocks.attended` for evicted
decode rows at real models' shapes (Qwen2.5-7B; Qwen2.5-72B per rank at tp 4), as a replayed
graph runs it (H2O's statistic over every row and S = budget + buffer slots), under SGLang's
byte-counting rules. Bounds (issue 46), the rows at their longest:

- R-KV and SnapKV (the query ring write only): <= 5% of one pass of vLLM's attention over the rows;
- H2O (its statistic in the forward: one gather of the keys out of vLLM's blocks, one score
  product, one softmax): <= 2.2x one pass; the per-request eager `observe()` it replaced moved
  5.3x (the gather fused into the product would remove the 1x copy).
docs/benchmarks.md#vllm-evicted has the numbers.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

SHAPES = [("qwen2.5-7b", 28, 28, 4, 128), ("qwen2.5-72b-tp4", 80, 16, 2, 128)]
BOUNDS = {"rkv": 0.05, "snapkv": 0.05, "h2o": 2.2}


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        yield importlib.import_module("vllm_decode_bytes")
    finally:
        sys.path.remove(str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.parametrize("kind", sorted(BOUNDS))
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("batch", [8, 256])
def test_kvflow_s_ops_in_vllm_s_forward_move_no_more_than_their_evictor_needs(bench, kind, shape, batch):
    from kvflow.backends.sglang.in_worker.traffic import attention_pass_bytes
    from kvflow.registry import get_registry

    _, layers, q_heads, kv_heads, d = shape
    cls = get_registry().get("evictors", kind)
    ev = cls(cls.Params(budget=64, buffer=128))  # the paper's B = 64, buffer 128
    phys = ev.trigger - 1  # slots held before the step's token: the rows at their longest
    counted = bench.hook_bytes(ev, batch=batch, phys=phys, q_heads=q_heads, kv_heads=kv_heads, head_dim=d)
    ratio = counted / attention_pass_bytes([phys + 1] * batch, kv_heads, d, d, 2)
    assert ratio <= BOUNDS[kind], (kind, shape[0], batch, round(ratio, 3))
