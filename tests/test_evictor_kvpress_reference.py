"""kvpress's score presses ported as kvflow evictors (knorm, keydiff, lagkv, tova, cur,
expected-attention), each against a small independent implementation in plain numpy loops on
hand-checkable tensors; and the `allocation` wrapper against the classes it replaces.

(tests/test_kvpress_golden.py checks the same evictors against kvpress's own outputs.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvflow.registry import get_registry


def make(kind: str, **params):
    cls = get_registry().get("evictors", kind)
    return cls(cls.Params(**params))


def select(ev, keys, values=None, queries=None, lengths=None, budget=None):
    rows = keys.shape[0]
    lengths = torch.as_tensor(lengths if lengths is not None else [keys.shape[2]] * rows)
    keep = ev.select(keys, keys if values is None else values, queries, layer_idx=0, lengths=lengths,
                     n_protected=torch.zeros(rows, dtype=torch.long),
                     generators=[torch.Generator().manual_seed(r) for r in range(rows)], budget=budget)
    return [[sorted(keep[r, h].tolist()) for h in range(keep.shape[1])] for r in range(rows)]


def top(scores, k, forced=()):
    """The reference's kept set: forced slots, then the best scores (ties -> earlier slot)."""
    rest = sorted((j for j in range(len(scores)) if j not in forced), key=lambda j: (-scores[j], j))
    return sorted(set(forced) | set(rest[: k - len(forced)]))


def padded(x, n):
    """[rows, heads, L, d] -> [rows, heads, n, d] with garbage in the padding: a row's score
    must never read past its length."""
    out = torch.full((x.shape[0], x.shape[1], n, x.shape[3]), 1e4)
    out[:, :, : x.shape[2]] = x
    return out


def test_knorm_keeps_the_smallest_key_norms():
    norms = [3.0, 1.0, 5.0, 0.5, 2.0, 4.0]  # slot j's key is norms[j] along one axis
    keys = torch.zeros(1, 1, 6, 4)
    keys[0, 0, :, 0] = torch.tensor(norms)
    # budget 4 with the newest (slot 5) forced: then the three smallest norms, slots 3, 1, 4
    assert select(make("knorm", budget=4, buffer=2, window=1), keys) == [[[1, 3, 4, 5]]]


def test_keydiff_keeps_keys_unlike_the_mean_direction():
    rng = np.random.default_rng(0)
    k = rng.normal(size=(2, 2, 9, 5)).astype(np.float32)
    k[:, :, :5] = k[:, :, :1] * np.array([1, 2, 3, 0.5, 4], dtype=np.float32)[None, None, :, None]  # one direction,
    k[:, :, :5] += 0.05 * rng.normal(size=(2, 2, 5, 5)).astype(np.float32)  # nearly: no exact ties
    lengths = [9, 7]
    keys = padded(torch.from_numpy(k), 9)
    keys[1, :, 7:] = 1e4  # row 1 is 7 long: its padding must not move its anchor
    kept = select(make("keydiff", budget=5, buffer=4, window=0), keys, lengths=lengths)
    for r, length in enumerate(lengths):
        for h in range(2):
            x = k[r, h, :length].astype(np.float64)
            unit = x / np.linalg.norm(x, axis=-1, keepdims=True)
            anchor = unit.mean(axis=0)
            cos = unit @ anchor / np.linalg.norm(anchor)
            assert kept[r][h] == top(list(-cos), 5), (r, h)
    # by hand: four keys along e1 (any length) and one along e2: the anchor leans to e1, so the
    # e2 key is the one kept first
    keys = torch.zeros(1, 1, 5, 3)
    keys[0, 0, [0, 1, 3, 4], 0] = torch.tensor([1.0, 5.0, 2.0, 0.5])
    keys[0, 0, 2, 1] = 3.0
    assert select(make("keydiff", budget=2, buffer=3, window=0), keys) == [[[0, 2]]]  # then the earliest tie


def ref_lagkv(k, v, n_sink, lag, cross):
    """LagKV's scores for one head: k, v [L, d] numpy."""
    length = k.shape[0]
    score = np.ones(length)
    if length < n_sink + 2 * lag:
        if length > n_sink:
            score[n_sink:] = np.arange(length - n_sink) / (length - n_sink)
        return score
    end = n_sink + (length - n_sink) // lag * lag
    parts = (end - n_sink) // lag
    total = np.zeros((parts - 1, lag))
    for x in (k, v):
        for p in range(parts - 1):
            cur = x[n_sink + p * lag : n_sink + (p + 1) * lag]
            ref = x[n_sink + (p + 1) * lag : n_sink + (p + 2) * lag]
            lo, hi = ref.min(axis=0), ref.max(axis=0)
            spread = ((cur - lo) / (hi - lo)).std(axis=-1, ddof=1)
            total[p] += np.exp(spread) / np.exp(spread).sum() / 2
    if not cross:
        total = np.argsort(np.argsort(total, axis=-1, kind="stable"), axis=-1, kind="stable") / lag
    score[n_sink : end - lag] = total.reshape(-1)
    return score


