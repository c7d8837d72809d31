"""Decoding a tiny model with an evictor, for the evictor contract (kvflow.testing.evictor_contract)
and for tests of evictors: `decode` (greedy, one batch, optionally traced), `recorded_decode`
(the same, every compaction's `select()` inputs and outputs recorded), and
`same_until_explained`: whether a row decoded inside a batch and the same row alone agree,
or differ only where the forward's batch noise explains it (a near-tied argmax, or a swap of
kept slots whose scores differ by less than twice the two runs' score difference).
"""

from __future__ import annotations

#: prompts (token ids) of different lengths: rows reach budget + buffer at different steps
PROMPTS = [list(range(5, 12)), list(range(20, 35)), list(range(40, 44))]
ROW_SEEDS = [11, 22, 33]


def decode(runner, evictor, prompts, steps: int, seeds=None, trace: list | None = None):
    """Greedy decoding of `steps` tokens for every prompt in one batch.

    Returns (tokens [rows][steps], cache). With `trace`, appends one (lengths before the
    forward, lengths after, compactions after) tuple per forward, prefill included."""
    import torch

    cache = runner.new_cache(evictor, len(prompts), seeds if seeds is not None else ROW_SEEDS[: len(prompts)])
    pending = runner.prefill(cache, prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        before = cache.rows.lengths.clone()
        logits = runner.forward(cache, pending[:, None])
        assert torch.isfinite(logits).all(), "non-finite logits"
        if trace is not None:
            trace.append((before, cache.rows.lengths.clone(), cache.rows.compactions.clone()))
        pending = logits.argmax(-1).cpu()
        for r, t in enumerate(pending.tolist()):
            tokens[r].append(t)
    return tokens, cache


def shapes(arch: str) -> tuple[int, int, int]:
    """(q_heads, kv_heads, head_dim) of the tiny model of `arch`."""
    from kvflow.testing.models import ARCHITECTURES

    _, extra = ARCHITECTURES[arch]
    hidden = extra.get("hidden_size", 64)
    return extra["num_attention_heads"], extra["num_key_value_heads"], hidden // extra["num_attention_heads"]


#: an argmax whose two best logits are closer than this may flip with the forward's batch noise
ARGMAX_TIE = 1e-4


class Recorded:
    """A decode run with what its evictor saw: tokens [rows][steps], the top-2 logit gap per
    (step, row), and every compaction as (step, cache rows, [one select record per layer])."""

    def __init__(self) -> None:
        self.tokens: list[list[int]] = []
        self.gaps: list[list[float]] = []
        self.compactions: list[tuple[int, list[int], list[dict]]] = []
        self.cache = None


def recorded_decode(runner, evictor, prompts, steps: int, seeds) -> Recorded:
    """`decode()` (greedy), recording every compaction's `select()` inputs and outputs."""
    import torch

    run = Recorded()
    step = [-1]  # -1: the prefill
    calls: list[dict] = []
    base = type(evictor)

    class Recording(base):  # the same evictor, its select() calls recorded
        def select(self, keys, values, queries, **kw):
            gens = kw.get("generators") or []
            record = {"keys": keys.clone(), "values": values.clone(),
                      "queries": queries.clone() if queries is not None else None,
                      "gen_states": [g.get_state() for g in gens],
                      **{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items() if k != "generators"}}
            keep = super().select(keys, values, queries, **kw)
            record["keep"] = keep.clone()
            calls.append(record)
            return keep

    Recording.__name__ = Recording.__qualname__ = base.__name__
    ev = Recording.__new__(Recording)
    ev.__dict__.update(evictor.__dict__)
    cache = runner.new_cache(ev, len(prompts), seeds)
    compact = cache.compact

    def recorded_compact(rows):
        calls.clear()
        compact(rows)
        run.compactions.append((step[0], rows.tolist(), list(calls)))

    cache.compact = recorded_compact
    pending = runner.prefill(cache, prompts)
    run.tokens = [[] for _ in prompts]
    for step[0] in range(steps):
        logits = runner.forward(cache, pending[:, None])
        assert torch.isfinite(logits).all(), "non-finite logits"
        top = logits.topk(2, dim=-1).values
        run.gaps.append((top[:, 0] - top[:, 1]).tolist())
        pending = logits.argmax(-1).cpu()
        for r, t in enumerate(pending.tolist()):
            run.tokens[r].append(t)
    run.cache = cache
    return run


def row_record(record: dict, i: int) -> dict:
    """Row i of a recorded select() call, as a one-row call."""
    out = {}
    for k, v in record.items():
        if k == "gen_states":
            out[k] = v[i : i + 1]
        elif hasattr(v, "shape") and v.dim() >= 1:
            out[k] = v[i : i + 1]
        else:
            out[k] = v
    return out


def scores_of(evictor, rec: dict):
    """The evictor's ranked scores for a recorded one-row select() call, and each slot's validity."""
    import torch

    gens = []
    for state in rec["gen_states"]:
        g = torch.Generator()
        g.set_state(state)
        gens.append(g)
    scores = evictor.ranked_scores(rec["keys"], rec["values"], rec["queries"], layer_idx=rec["layer_idx"],
                                   lengths=rec["lengths"], n_protected=rec["n_protected"], generators=gens,
                                   stats=rec.get("stats"), head_lengths=rec.get("head_lengths"))
    n = scores.shape[-1]
    heads = rec.get("head_lengths")
    length = (heads if heads is not None else rec["lengths"][:, None])[..., None]  # [1, H or 1, 1]
    slot = torch.arange(n)[None, None, :]
    valid = (slot < length) & (slot < length - evictor.params.window) & (slot >= rec["n_protected"][:, None, None])
    return scores[0], valid[0].expand_as(scores[0])


def explained(evictor, alone: dict, batched: dict) -> tuple[bool, str]:
    """Whether two one-row selections that kept different slots differ only by a swap the
    difference of their inputs explains (see `EvictorContract.test_batched_equals_alone`)."""
    import torch

    sa, valid = scores_of(evictor, alone)
    sb, _ = scores_of(evictor, batched)
    if not torch.allclose(sa, scores_of(evictor, alone)[0], rtol=0, atol=0, equal_nan=True):
        return False, ("the evictor's scores are not a function of its inputs and generators (two calls on the same "
                       "tensors and generator states differ): draw random numbers from `generators[row]` only")
    diff = torch.where(sa == sb, torch.zeros_like(sa), (sa - sb).abs()).nan_to_num(nan=float("inf"))
    delta = float(diff[valid].max()) if valid.any() else 0.0

    def kept(rec):
        keep = rec["keep"][0]
        return {(h, int(j)) for h in range(keep.shape[0]) for j in keep[h].tolist() if j >= 0}

    only_a, only_b = kept(alone) - kept(batched), kept(batched) - kept(alone)
    if not only_a or not only_b or delta == 0.0:
        return False, (f"kept {sorted(only_a)} alone and {sorted(only_b)} batched from inputs whose scores differ by "
                       f"{delta:.2e}: nothing but the batch explains it")
    gap = max(float(sa[h, j]) for h, j in only_a) - min(float(sa[h, j]) for h, j in only_b)
    if gap <= 2 * delta:
        return True, ""
    return False, (f"kept {sorted(only_a)} alone and {sorted(only_b)} batched, but the alone run ranks the former "
                   f"{gap:.2e} above the latter, more than twice the scores' difference between the runs "
                   f"(δ = {delta:.2e}): the batch changed the selection, not the forward's noise")


def same_until_explained(evictor, r: int, batch: Recorded, alone: Recorded) -> bool:
    """Walk row r's tokens and compactions in order, batched vs alone. Returns True if they
    all agree, False at the first difference the forward's batch noise explains (a near-tie
    of the argmax or of the evictor's ranking); fails on any other difference."""
    import torch

    events_a = [(step, calls) for step, _, calls in alone.compactions]
    events_b = [(step, calls, rows.index(r)) for step, rows, calls in batch.compactions if r in rows]
    assert [e[0] for e in events_a] == [e[0] for e in events_b], (
        f"row {r}: compactions after tokens {[e[0] for e in events_b]} batched but {[e[0] for e in events_a]} alone "
        "(-1: the prefill)")
    events = iter(zip(events_a, events_b))
    pending = next(events, None)
    for step in range(-1, len(alone.tokens[0])):
        if step >= 0 and alone.tokens[0][step] != batch.tokens[r][step]:
            if alone.gaps[step][0] <= ARGMAX_TIE:
                return False  # a near-tied argmax flipped
            raise AssertionError(f"row {r}: batched decoding differs from the row alone at token {step}, and no "
                                 f"near-tie explains it (top-2 logit gap {alone.gaps[step][0]:.2e})")
        while pending is not None and pending[0][0] == step:
            (_, calls_a), (_, calls_b, pos) = pending
            for rec_a, rec_b_all in zip(calls_a, calls_b):
                rec_b = row_record(rec_b_all, pos)
                layer = rec_a["layer_idx"]
                for k in ("lengths", "n_protected", "head_lengths"):
                    a, b = rec_a.get(k), rec_b.get(k)
                    assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (
                        f"row {r}, compaction after token {step}, layer {layer}: {k} differ batched and alone")
                if torch.equal(rec_a["keep"], rec_b["keep"]):
                    continue
                ok, why = explained(evictor, rec_a, rec_b)
                assert ok, f"row {r}, compaction after token {step}, layer {layer}: {why}"
                return False
            pending = next(events, None)
    return True
