"""Each built-in evictor against a small independent implementation (plain loops / numpy on a
few hand-checkable tensors): both must keep the same tokens (METHODS.md §2-7)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from kvflow_builtin.evictors.h2o import H2OEvictor
from kvflow_builtin.evictors.random import RandomEvictor
from kvflow_builtin.evictors.rkv import RKVEvictor
from kvflow_builtin.evictors.snapkv import SnapKVEvictor
from kvflow_builtin.evictors.streaming import StreamingEvictor
from kvflow_builtin.evictors.vase import VaSEEvictor


def kept_sets(keep: torch.Tensor) -> list[list[set[int]]]:
    return [[set(keep[r, h].tolist()) for h in range(keep.shape[1])] for r in range(keep.shape[0])]


def run_select(ev, keys, values, queries, lengths, n_protected=None, seeds=None, stats=None):
    rows = keys.shape[0]
    n_protected = torch.zeros(rows, dtype=torch.long) if n_protected is None else torch.as_tensor(n_protected)
    gens = [torch.Generator().manual_seed(s) for s in (seeds or range(rows))]
    keep = ev.select(keys, values, queries, layer_idx=0, lengths=torch.as_tensor(lengths), n_protected=n_protected,
                     generators=gens, stats=stats)
    return kept_sets(keep)


def top_k(scores, candidates, k):
    """Indices of the k best candidates (plain Python, ties -> earlier slot)."""
    return set(sorted(candidates, key=lambda j: (-scores[j], j))[:k])


def assert_same_keep(kept, must, scores, candidates, k, tol=1e-6):
    """`kept` is the reference's choice up to exact ties: the `must` slots, then k candidates
    none of which scores below an evicted one (max-pooling makes plateaus of equal scores,
    and which tied token survives is the topk implementation's choice, as in the references)."""
    chosen = kept - must
    assert must <= kept and len(chosen) == k and chosen <= set(candidates)
    evicted = set(candidates) - chosen
    if evicted:
        assert min(scores[j] for j in chosen) >= max(scores[j] for j in evicted) - tol
    strict = top_k(scores, candidates, k)
    boundary = sorted((scores[j] for j in candidates), reverse=True)[k - 1]
    assert {j for j in strict if scores[j] > boundary + tol} <= chosen


def softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def pool1d(x, kernel, kind):
    """stride 1, zero padding kernel // 2 (avg counts the padding, max ignores it: x >= 0)."""
    if kind == "none" or kernel == 1:
        return np.array(x, dtype=np.float64)
    h = kernel // 2
    padded = np.concatenate([np.zeros(h), x, np.zeros(h)])
    out = []
    for j in range(len(x)):
        win = padded[j: j + kernel]
        out.append(win.mean() if kind == "avg" else win.max())
    return np.array(out)


# --------------------------------------------------------------------------- streaming


def test_streaming_keeps_sinks_and_recent():
    ev = StreamingEvictor(StreamingEvictor.Params(budget=8, buffer=4, window=2, n_sink=3))
    keys = torch.randn(2, 2, 12, 4)
    sets = run_select(ev, keys, keys, None, [12, 10])
    assert sets[0] == [{0, 1, 2, 7, 8, 9, 10, 11}] * 2
    assert sets[1] == [{0, 1, 2, 5, 6, 7, 8, 9}] * 2
    prot = StreamingEvictor(StreamingEvictor.Params(budget=8, buffer=4, window=2, n_sink=3, protect_prompt=True))
    assert prot.n_protected(5) == 5
    sets = run_select(prot, keys, keys, None, [12, 12], n_protected=[5, 0])
    assert sets[0] == [{0, 1, 2, 3, 4, 9, 10, 11}] * 2 and sets[1] == [{0, 1, 2, 7, 8, 9, 10, 11}] * 2


# --------------------------------------------------------------------------- random


def test_random_keeps_top_uniform_draws_outside_window_and_prompt():
    ev = RandomEvictor(RandomEvictor.Params(budget=6, buffer=4, window=2))
    lengths, protected, seeds = [10, 8], [3, 0], [5, 9]
    keys = torch.zeros(2, 3, 10, 4)
    sets = run_select(ev, keys, keys, None, lengths, n_protected=protected, seeds=seeds)
    for r, (n, p, s) in enumerate(zip(lengths, protected, seeds)):
        draws = torch.rand(3, n, generator=torch.Generator().manual_seed(s)).tolist()
        for h in range(3):
            must = set(range(p)) | set(range(n - 2, n))
            cands = [j for j in range(n) if j not in must]
            assert sets[r][h] == must | top_k(draws[h], cands, 6 - len(must))


# --------------------------------------------------------------------------- snapkv / rkv importance


def ref_importance(K, Q, length, w, g, *, gqa, softmax_keys, pooling, kernel):
    """One row: K [kv, N, d], Q [q_heads, W, d] -> importance [kv][older tokens] by plain loops."""
    kv, _, d = K.shape
    older = length - w
    out = []
    for h in range(kv):
        per_head = []
        for j in range(g):
            heads = [h * g + j] if gqa == "mean" else None
            acc = np.zeros(older)
            for i in range(w):
                pos = older + i  # slot of query i
                ks = range(older) if softmax_keys == "older" else range(pos + 1)
                if gqa == "max":
                    logits = [max(float(np.dot(Q[hq, i], K[h, k])) for hq in range(h * g, h * g + g)) / math.sqrt(d)
                              for k in ks]
                else:
                    logits = [float(np.dot(Q[heads[0], i], K[h, k])) / math.sqrt(d) for k in ks]
                p = softmax(logits)
                acc += p[:older] / w
            per_head.append(pool1d(acc, kernel, pooling))
            if gqa == "max":
                break
        out.append(np.mean(per_head, axis=0))
    return out


def random_case(seed, rows=2, kv=2, g=2, n=16, d=8, w=3):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(rows, kv, n, d, generator=gen)
    values = torch.randn(rows, kv, n, d, generator=gen)
    queries = torch.randn(rows, kv * g, w, d, generator=gen) * 2
    return keys, values, queries


@pytest.mark.parametrize("variant", [
    dict(),  # default: R-KV's SnapKV (gqa max on raw logits, softmax over older, max-pool 7)
    dict(gqa="mean", softmax_keys="causal", pooling="avg", kernel=5),  # VaSE / Random Attention engine
])
def test_snapkv_matches_loops(variant):
    ev = SnapKVEvictor(SnapKVEvictor.Params(budget=8, buffer=8, window=3, **variant))
    p = ev.params
    keys, values, queries = random_case(1)
    lengths = [16, 13]
    sets = run_select(ev, keys, values, queries, lengths)
    for r, n in enumerate(lengths):
        imp = ref_importance(keys[r].double().numpy(), queries[r].double().numpy(), n, 3, 2, gqa=p.gqa,
                             softmax_keys=p.softmax_keys, pooling=p.pooling, kernel=p.kernel)
        for h in range(2):
            assert_same_keep(sets[r][h], set(range(n - 3, n)), imp[h], range(n - 3), 8 - 3)


def one_hot_case(logits_by_head, n=8, d=8):
    """Keys e_j·√d and one query per head whose dot with key j is logits_by_head[h][j]."""
    keys = torch.zeros(1, 1, n, d)
    for j in range(n):
        keys[0, 0, j, j] = math.sqrt(d)
    queries = torch.zeros(1, len(logits_by_head), 1, d)
    for h, logits in enumerate(logits_by_head):
        queries[0, h, 0, : len(logits)] = torch.tensor(logits)
    return keys, queries


def test_gqa_max_before_softmax_rule():
    """Hand-checkable: head A: t1=5, t2=4.5; head B: t2=4.5. Max over raw logits keeps t1
    (5 > 4.5); the mean of per-head softmaxes keeps t2 (0.31 vs 0.66)."""
    keys, queries = one_hot_case([[0, 5, 4.5], [0, 0, 4.5]])
    common = dict(budget=2, buffer=6, window=1, kernel=1, pooling="none")
    rkv = RKVEvictor(RKVEvictor.Params(mix_lambda=1.0, **common))
    assert run_select(rkv, keys, keys, queries, [8]) == [[{1, 7}]]
    snap_max = SnapKVEvictor(SnapKVEvictor.Params(**common))
    assert run_select(snap_max, keys, keys, queries, [8]) == [[{1, 7}]]
    snap_mean = SnapKVEvictor(SnapKVEvictor.Params(gqa="mean", **common))
    assert run_select(snap_mean, keys, keys, queries, [8]) == [[{2, 7}]]


# --------------------------------------------------------------------------- rkv


def ref_redundancy(K, length, threshold=0.5):
    """One row, one KV head: K [N, d] -> redundancy [length] (R-KV's cal_similarity, loops)."""
    k = K[:length] / (np.linalg.norm(K[:length], axis=-1, keepdims=True) + 1e-8)
    S = k @ k.T
    for i in range(length):
        S[i, i] = 0.0
    for i in range(length):
        twins = [j for j in range(length) if S[i, j] > threshold]
        S[i, max(twins) if twins else 0] = 0.0  # newest twin exempt (reference: index 0 when none)
    return softmax(S.mean(axis=0))


def ref_rkv_keep(K, Q, length, w, g, budget, lam, kernel=7):
    imp = ref_importance(K, Q, length, w, g, gqa="max", softmax_keys="older", pooling="max", kernel=kernel)
    out = []
    for h in range(K.shape[0]):
        red = ref_redundancy(K[h], length)[: length - w]
        score = lam * imp[h] - (1 - lam) * red
        out.append(top_k(score, range(length - w), budget - w) | set(range(length - w, length)))
    return out


@pytest.mark.parametrize("lam", [0.1, 0.5])
def test_rkv_matches_loops(lam):
    keys, values, queries = random_case(2, n=16, d=8)
    # plant near-duplicates so the exemption matters: copies of slot 1 at 4 and 9, of 2 at 6
    keys[:, :, 4] = keys[:, :, 1] * 1.5
    keys[:, :, 9] = keys[:, :, 1] + 0.05
    keys[:, :, 6] = keys[:, :, 2] * 0.7
    ev = RKVEvictor(RKVEvictor.Params(budget=8, buffer=8, window=3, mix_lambda=lam))
    lengths = [16, 14]
    sets = run_select(ev, keys, values, queries, lengths)
    for r, n in enumerate(lengths):
        expected = ref_rkv_keep(keys[r].double().numpy(), queries[r].double().numpy(), n, 3, 2, 8, lam)
        assert sets[r] == expected


def test_rkv_near_duplicate_exemption():
    """Three identical keys at slots 2, 4, 6 (others orthogonal), uniform attention: each copy's
    newest twin is exempt, so the column sums are 2, 1, 0 — the older copies are the most
    redundant and go first, the newest copy stays."""
    n, d = 10, 16
    keys = torch.zeros(1, 1, n, d)
    for j in range(n):
        keys[0, 0, j, j] = 1.0
    keys[0, 0, 4] = keys[0, 0, 2]
    keys[0, 0, 6] = keys[0, 0, 2]
    queries = torch.zeros(1, 1, 2, d)  # uniform attention: only redundancy decides
    red = ref_redundancy(keys[0, 0].double().numpy(), n)
    assert red[2] > red[4] > red[6] and red[6] == pytest.approx(red[3])  # newest copy: as if unique
    ev = RKVEvictor(RKVEvictor.Params(budget=8, buffer=2, window=2, mix_lambda=0.1))
    (kept,), = run_select(ev, keys, keys, queries, [n])
    assert kept == set(range(n)) - {2, 4}
    assert kept == ref_rkv_keep(keys[0].double().numpy(), queries[0].double().numpy(), n, 2, 1, 8, 0.1)[0]


# --------------------------------------------------------------------------- h2o


def test_h2o_accumulates_attention_and_keeps_heavy_hitters():
    """Drive observe() step by step (a 4-token prefill, then 1-token decode steps) and compare
    with plain loops: acc[j] += softmax over keys <= t of the query of token t, summed over the
    query heads of each KV head."""
    gen = torch.Generator().manual_seed(3)
    kv, g, d, n = 2, 2, 4, 12
    keys = torch.randn(1, kv, n, d, generator=gen)
    queries = torch.randn(1, kv * g, n, d, generator=gen) * 2
    ev = H2OEvictor(H2OEvictor.Params(budget=6, buffer=6, window=2))
    stats = torch.zeros(1, kv, n)
    scale = d ** -0.5
    chunks = [(0, 4)] + [(t, t + 1) for t in range(4, n)]
    for a, b in chunks:
        t = torch.arange(a, b)
        mask = torch.arange(b)[None, None, :] <= t[None, :, None]  # [1, T, span]
        ev.observe(stats[:, :, :b], queries[:, :, a:b], keys[:, :, :b], mask, layer_idx=0, scaling=scale)
    acc = np.zeros((kv, n))
    K, Q = keys[0].double().numpy(), queries[0].double().numpy()
    for t in range(n):
        for hq in range(kv * g):
            p = softmax([np.dot(Q[hq, t], K[hq // g, j]) * scale for j in range(t + 1)])
            acc[hq // g, : t + 1] += p
    np.testing.assert_allclose(stats[0].numpy(), acc, rtol=1e-5, atol=1e-6)
    (sets,) = run_select(ev, keys, keys, None, [n], stats=stats)
    for h in range(kv):
        assert sets[h] == top_k(acc[h], range(n - 2), 4) | {n - 2, n - 1}


# --------------------------------------------------------------------------- vase


def ref_vase_weights(K, Q, length, w, g, pooling="avg", kernel=5):
    """Attention signal of VaSE (defaults: per-head causal softmax, mean over W, avg-pool 5,
    group mean), one row: -> [kv][older tokens]."""
    return ref_importance(K, Q, length, w, g, gqa="mean", softmax_keys="causal", pooling=pooling, kernel=kernel)


def inclusion_probabilities(weights: dict[int, float], m: int) -> dict[int, float]:
    """Exact P(j in sample) for m draws without replacement, each ∝ weight among those left."""
    probs = {j: 0.0 for j in weights}
    for seq in itertools.permutations(weights, m):
        p, left = 1.0, sum(weights.values())
        for j in seq:
            p *= weights[j] / left
            left -= weights[j]
        for j in seq:
            probs[j] += p
    return probs


def vase_case(seed=4, n=14, d=8, w=2):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 1, n, d, generator=gen)
    queries = torch.randn(1, 2, w, d, generator=gen)
    # value ranges: slot j has range (j * 7) % 11 + 1 -> a known order, ties broken by slot
    values = torch.zeros(1, 1, n, d)
    for j in range(n):
        values[0, 0, j, 0] = float((j * 7) % 11 + 1)
    return keys, values, queries


@pytest.mark.parametrize("pooling", ["none", "avg"])
def test_vase_value_range_pick_and_sampling_distribution(pooling):
    n, w, budget, n_large, n_sink = 14, 2, 7, 3, 1
    kernel = 5 if pooling == "avg" else 1
    keys, values, queries = vase_case(n=n, w=w)
    ev = VaSEEvictor(VaSEEvictor.Params(budget=budget, buffer=n - budget, window=w, n_large=n_large, n_sink=n_sink,
                                        pooling=pooling, kernel=kernel))
    cands = list(range(n - w))
    rng = {j: (math.inf if j < n_sink else (j * 7) % 11 + 1) for j in cands}
    large = set(sorted(cands, key=lambda j: (-rng[j], j))[:n_large])
    assert large == {0, 3, 6}  # slot 0 (sink), then ranges 11 (j=3) and 10 (j=6)
    weights = ref_vase_weights(keys[0].double().numpy(), queries[0].double().numpy(), n, w, 2, pooling, kernel)[0]
    pool = {j: float(weights[j]) for j in cands if j not in large}
    m = budget - w - n_large  # 2 sampled
    exact = inclusion_probabilities(pool, m)
    draws = 3000
    rows = draws
    keep = ev.select(keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1),
                     queries.expand(rows, -1, -1, -1), layer_idx=0, lengths=torch.full((rows,), n),
                     n_protected=torch.zeros(rows, dtype=torch.long),
                     generators=[torch.Generator().manual_seed(s) for s in range(rows)])
    counts = {j: 0 for j in pool}
    pairs: dict[tuple, int] = {}
    for r in range(rows):
        kept = set(keep[r, 0].tolist())
        assert large | {n - 2, n - 1} <= kept and len(kept) == budget
        sampled = tuple(sorted(kept - large - {n - 2, n - 1}))
        assert len(sampled) == m
        pairs[sampled] = pairs.get(sampled, 0) + 1
        for j in sampled:
            counts[j] += 1
    for j in pool:  # inclusion frequency within 4.5 standard errors of the exact probability
        p = exact[j]
        se = math.sqrt(max(p * (1 - p), 1e-4) / draws)
        assert abs(counts[j] / draws - p) < 4.5 * se + 1e-3, (j, counts[j] / draws, p)
    # the whole distribution of kept pairs: chi-square against the exact pair probabilities
    chi2, dof = 0.0, 0
    for pair in itertools.combinations(sorted(pool), m):
        a, b = pair
        left = sum(pool.values())
        p = pool[a] / left * pool[b] / (left - pool[a]) + pool[b] / left * pool[a] / (left - pool[b])
        if p * draws >= 5:
            chi2 += (pairs.get(pair, 0) - p * draws) ** 2 / (p * draws)
            dof += 1
    assert dof >= 5 and chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)
    if pooling == "none":  # a sharp signal: uniform sampling would fail the checks above
        assert max(exact.values()) - min(exact.values()) > 0.2
        heavy, light = max(pool, key=pool.get), min(pool, key=pool.get)
        assert counts[heavy] > 2 * counts[light]


def test_vase_protected_prompt_shrinks_the_sampled_part():
    n, w = 14, 2
    keys, values, queries = vase_case(n=n, w=w)
    ev = VaSEEvictor(VaSEEvictor.Params(budget=8, buffer=6, window=w, n_large=2, n_sink=1, protect_prompt=True))
    for seed in range(20):
        (kept,), = run_select(ev, keys, values, queries, [n], n_protected=[4], seeds=[seed])
        assert {0, 1, 2, 3, 12, 13} <= kept and len(kept) == 8
        # K = 8 - 2 - 4 = 2 slots, both large: among the unprotected candidates 4..11 the
        # largest ranges are j=6 (10) and j=9 (9); nothing is left to sample
        assert kept == {0, 1, 2, 3, 6, 9, 12, 13}