@pytest.mark.parametrize("cross", [False, True])
def test_lagkv_scores_each_partition_against_the_next(cross):
    rng = np.random.default_rng(1)
    k = rng.normal(size=(2, 2, 29, 4)).astype(np.float32)
    v = rng.normal(size=(2, 2, 29, 4)).astype(np.float32)
    lengths = [29, 23]  # row 0: sinks 4 + 4 partitions of 6 + 1 (3 scored); row 1: 4 + 3 x 6 + 1 (2 scored)
    ev = make("lagkv", budget=12, buffer=17, window=0, n_sink=4, lag_size=6, cross_scoring=cross)
    scores = ev.ranked_scores(padded(torch.from_numpy(k), 29), padded(torch.from_numpy(v), 29), None, layer_idx=0,
                              lengths=torch.tensor(lengths), n_protected=None, generators=[])
    kept = select(ev, padded(torch.from_numpy(k), 29), padded(torch.from_numpy(v), 29), lengths=lengths)
    for r, length in enumerate(lengths):
        for h in range(2):
            ref = ref_lagkv(k[r, h, :length], v[r, h, :length], 4, 6, cross)
            np.testing.assert_allclose(scores[r, h, :length].numpy(), ref, rtol=1e-5, atol=1e-6)
            assert kept[r][h] == top(list(ref), 12)


def test_lagkv_keeps_sinks_and_newest_until_two_lags_fit():
    keys = torch.randn(1, 1, 15, 4)
    kept = select(make("lagkv", budget=8, buffer=7, window=0, n_sink=4, lag_size=6), keys)
    assert kept == [[[0, 1, 2, 3, 11, 12, 13, 14]]]  # 15 < 4 + 2 x 6: sinks + the ramp's top = the newest


