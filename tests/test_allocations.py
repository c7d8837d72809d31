"""Budgets that vary by layer and head (kvflow.components.allocation; pyramidkv, ada-snapkv):
hand-checked allocations, a loop reference of Ada-SnapKV, and the cache's per-head masking,
memory accounting and refusals."""

from __future__ import annotations

import pytest
import torch

from kvflow.components.allocation import adaptive_keep, pyramid_budgets
from kvflow.kv_memory import layout
from kvflow.testing.evictor_contract import PROMPTS, decode
from kvflow.testing.models import tiny_runner
from kvflow.testing.composed import AdaH2O, PyramidH2O
from kvflow_builtin.evictors.ada_snapkv import AdaSnapKVEvictor
from kvflow_builtin.evictors.pyramidkv import PyramidKVEvictor
from kvflow_builtin.evictors.snapkv import SnapKVEvictor
from test_evictor_reference import random_case, ref_importance

INF = float("inf")


# --------------------------------------------------------------------------- PyramidKV budgets


def test_pyramid_budgets_by_hand():
    # B = 10, W = 2, beta = 4: min = 8 / 4 = 2, max = 16 - 2 = 14, step 4 -> 2 + [14, 10, 6, 2]
    assert pyramid_budgets(10, 2, 4, 4.0, held=100) == [16, 12, 8, 4]
    # beta = 3: 2 + [13.33, 8, 2.67] = [15.33, 10, 4.67]: floors 29, the one left over to 4.67
    assert pyramid_budgets(10, 2, 3, 3.0, held=100) == [15, 10, 5]
    # held = 15: max (15.6) would exceed held - W = 13, so max = 13 and min = 16 - 13 = 3
    assert pyramid_budgets(10, 2, 2, 20.0, held=15) == [15, 5]
    assert pyramid_budgets(10, 2, 1, 20.0, held=15) == [10]


@pytest.mark.parametrize("layers", [2, 7, 28, 36])
@pytest.mark.parametrize("budget,window,buffer", [(64, 16, 64), (64, 8, 128), (33, 4, 16), (512, 8, 128)])
def test_pyramid_totals_and_order(layers, budget, window, buffer):
    ev = PyramidKVEvictor(PyramidKVEvictor.Params(budget=budget, window=window, buffer=buffer))
    got = ev.allocation(layers)  # checks the total and the per-layer bounds itself
    assert sum(got) == budget * layers
    assert got == sorted(got, reverse=True), "lower layers keep at least as many tokens as higher ones"


def test_allocation_refuses_an_impossible_layer_budget():
    class Lopsided(PyramidKVEvictor):
        def layer_budgets(self, num_layers):
            return [1] + [self.params.budget] * (num_layers - 2) + [2 * self.params.budget - 1]

    ev = Lopsided(Lopsided.Params(budget=10, buffer=5, window=2))
    with pytest.raises(ValueError, match="more than the window"):
        ev.allocation(3)


# --------------------------------------------------------------------------- Ada-KV selection


def heads(*rows):
    return torch.tensor([rows], dtype=torch.float32)  # [1, heads, N]


def test_adaptive_keep_by_hand():
    # head 0 holds 6 tokens, head 1 only 4 (its slots 4, 5 are padding); the last of each is the window
    scores = heads([0.9, 0.8, 0.7, 0.1, 0.0, INF], [0.05, 0.6, 0.01, INF, -INF, -INF])
    # floor 1: each keeps its window; the other 4 of 6 go to the best scores of the layer: .9 .8 .7 .6
    keep = adaptive_keep(scores, total=6, capacity=5, floor=1)
    assert keep.tolist() == [[[0, 1, 2, 5, -1], [1, 3, -1, -1, -1]]]
    # capacity 3: head 0 stops at 3 tokens, so head 1 takes .05 as well
    assert adaptive_keep(scores, total=6, capacity=3, floor=1).tolist() == [[[0, 1, 5], [0, 1, 3]]]
    # floor 3: each head keeps its own top 3 and nothing is left to share
    assert adaptive_keep(scores, total=6, capacity=5, floor=3).tolist() == [[[0, 1, 5, -1, -1], [0, 1, 3, -1, -1]]]


