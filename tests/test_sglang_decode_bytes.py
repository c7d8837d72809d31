"""Bytes kvflow's SGLang decode hook moves per step, counted on meta tensors (no GPU needed).

On a GPU a decode step is bound by memory traffic; SGLang's own decode attention reads each
row's keys and values once. `kvflow.backends.sglang.in_worker.traffic.hook_bytes` runs one layer of
`graph.decode_step` at real models' shapes (Qwen2.5-7B; Qwen2.5-72B per rank at tp 4) and
batch 8, 64, 256 under a byte-counting dispatch mode. Bounds (issue 33):

- R-KV and SnapKV (query ring only): <= 5% of one pass of SGLang's attention over the rows;
- H2O (its statistic: one gather of the kept keys, one score product, one softmax):
  <= 2.1x one pass over the rows' kept slots (keys and values); the issue's 1.2x needs a kernel
  that scores keys where they lie in the pool (gather fused into the product), which stock
  torch ops do not have: the gather's copy alone is 1x of the keys;
- Ada-SnapKV (the hole-masked recompute: keys and values gathered, scored, weighted):
  <= 3.8x one pass over its rows at their widest (the fixed span);
- a full-context engine: no hook at all (tests/test_sglang_profiles.py).
docs/benchmarks.md has the before/after table (`bench/sglang_decode_bytes.py`).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvflow.backends.sglang.in_worker.graph import Profile, row_width  # noqa: E402
from kvflow.backends.sglang.in_worker.traffic import ByteCounter, attention_pass_bytes, hook_bytes  # noqa: E402

# (name, layers, q heads, KV heads per rank, head_dim)
SHAPES = [("qwen2.5-7b", 28, 28, 4, 128), ("qwen2.5-72b-tp4", 80, 16, 2, 128)]
BOUNDS = {"rkv": 0.05, "snapkv": 0.05, "h2o": 2.1, "ada-snapkv": 3.8}


def _evictor(kind):
    from kvflow.registry import get_registry

    cls = get_registry().get("evictors", kind)
    return cls(cls.Params(budget=64, buffer=128))  # the paper's B = 64, buffer 128


@pytest.mark.parametrize("kind", sorted(BOUNDS))
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("batch", [8, 64, 256])
def test_the_decode_hook_moves_no_more_than_its_evictor_needs(kind, shape, batch):
    _, layers, q_heads, kv_heads, d = shape
    ev = _evictor(kind)
    profile = Profile.of([ev], layers, kv_heads)
    width = row_width(ev, layers, kv_heads) - 1  # the rows at their longest (between compactions)
    counted = hook_bytes(profile, batch=batch, seq_len=width, q_heads=q_heads, kv_heads=kv_heads, head_dim=d,
                         layers=layers)
    one_pass = attention_pass_bytes([width] * batch, kv_heads, d, d, 2)
    ratio = counted.total / one_pass
    assert ratio <= BOUNDS[kind], (kind, shape[0], batch, round(ratio, 3), counted.by_op)


def test_the_general_hook_costs_what_the_specialised_one_saves():
    """The hook every evicting engine ran before profiles (every part, rows of 512 slots) moves
    more than 20x what R-KV's needs at the paper's shapes: the saving the profile is for."""
    ev = _evictor("rkv")
    kw = dict(batch=64, seq_len=192, q_heads=28, kv_heads=4, head_dim=128, layers=28)
    specialised = hook_bytes(Profile.of([ev], 28, 4), **kw).total
    general = hook_bytes(Profile.general(), **kw).total
    assert general > 20 * specialised, (general, specialised)


def test_profiles_are_built_from_the_evictors_served():
    rkv, h2o, ada = _evictor("rkv"), _evictor("h2o"), _evictor("ada-snapkv")
    p = Profile.of([rkv], 28, 4)
    assert (p.window, p.observes, p.varies, p.span, p.reads_kv) == (rkv.query_window, False, False, 0, False)
    p = Profile.of([h2o], 28, 4)
    assert p.observes and not p.varies and p.window == 0 and p.span == h2o.trigger + 1
    p = Profile.of([rkv, ada], 28, 4)
    assert p.varies and not p.observes and p.window == max(rkv.query_window, ada.query_window)
    assert p.span == max(ada.layer_widths(28, 4)) + 1
    assert Profile.of([], 28, 4) == Profile()
    assert Profile(**__import__("json").loads(p.to_json())) == p


def test_the_byte_counter_counts_gathers_by_what_they_read():
    """A gather of 10 rows from a pool of a million reads those rows, not the pool; a view
    moves nothing; an elementwise op reads and writes its tensors once."""
    meta = torch.device("meta")
    pool = torch.empty(1 << 20, 64, dtype=torch.bfloat16, device=meta)
    idx = torch.zeros(10, dtype=torch.int64, device=meta)
    with ByteCounter() as c:
        rows = pool[idx]
        rows.view(10, 8, 8).transpose(0, 1)
    assert c.total == 2 * 10 * 64 * 2 + 10 * 8
    with ByteCounter() as c:
        rows * 2
    assert c.total == 2 * 10 * 64 * 2