@pytest.mark.parametrize("heads", ["layer", "group"])
def test_tova_keeps_what_the_newest_query_attends_to(heads):
    rng = np.random.default_rng(2)
    k = rng.normal(size=(2, 2, 10, 4)).astype(np.float32)
    q = rng.normal(size=(2, 4, 1, 4)).astype(np.float32)  # g = 2
    lengths = [10, 8]
    kept = select(make("tova", budget=5, buffer=5, window=1, heads=heads), padded(torch.from_numpy(k), 10),
                  queries=torch.from_numpy(q), lengths=lengths)
    for r, length in enumerate(lengths):
        att = np.zeros((4, length))
        for qh in range(4):
            logits = k[r, qh // 2, :length] @ q[r, qh, 0] / 2.0  # sqrt(4)
            att[qh] = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        for h in range(2):
            s = att.mean(axis=0) if heads == "layer" else att[2 * h : 2 * h + 2].mean(axis=0)
            assert kept[r][h] == top(list(s), 5, forced=(length - 1,)), (r, h)
    if heads == "layer":
        assert all(kept[r][0] == kept[r][1] for r in range(2))  # the paper's rule: one token set per layer


@pytest.mark.parametrize("leverage", ["kv_product", "kv_avg", "key", "value"])
def test_cur_leverage_scores_with_local_blocks(leverage):
    rng = np.random.default_rng(3)
    k = rng.normal(size=(2, 1, 21, 4)).astype(np.float32)
    v = rng.normal(size=(2, 1, 21, 4)).astype(np.float32)
    lengths = [21, 13]
    ev = make("cur", budget=9, buffer=12, window=0, leverage_type=leverage, local_window_size=5, num_sinks=2)
    kept = select(ev, padded(torch.from_numpy(k), 21), padded(torch.from_numpy(v), 21), lengths=lengths)
    for r, length in enumerate(lengths):
        lev = {}
        for name, x in (("k", k), ("v", v)):
            sq = (x[r, 0, :length].astype(np.float64) ** 2).sum(axis=-1)
            lev[name] = np.concatenate([sq[i : i + 5] / sq[i : i + 5].sum() for i in range(0, length, 5)])
        s = {"kv_product": lev["k"] * lev["v"], "kv_avg": (lev["k"] + lev["v"]) / 2, "key": lev["k"],
             "value": lev["v"]}[leverage]
        s = s / s.sum()
        s[:2] = 1.0
        assert kept[r][0] == top(list(s), 9), r


def rope_matrix(pos: float, d: int, theta: float) -> np.ndarray:
    """The RoPE rotation of position `pos` as a [d, d] matrix (rotate_half layout)."""
    inv = theta ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(pos * inv), np.sin(pos * inv)
    m = np.zeros((d, d))
    half = d // 2
    for i in range(half):
        m[i, i], m[i, i + half] = c[i], -s[i]
        m[i + half, i + half], m[i + half, i] = c[i], s[i]
    return m


@pytest.mark.parametrize("covariance", [True, False])
def test_expected_attention_matches_pre_rope_statistics_at_the_true_positions(covariance):
    """The evictor sees post-RoPE queries only; the reference builds them from pre-RoPE queries
    at absolute positions and applies kvpress's formula with R̄ averaged over the future
    positions P..P+n-1 of the row (P = its length): the relative rotation must equal it."""
    rng = np.random.default_rng(4)
    d, theta, n_future, w = 8, 500.0, 16, 6
    lengths = [20, 14]
    q_pre = rng.normal(size=(2, 4, w, d))  # 4 query heads, 2 KV heads
    k = rng.normal(size=(2, 2, 20, d)).astype(np.float32)
    v = rng.normal(size=(2, 2, 20, d)).astype(np.float32)
    queries = np.zeros((2, 4, w, d), dtype=np.float32)
    for r, length in enumerate(lengths):
        for i in range(w):
            queries[r, :, i] = q_pre[r, :, i] @ rope_matrix(length - w + i, d, theta).T
    ev = make("expected-attention", budget=8, buffer=12, window=0, n_sink=2, n_queries=w, rope_theta=theta,
              n_future_positions=n_future, use_covariance=covariance)
    kept = select(ev, padded(torch.from_numpy(k), 20), padded(torch.from_numpy(v), 20),
                  queries=torch.from_numpy(queries), lengths=lengths)
    for r, length in enumerate(lengths):
        rbar = np.mean([rope_matrix(p, d, theta) for p in range(length, length + n_future)], axis=0)
        for h in range(2):
            probs = []
            for qh in (2 * h, 2 * h + 1):
                mu = q_pre[r, qh].mean(axis=0)
                cov = np.cov(q_pre[r, qh].T, bias=True)
                mu_f, cov_f = rbar @ mu, rbar @ cov @ rbar.T
                keys = k[r, h, 2:length].astype(np.float64)
                logits = keys @ mu_f / math.sqrt(d)
                if covariance:
                    logits += np.einsum("nd,de,ne->n", keys, cov_f, keys) / d / 2
                probs.append(np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum())
            s = np.mean(probs, axis=0) * np.linalg.norm(v[r, h, 2:length], axis=-1)
            s = np.concatenate([[s.max() + 1] * 2, s])
            assert kept[r][h] == top(list(s), 8), (r, h)


def test_expected_attention_refuses_without_rope_theta():
    ev = make("expected-attention", budget=8, buffer=8, window=0)
    with pytest.raises(ValueError, match="rope_theta"):
        select(ev, torch.randn(1, 1, 16, 4), queries=torch.randn(1, 1, 16, 4))


# --------------------------------------------------------------------------- allocation wrappers


def case(seed=0, rows=2, kv=2, g=2, n=30, d=8, w=8):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, kv, n, d, generator=gen), torch.randn(rows, kv, n, d, generator=gen),
            torch.randn(rows, kv * g, w, d, generator=gen))


def test_adakv_allocation_equals_the_ada_snapkv_class():
    keys, values, queries = case()
    lengths = [30, 25]
    a = select(make("ada-snapkv", budget=12, buffer=18, window=8, safeguard=0.25), keys, values, queries, lengths)
    b = select(make("snapkv", budget=12, buffer=18, window=8, allocation={"kind": "adakv", "safeguard": 0.25}),
               keys, values, queries, lengths)
    assert a == b


def test_pyramid_allocation_equals_the_pyramidkv_class():
    a = make("pyramidkv", budget=64, buffer=64, window=8, beta=10)
    b = make("snapkv", budget=64, buffer=64, window=8, allocation={"kind": "pyramid", "beta": 10})
    assert a.allocation(28) == b.allocation(28) and b.varies(28)
    assert a.layer_widths(28, 4) == b.layer_widths(28, 4)


