"""kvflow's evictors keep the tokens NVIDIA kvpress's presses keep, on kvpress's own outputs.

tests/data/kvpress_golden.pt was written by bench/kvpress/record_kept.py in kvpress's own
environment (kvpress 0.5.5, transformers 5.2: it cannot share kvflow's): for GQA with 2 and
3 KV heads and MHA, float32 and bfloat16, three lengths, each press's kept slots at three
compression ratios (and AdaKVPress's kept (head, token) pairs around three of them), on the
keys, values and post-RoPE queries a seeded Llama attention layer
made at positions 0..N-1 (kvpress's prefill). Here each press's kvflow evictor
(docs/components.md, "kvpress presses in kvflow") gets the same tensors, with `window: 0` (kvpress
keeps nothing by force) and the budget kvpress keeps, and must keep the same slots per KV head.

Exact ties excepted, and counted: a slot kvpress keeps and kvflow does not (or the reverse) is
allowed only when kvflow's own scores put it level with kvflow's last kept slot, to within
the rounding of the case's dtype (kvpress computes in the cache's dtype, kvflow in float32
or float64, and torch.topk breaks exact ties by no fixed rule). The counts are asserted small.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.registry import get_registry

GOLDEN = Path(__file__).parent / "data" / "kvpress_golden.pt"
DATA = torch.load(GOLDEN, weights_only=True)
#: relative score gap under which two slots count as level (the rounding of the dtype kvpress computed in)
LEVEL = {"float32": 1e-5, "bfloat16": 2**-7}
#: at most this share of kept slots may differ by level (not exactly tied) swaps
MAX_LEVEL_SWAPS = {"float32": 0.005, "bfloat16": 0.05}


def evictor_for(press: str, params: dict, n: int, n_kept: int, rope_theta: float):
    """The kvflow evictor a press maps to, at kvpress's kept count, and the queries it reads
    (a slice of the post-RoPE queries of positions 0..N-1)."""
    # kvpress parameters that kvflow's evictor takes under the same name and meaning
    same = {k: v for k, v in params.items() if k in ("n_sink", "lag_size", "cross_scoring", "leverage_type",
                                                    "local_window_size", "n_future_positions", "use_covariance",
                                                    "use_vnorm")}
    wrapper = {}
    if press.startswith("adakv-"):  # AdaKVPress(press=...): kvflow's allocation wrapper around the same scorer
        press = press.removeprefix("adakv-")
        wrapper = {"allocation": {"kind": "adakv", "safeguard": params["alpha_safeguard"]}}
        params = {k: v for k, v in params.items() if k != "alpha_safeguard"}
    base = press.split("-")[0]
    kind, extra, queries = {
        "knorm": ("knorm", {}, None),
        "keydiff": ("keydiff", {}, None),
        "lagkv": ("lagkv", same, None),
        "tova": ("tova", {"heads": "layer", "window": 1}, slice(n - 1, n)),  # kvpress re-adds the newest on top
        "cur": ("cur", same, None),
        # statistics of the queries after the sinks (kvpress drops the first n_sink hidden states)
        "expected_attention": ("expected-attention", {**same, "n_queries": n - params["n_sink"] if "n_sink" in params
                                                      else n, "rope_theta": rope_theta}, slice(4, n)),
        # kvpress's SnapKVPress: kvflow's snapkv in its SnapKV (VaSE engine) flavour; the window is kept
        "snapkv": ("snapkv", {"window": params.get("window_size", 8), "gqa": "mean", "softmax_keys": "causal",
                              "pooling": "avg", "kernel": params.get("kernel_size", 5)}, slice(n - 8, n)),
        "streaming_llm": ("streaming", same, None),
    }[base]
    cls = get_registry().get("evictors", kind)
    params = {"budget": n_kept, "buffer": n, "window": 0, **extra, **wrapper}
    if params["window"] >= n_kept:
        return None, None  # kvflow keeps the window inside the budget (kvpress then keeps part of its window)
    return cls(cls.Params(**params)), queries


def compare(case: dict, press: str, ratio: str) -> dict:
    """Counts for one press on one case: slots compared, exact ties, level swaps, [unexplained]."""
    rec = case["presses"][press]
    n, kv_heads = case["n"], case["kv_heads"]
    keys, values, all_queries = case["keys"][None], case["values"][None], case["queries"][None]
    kept_ref = rec["kept"][ratio]
    n_kept = sum(len(h) for h in kept_ref) // kv_heads  # per head; AdaKV's heads keep different counts
    ev, window = evictor_for(press, rec["params"], n, n_kept, DATA["rope_theta"])
    out = {"compared": 0, "exact_ties": 0, "level": 0, "bad": []}
    if ev is None:
        return out
    queries = all_queries[:, :, window] if window is not None else None
    lengths, none = torch.tensor([n]), torch.zeros(1, dtype=torch.long)
    gens = [torch.Generator().manual_seed(0)]
    keep = ev.select(keys, values, queries, layer_idx=0, lengths=lengths, n_protected=none, generators=gens)[0]
    ours_all = ev.ranked_scores(keys, values, queries, layer_idx=0, lengths=lengths, n_protected=none,
                                generators=gens)[0].double()
    theirs_all = rec["scores"][ratio].double()
    forced = n - ev.params.window  # kvflow keeps slots >= forced whatever their scores
    out["compared"] = n_kept * kv_heads
    if ev.adaptive_heads:  # ranked across the heads of the layer: a swap pairs slots of any two heads
        return compare_across_heads(out, case, keep, kept_ref, ours_all, theirs_all)
    for h in range(kv_heads):
        ours, theirs = set(keep[h].tolist()), set(kept_ref[h])
        for j in sorted(ours ^ theirs):
            level = []
            for s, kept in ((ours_all[h], ours), (theirs_all[h], theirs)):
                last = min(s[i].item() for i in kept if i < forced)  # the lowest score kept on merit
                scale = s[:forced].abs().max().item() or 1.0
                level.append(abs(s[j].item() - last) / scale)
            if press == "lagkv" and min(level) > 0.0:  # ranks within a partition: compare the spreads they rank
                level.append(rank_gap(ev, keys, values, lengths, h, j))
            if min(level) == 0.0:
                out["exact_ties"] += 1  # a tie in kvflow's or kvpress's own arithmetic: either may be kept
            elif min(level) <= LEVEL[case["dtype"]]:
                out["level"] += 1  # level to within the dtype's rounding in one of the two
            else:
                out["bad"].append((h, j, "kvflow only" if j in ours else "kvpress only", level))
    return out


def compare_across_heads(out, case, keep, kept_ref, ours_all, theirs_all) -> dict:
    """AdaKV: the (head, slot) pairs kept by one side only must pair up, each kvflow-only pair
    with a kvpress-only one level with it in kvflow's or kvpress's scores (within the dtype's
    rounding of the layer's largest score)."""
    heads = len(kept_ref)
    ours = {(h, j) for h in range(heads) for j in keep[h].tolist() if j >= 0}
    theirs = {(h, j) for h in range(heads) for j in kept_ref[h]}
    only_ours, only_theirs = sorted(ours - theirs), sorted(theirs - ours)
    scales = [s.abs().max().item() or 1.0 for s in (ours_all, theirs_all)]
    for a in only_ours:
        gaps = [min(abs(s[a].item() - s[b].item()) / scale for s, scale in zip((ours_all, theirs_all), scales))
                for b in only_theirs]
        if len(only_ours) != len(only_theirs) or min(gaps) > LEVEL[case["dtype"]]:
            out["bad"].append((a, "kvflow only", min(gaps, default=None)))
        elif min(gaps) == 0.0:
            out["exact_ties"] += 2
        else:
            out["level"] += 2
    return out


def rank_gap(ev, keys, values, lengths, h: int, j: int) -> float:
    """LagKV ranks tokens within a partition by a softmaxed spread; kvpress computes the spread
    in the cache's dtype, so two close spreads may rank the other way: the relative gap between
    slot j's spread and its nearest neighbour in its partition (kvflow's float32 spreads)."""
    p = ev.params
    cross = type(ev)(p.model_copy(update={"cross_scoring": True}))
    spread = cross.ranked_scores(keys, values, None, layer_idx=0, lengths=lengths, n_protected=None,
                                 generators=[])[0, h].double()
    start = p.n_sink + (j - p.n_sink) // p.lag_size * p.lag_size
    part = spread[start : start + p.lag_size]
    others = torch.cat([part[: j - start], part[j - start + 1 :]])
    return ((others - spread[j]).abs().min() / part.abs().max()).item()


PRESSES = sorted(DATA["cases"][0]["presses"])


@pytest.mark.parametrize("press", PRESSES)
def test_kvflow_keeps_what_kvpress_keeps(press):
    total = {"float32": [0, 0, 0], "bfloat16": [0, 0, 0]}
    for case in DATA["cases"]:
        for ratio in case["presses"][press]["kept"]:
            out = compare(case, press, ratio)
            where = f"{press} on {case['layout']} {case['dtype']} N={case['n']} ratio {ratio}"
            assert not out["bad"], (f"{where}: kvflow and kvpress keep different slots "
                                    f"(head, slot, side, relative gap in kvflow's / kvpress's scores): {out['bad']}")
            for i, key in enumerate(("compared", "exact_ties", "level")):
                total[case["dtype"]][i] += out[key]
    assert total["float32"][0] > 0
    for dtype, (compared, _ties, level) in total.items():
        assert level <= MAX_LEVEL_SWAPS[dtype] * compared, f"{press} {dtype}: {level} level swaps in {compared} slots"


def test_golden_file_covers_the_layouts_dtypes_and_lengths():
    cases = DATA["cases"]
    assert {(c["q_heads"], c["kv_heads"]) for c in cases} == {(4, 2), (6, 3), (4, 4)}
    assert {c["dtype"] for c in cases} == {"float32", "bfloat16"} and len({c["n"] for c in cases}) >= 3
    assert DATA["kvpress"].startswith("0.5") and DATA["transformers"].startswith("5.2")