def test_adaptive_keep_ties_go_to_the_lower_head_then_the_earlier_slot():
    scores = heads([0.5, 0.5, 0.5, INF], [0.5, 0.5, 0.5, INF])
    keep = adaptive_keep(scores, total=5, capacity=4, floor=0)
    assert keep.tolist() == [[[0, 1, 2, 3], [3, -1, -1, -1]]]


def ref_ada_snapkv(imp, length, window, budget, kv, floor, cap):
    """Plain Python Ada-SnapKV for one row: per head the window, its top max(floor, W) slots,
    then the layer's best remaining (score, lower head, earlier slot), up to `cap` per head."""
    kept = [set(range(length - window, length)) for _ in range(kv)]
    for h in range(kv):
        order = sorted(range(length - window), key=lambda j: (-imp[h][j], j))
        kept[h] |= set(order[: max(0, max(floor, window) - window)])
    pool = sorted(((imp[h][j], h, j) for h in range(kv) for j in range(length - window) if j not in kept[h]),
                  key=lambda x: (-x[0], x[1], x[2]))
    left = kv * budget - sum(len(k) for k in kept)
    for _, h, j in pool:
        if left == 0:
            break
        if len(kept[h]) < cap:
            kept[h].add(j)
            left -= 1
    return kept


def test_ada_snapkv_matches_loops():
    ev = AdaSnapKVEvictor(AdaSnapKVEvictor.Params(budget=6, buffer=10, window=3, safeguard=0.5))
    keys, values, queries = random_case(4)
    lengths = [16, 13]
    gens = [torch.Generator().manual_seed(s) for s in range(2)]
    keep = ev.select(keys, values, queries, layer_idx=0, lengths=torch.tensor(lengths),
                     n_protected=torch.zeros(2, dtype=torch.long), generators=gens)
    cap = ev.head_capacity(6, 2)
    assert cap == 2 * 6 - 3 and keep.shape == (2, 2, cap)
    p = ev.params
    for r, n in enumerate(lengths):
        imp = ref_importance(keys[r].double().numpy(), queries[r].double().numpy(), n, 3, 2, gqa=p.gqa,
                             softmax_keys=p.softmax_keys, pooling=p.pooling, kernel=p.kernel)
        want = ref_ada_snapkv(imp, n, 3, 6, 2, floor=3, cap=cap)
        got = [set(x for x in keep[r, h].tolist() if x >= 0) for h in range(2)]
        assert got == want
    counts = (keep >= 0).sum(-1)
    assert (counts.sum(-1) == 12).all() and len(set(counts.flatten().tolist())) > 1, "the heads should differ"


def test_adaptive_evictors_score_each_head_over_its_own_length():
    """After an adaptive compaction the heads hold different lengths: each head is scored on
    its own valid slots (its window is its own newest tokens; a shorter head's stale slots
    are never kept), exactly as that head alone would be."""
    ev = AdaSnapKVEvictor(AdaSnapKVEvictor.Params(budget=6, buffer=10, window=3))
    keys, values, queries = random_case(5, rows=1)
    head_lengths = torch.tensor([[16, 11]])
    keys[0, 1, 11:] = 1e3  # stale slots past head 1's length
    keep = ev.select(keys, values, queries, layer_idx=0, lengths=torch.tensor([16]),
                     n_protected=torch.zeros(1, dtype=torch.long), generators=[torch.Generator()],
                     head_lengths=head_lengths)
    got = [set(x for x in keep[0, h].tolist() if x >= 0) for h in range(2)]
    assert {13, 14, 15} <= got[0] and {8, 9, 10} <= got[1]
    assert max(got[1]) < 11
    p = ev.params
    for h, n in enumerate((16, 11)):  # each head's scores are SnapKV's over that head alone
        plain = SnapKVEvictor(SnapKVEvictor.Params(budget=6, buffer=10, window=3))
        alone = plain.score(keys[:, h : h + 1], values[:, h : h + 1], queries[:, 2 * h : 2 * h + 2], layer_idx=0,
                            lengths=torch.tensor([n]), n_protected=torch.zeros(1, dtype=torch.long),
                            generators=[torch.Generator()])
        imp = ref_importance(keys[0, h : h + 1].double().numpy(), queries[0, 2 * h : 2 * h + 2].double().numpy(), n,
                             3, 2, gqa=p.gqa, softmax_keys=p.softmax_keys, pooling=p.pooling, kernel=p.kernel)
        torch.testing.assert_close(alone[0, 0, : n - 3].double(), torch.tensor(imp[0]), rtol=1e-5, atol=1e-6)