def test_adakv_wraps_any_scorer_and_spends_the_layer_total():
    keys, values, _ = case(seed=5, n=30)
    ev = make("knorm", budget=12, buffer=18, window=2, allocation={"kind": "adakv", "safeguard": 0.25})
    keep = ev.select(keys, values, None, layer_idx=0, lengths=torch.tensor([30, 30]),
                     n_protected=torch.zeros(2, dtype=torch.long), generators=[])
    per_head = (keep >= 0).sum(dim=-1)  # [rows, kv_heads]
    assert per_head.sum(dim=-1).tolist() == [24, 24] and (per_head >= 3).all()  # floor int(0.25 x 12)
    # ranked across the heads of the layer: the kept set is the 24 smallest norms of the layer
    # (floor and window aside), so the heads with small norms keep more
    norms = keys.norm(dim=-1)
    for r in range(2):
        kept_norms = sorted(norms[r, h, j].item() for h in range(2) for j in keep[r, h].tolist() if j >= 0 and j < 28)
        dropped = [norms[r, h, j].item() for h in range(2) for j in range(28) if j not in keep[r, h].tolist()]
        assert max(kept_norms) <= min(dropped) + 1e-6 or per_head[r].min() == 3


def test_allocation_is_refused_where_it_cannot_apply():
    cls = get_registry().get("evictors", "none")
    with pytest.raises(ValueError, match="allocation"):
        cls.Params(allocation={"kind": "adakv"})
    snap = get_registry().get("evictors", "snapkv")
    with pytest.raises(ValueError, match="quantize"):
        snap.Params(allocation={"kind": "adakv"}, quantize={"bits": 4})
    with pytest.raises(ValueError):
        snap.Params(allocation={"kind": "heads"})  # unknown wrapper kind


# --------------------------------------------------------------------------- expected-attention's RoPE base


@pytest.mark.parametrize("config, theta", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 1e6),  # transformers 5
    ({"rope_theta": 5e5}, 5e5),  # transformers 4
    ({"rope_theta": 1e4, "rope_scaling": {"type": "yarn", "factor": 4}}, None),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, None),
    ({"rope_theta": 1e4, "partial_rotary_factor": 0.5}, None),
    ({}, None),
])
def test_the_rope_base_is_read_only_for_plain_rope(config, theta):
    from kvflow.models.shapes import rope_of

    got, why = rope_of(config)
    assert got == theta and (bool(why) == (theta is None))


def test_a_run_reads_the_rope_base_from_the_model_and_refuses_other_ropes(tmp_path):
    import json

    from kvflow.config.validate import load_pipeline
    from kvflow.errors import UserError
    from kvflow.runtime.compile import resolve_rope_theta
    from kvflow.testing.pipelines import tiny_model_dir, tiny_pipeline

    path = tiny_pipeline(tmp_path, evictor={"kind": "expected-attention", "budget": 16, "buffer": 8, "window": 2},
                         helper=False)
    loaded = load_pipeline(path)
    model_id = loaded.pipeline.models[loaded.pipeline.proposers["base"].model].id
    params = loaded.components.proposers["base"].evictor.params
    assert params.rope_theta is None and resolve_rope_theta(loaded, "base", params, model_id).rope_theta == 10000.0
    yarn = tmp_path / "yarn"
    yarn.mkdir()
    config = json.loads((tiny_model_dir(tmp_path / "models") / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (yarn / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as e:
        resolve_rope_theta(loaded, "base", params, str(yarn))
    assert "proposers.base.evictor.rope_theta" in e.value.format() and "yarn" in e.value.format()


def test_kvflow_run_with_expected_attention_and_a_wrapped_scorer(tmp_path):
    """The real `kvflow run` path: rope_theta is resolved at start (no run would compact
    otherwise), and a scorer under a wrapper runs as it validates."""
    import json

    from conftest import run_kvflow
    from kvflow.testing.pipelines import tiny_pipeline

    for name, evictor in (("ea", {"kind": "expected-attention", "budget": 12, "buffer": 6, "window": 2}),
                          ("kd", {"kind": "keydiff", "budget": 12, "buffer": 6, "window": 2,
                                  "allocation": {"kind": "adakv"}})):
        path = tiny_pipeline(tmp_path / name, evictor=evictor, helper=False, max_tokens=40, name=name)
        r = run_kvflow("run", str(path), "--set", f"run.output={tmp_path / name / 'out'}")
        assert r.returncode == 0, r.stderr
        (run,) = (tmp_path / name / "out").iterdir()
        records = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
        assert len(records) == 2 and all(rec["tokens_generated"]["base"] >= 30 for rec in records)