def test_any_scorer_composes_with_adaptive_heads():
    """A plugin's scorer that knows nothing of per-head lengths gets a row's own valid slots:
    R-KV with the AdaptiveHeads mixin keeps the window of every head and no stale slot."""
    from kvflow.components.allocation import AdaptiveHeads, AdaptiveParams
    from kvflow_builtin.evictors.rkv import RKVEvictor, RKVParams

    class AdaRKVParams(AdaptiveParams, RKVParams):
        pass

    class AdaRKV(AdaptiveHeads, RKVEvictor):
        Params = AdaRKVParams

    ev = AdaRKV(AdaRKV.Params(budget=6, buffer=10, window=3))
    keys, values, queries = random_case(6, rows=1)
    keys[0, 0, 9:] = 1e3
    keep = ev.select(keys, values, queries, layer_idx=0, lengths=torch.tensor([16]),
                     n_protected=torch.zeros(1, dtype=torch.long), generators=[torch.Generator()],
                     head_lengths=torch.tensor([[9, 16]]))
    got = [set(x for x in keep[0, h].tolist() if x >= 0) for h in range(2)]
    assert {6, 7, 8} <= got[0] and max(got[0]) < 9 and {13, 14, 15} <= got[1]
    assert len(got[0]) + len(got[1]) == 12
    runner = tiny_runner("llama")
    batch_tokens, _ = decode(runner, ev, PROMPTS, 24)
    for r, prompt in enumerate(PROMPTS):
        alone, _ = decode(runner, ev, [prompt], 24, seeds=[[11, 22, 33][r]])
        assert alone[0] == batch_tokens[r]


# --------------------------------------------------------------------------- the hf cache


def test_holes_are_masked_out_of_attention():
    """Garbage written into each head's hole (slots it evicted, below the layer's longest head)
    must not change the next logits; it does when the mask lets the hole through."""
    runner = tiny_runner("qwen2")
    ev = AdaSnapKVEvictor(AdaSnapKVEvictor.Params(budget=10, buffer=5, window=2))
    _, cache = decode(runner, ev, PROMPTS, 12)
    r = cache.rows
    assert (r.hole_end[:, :, None] > r.hole_start).any(), "the scenario should leave holes"
    pending = torch.tensor([[5], [6], [7]])
    clean = runner.forward(cache.select([0, 1, 2]), pending)
    dirty_cache = cache.select([0, 1, 2])
    for i, layer in enumerate(dirty_cache.layers):
        for row in range(3):
            for h in range(layer.keys.shape[1]):
                a, b = int(r.hole_start[row, i, h]), int(r.hole_end[row, i])
                layer.keys[row, h, a:b] = 1e4
                layer.values[row, h, a:b] = -1e4
    torch.testing.assert_close(runner.forward(dirty_cache, pending), clean)


def test_pyramid_layers_hold_their_own_budgets():
    runner = tiny_runner("llama")
    ev = PyramidKVEvictor(PyramidKVEvictor.Params(budget=10, buffer=5, window=2, beta=4))
    _, cache = decode(runner, ev, PROMPTS, 24)
    budgets = ev.allocation(runner.num_layers)
    assert budgets[0] > budgets[-1]
    appended = cache.rows.lengths - 10
    for i, b in enumerate(budgets):
        assert (cache.head_lengths(i) == (appended + b)[:, None]).all()


@pytest.mark.parametrize("cls", [PyramidKVEvictor, AdaSnapKVEvictor, SnapKVEvictor])
def test_kv_memory_is_what_the_cache_allocates(cls):
    runner = tiny_runner("qwen2")
    ev = cls(cls.Params(budget=10, buffer=5, window=2))
    _, cache = decode(runner, ev, PROMPTS, 12)
    layers, kv_heads, head_dim, elem = runner.kv_shape()
    lay = layout(ev.params, layers, kv_heads, head_dim, elem, evictor=ev)
    assert cache.resident_bytes() == lay.peak_bytes * cache.n_rows
    assert lay.kept_bytes == layers * kv_heads * 10 * 2 * head_dim * elem  # the same total kept


def test_budget_bytes_composes():
    p = PyramidKVEvictor.Params(budget_bytes=4096, buffer=8, window=2)
    ev = PyramidKVEvictor(p.with_budget(12))
    assert sum(ev.allocation(4)) == 48


QUANT = {"bits": 8, "group_size": 8, "residual": 4}


def test_pyramid_with_quantize_splits_each_layer_and_decodes_as_unquantized_at_8_bits():
    """Each layer quantizes the whole key groups of its own budget; at 8 bits the tokens are
    those of the unquantized cache; batched == alone; the accounting is the allocation."""
    runner = tiny_runner("qwen2")
    P = PyramidKVEvictor.Params
    ev = PyramidKVEvictor(P(budget=40, buffer=16, window=2, quantize=QUANT))
    budgets = ev.allocation(runner.num_layers)
    assert budgets == [56, 24]
    tokens, cache = decode(runner, ev, PROMPTS, 60)
    assert (cache.rows.compactions > 0).all()
    assert cache.rows.n_quantized.tolist() == [[48, 16]] * 3  # (56 - 4) // 8 * 8, (24 - 4) // 8 * 8
    plain_tokens, _ = decode(runner, PyramidKVEvictor(P(budget=40, buffer=16, window=2)), PROMPTS, 60)
    assert tokens == plain_tokens
    layers, kv_heads, head_dim, elem = runner.kv_shape()
    lay = layout(ev.params, layers, kv_heads, head_dim, elem, evictor=ev)
    assert cache.resident_bytes() == lay.peak_bytes * cache.n_rows
    assert lay.layer_budgets == (56, 24)
    for r, prompt in enumerate(PROMPTS):
        alone, _ = decode(runner, ev, [prompt], 60, seeds=[[11, 22, 33][r]])
        assert alone[0] == tokens[r]


def test_budget_bytes_with_quantize_counts_each_layer_split():
    from kvflow.kv_memory import budget_for_bytes

    layers, kv_heads, head_dim, elem = 4, 2, 64, 2
    p = PyramidKVEvictor.Params(budget_bytes=200_000, buffer=32, window=2, quantize={"bits": 2, "group_size": 16})
    budget = budget_for_bytes(p, layers, kv_heads, head_dim, elem, evictor_cls=PyramidKVEvictor)
    fits = lambda b: layout(p, layers, kv_heads, head_dim, elem, budget=b,  # noqa: E731
                            evictor=PyramidKVEvictor(p.with_budget(b))).kept_bytes
    assert fits(budget) <= 200_000 < fits(budget + 1)
    plain = budget_for_bytes(p.model_copy(update={"quantize": None}), layers, kv_heads, head_dim, elem)
    assert budget > 2 * plain  # 2-bit codes buy more tokens than full precision


def test_quantize_with_head_budgets_is_refused_with_the_field(cli):
    out = cli("validate", "pipelines/quickstart.yaml", "--set",
              "proposers.base.evictor={kind: ada-snapkv, budget: 64, quantize: {bits: 4}}")
    assert out.exit_code == 2, out.output
    assert "proposers.base.evictor" in out.output and "quantize does not combine" in out.output
    assert "Traceback" not in out.output


@pytest.mark.parametrize("cls", [AdaH2O, PyramidH2O])
def test_an_observing_evictor_composes_with_both_allocations(cls):
    """H2O's statistic moves with each head's kept tokens and never counts a hole: batched ==
    alone, totals exact, and the statistic of a hole slot stays zero."""
    runner = tiny_runner("qwen2")
    ev = cls(cls.Params(budget=10, buffer=5, window=2))
    tokens, cache = decode(runner, ev, PROMPTS, 24)
    for i, b in enumerate(ev.allocation(runner.num_layers)):
        kept = cache.head_lengths(i) - (cache.rows.lengths - 10)[:, None]
        assert (kept.sum(-1) == 2 * b).all()
        stats, r = cache.layers[i].stats, cache.rows
        for row in range(cache.n_rows):
            for h in range(2):
                assert not stats[row, h, int(r.hole_start[row, i, h]):int(r.hole_end[row, i])].any()
    for row, prompt in enumerate(PROMPTS):
        alone, _ = decode(runner, ev, [prompt], 24, seeds=[[11, 22, 33][row]])
        assert alone[0] == tokens[row]


@pytest.mark.parametrize("cls", [AdaH2O, PyramidH2O])
def test_an_observing_evictor_with_a_varying_allocation_on_sglang_equals_hf(cls, tmp_path):
    """Same tokens, log-probabilities and kept keys as hf; and in the scheduler's snapshot the
    statistic of every hole slot is zero (the hole is masked out of what H2O observes)."""
    from kvflow.testing.engine_parity import assert_same_as_hf, greedy_steps, load_engine

    ev = cls(cls.Params(budget=16, buffer=8, window=4))
    assert_same_as_hf("sglang", ev, tmp_path)
    engine = load_engine("sglang")
    engine.dump_dir = str(tmp_path)
    try:
        _, state = greedy_steps(engine, ev)
    finally:
        engine.dump_dir = None
    snap = torch.load(tmp_path / f"{state.snap}.pt")
    holes, end = snap["holes"], snap["base"] + 16
    assert holes is not None
    if cls is PyramidH2O:  # every layer but the first has a hole (Ada-KV's heads may end up even)
        assert (holes < end).any(), "the scenario should leave holes"
    for layer in range(holes.shape[0]):
        for h in range(holes.shape[1]):
            assert not snap["stats"][layer, h, int(holes[layer, h]):end].any()
    engine.release([state])



def test_an_allocation_the_model_cannot_hold_is_refused_before_anything_is_written(tmp_path, cli):
    """PyramidKV at budget 20 with a 16-token window: the tiny model's second layer would keep
    only its window. Refused once the model's layer count is known, naming the field."""
    from kvflow.testing import tiny_pipeline

    path = tiny_pipeline(tmp_path, problems=1, evictor={"kind": "pyramidkv", "budget": 20, "buffer": 4,
                                                        "window": 16})
    result = cli("run", path)
    assert result.exit_code == 2, result.output
    assert "proposers.base.evictor" in result.output and "more than the window" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "results").exists()
    explained = cli("explain", path)
    assert explained.exit_code == 0 and "do not work" in explained.output


def test_a_run_with_budget_bytes_and_pyramid_budgets_records_its_allocation(tmp_path, cli):
    """`kvflow run` with PyramidKV given in bytes and quantized: the manifest's kv_memory has
    the token budget the bytes bought, the per-layer budgets, and bytes within the target."""
    import json

    from kvflow.testing import tiny_pipeline

    evictor = {"kind": "pyramidkv", "budget_bytes": 12_000, "buffer": 16, "window": 2,
               "quantize": {"bits": 4, "group_size": 8, "residual": 4}}
    result = cli("run", tiny_pipeline(tmp_path, problems=1, evictor=evictor))
    assert result.exit_code == 0, result.output
    (run_dir,) = (tmp_path / "results").iterdir()
    mem = json.loads((run_dir / "manifest.json").read_text())["kv_memory"]["base"]
    assert mem["kept_bytes"] <= 12_000 and len(mem["layer_budgets"]) == 2
    assert sum(mem["layer_budgets"]) == 2 * mem["budget"] and mem["layer_budgets"][0] > mem["layer_budgets"][1]
