"""Sampling on the `hf` backend, as batched tensor ops over a decode step's rows.

- `sample()`: one token per row by inverse CDF from given uniforms (greedy at temperature 0),
  with the model's logprob, the sampling distribution's entropy and the token confidence
  (DeepConf's, from the model's top-`CONFIDENCE_TOP_K` log-probabilities);
- `uniforms()`: counter-based random numbers, a pure function of (row seed, token index), so
  a row draws the same numbers alone or in any batch, with no per-row generator on the host;
- `DelimiterTable`: a per-token automaton that finds the step delimiter across token
  boundaries without decoding text (`next[state, token]`, `hit[state, token]`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvflow.components.base import CONFIDENCE_TOP_K
from kvflow.components.engine import delimiter_scan


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[rows] float32 in [0, 1), multiples of 2**-24: splitmix64 of (seed, counter), i.e. the
    counter-th number of the row's stream. seeds, counters: [rows] int64 (any device); int64
    arithmetic wraps, which is what the mix needs."""
    x = seeds * _GOLDEN + (counters + 1) * _MIX2
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    return _shr(x, 40).float() * 2.0**-24


class DelimiterTable:
    """Where the delimiter completes, token by token. State s = how many leading characters
    of the delimiter the text so far ends with (KMP); `hit[s, t]` is True when appending token
    t's text completes the delimiter anywhere inside it, `next[s, t]` the state after t."""

    def __init__(self, pieces: Sequence[str], delimiter: str, device) -> None:
        n, vocab = len(delimiter), len(pieces)
        self.next = torch.zeros(max(n, 1), vocab, dtype=torch.long)
        self.hit = torch.zeros(max(n, 1), vocab, dtype=torch.bool)
        chars = set(delimiter)
        for t, piece in enumerate(pieces):
            if not chars.intersection(piece):
                continue  # no delimiter character: the match restarts, state 0, no hit
            for s in range(n):
                self.next[s, t], self.hit[s, t] = delimiter_scan(delimiter, s, piece)
        self.next, self.hit = self.next.to(device), self.hit.to(device)


def sample(logits: torch.Tensor, temperature: float, top_p: float, uniforms: torch.Tensor):
    """Draw one token per row by inverse CDF with the given uniforms.

    logits: [rows, vocab] float32; uniforms: [rows] in [0, 1)
    returns tokens [rows] int64, logprobs [rows] (model's own, temperature 1),
    entropies [rows] of the sampling distribution (after temperature, before top-p), in nats,
    and confidences [rows] (`confidence()`, on the model's own temperature-1 distribution).

    The inverse CDF runs over the tokens in descending probability, ties in token-id order
    (a stable sort), restricted to the nucleus when top_p < 1. The nucleus is found among the
    `_NUCLEUS_K` most probable tokens (ties at the boundary included) without sorting the
    whole vocabulary, which is what made sampling cost ~10% of a CPU decode step; a row whose
    nucleus does not close among them is sorted in full. Either way the result is the same.
    """
    if temperature <= 0:
        return _greedy(logits)
    logp = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
    slogp = logp if temperature == 1.0 else torch.log_softmax(logits / temperature, dim=-1)
    probs = slogp.exp()
    entropy = -(probs * slogp).nan_to_num().sum(-1)
    tokens = _nucleus_sample(probs, top_p, uniforms.to(probs.device))
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen, entropy, confidence(logp)


def confidence(logp: torch.Tensor, k: int = CONFIDENCE_TOP_K) -> torch.Tensor:
    """DeepConf's token confidence (Fu et al. 2025, arXiv:2508.15260): [rows] float32 =
    -mean of the k largest entries of each row of logp [rows, vocab] (log-probabilities;
    k capped at the vocabulary). One partial selection over the row (`topk`, unsorted)."""
    k = min(k, logp.shape[-1])
    return -logp.topk(k, dim=-1, sorted=False).values.float().mean(-1)


def _greedy(logits: torch.Tensor):
    """Greedy decoding's token, logprob, entropy and confidence. On a CPU `argmax` and `exp`
    over a 152k vocabulary are scalar loops (~1.2 ms each for 4 rows, one thread) where the
    fused softmax kernels and `amax` are vectorized; the token comes from `argmax_first` and
    the entropy from softmax * log-softmax: about half the time of log-softmax, argmax and exp."""
    logp = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
    tokens = argmax_first(logits)
    entropy = -(torch.softmax(logits, dim=-1) * logp).nan_to_num_().sum(-1)  # 0 * -inf counts 0
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), entropy, confidence(logp)


_CHUNK = 128


def argmax_first(x: torch.Tensor) -> torch.Tensor:
    """[rows] int64: `x.argmax(-1)` (the first maximal index; x: [rows, n] without NaN), from
    vectorized reductions: each chunk's max, the first chunk that holds the row's max, then
    the argmax inside that chunk."""
    rows, n = x.shape
    if n < 4 * _CHUNK:
        return x.argmax(-1)
    pad = -n % _CHUNK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
    chunks = x.view(rows, -1, _CHUNK)  # [rows, C, CHUNK]
    best = chunks.amax(-1)  # [rows, C]
    first = best.argmax(-1)  # [rows]: the first chunk holding the max (C elements: cheap)
    inner = chunks[torch.arange(rows, device=x.device), first].argmax(-1)  # [rows]
    return first * _CHUNK + inner


_NUCLEUS_K = 1024  # most probable tokens searched for the nucleus before a full sort


def _nucleus_sample(probs: torch.Tensor, top_p: float, uniforms: torch.Tensor) -> torch.Tensor:
    rows, vocab = probs.shape
    if top_p >= 1.0 or vocab <= _NUCLEUS_K:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        return _inverse_cdf(sorted_p, order, top_p, uniforms)
    # every token at least as probable as the K-th, in token-id order, then stably sorted: the
    # head of the full stable sort (tokens below the K-th come after all of them)
    kth = probs.topk(_NUCLEUS_K, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # [rows, 1]
    head = probs >= kth
    r, c = head.nonzero(as_tuple=True)  # row-major: token ids ascending within a row
    counts = head.sum(-1)
    slot = torch.arange(len(r), device=probs.device) - (counts.cumsum(0) - counts)[r]
    width = int(counts.max())
    order = torch.zeros(rows, width, dtype=torch.long, device=probs.device)
    values = torch.full((rows, width), -1.0, dtype=probs.dtype, device=probs.device)  # padding sorts last
    order[r, slot] = c
    values[r, slot] = probs[r, c]
    values, perm = values.sort(dim=-1, descending=True, stable=True)
    order = order.gather(-1, perm)
    values = values.clamp(min=0.0)
    tokens = _inverse_cdf(values, order, top_p, uniforms)
    # exact when the head's mass reaches top_p: every later token then lies outside the nucleus
    # (the same prefix sums as a full sort; cumsum runs in order)
    open_rows = (values.cumsum(-1)[:, -1] < top_p).nonzero().flatten()
    if len(open_rows):
        sorted_p, full = probs[open_rows].sort(dim=-1, descending=True, stable=True)
        tokens[open_rows] = _inverse_cdf(sorted_p, full, top_p, uniforms[open_rows])
    return tokens


def _inverse_cdf(sorted_p: torch.Tensor, order: torch.Tensor, top_p: float, uniforms: torch.Tensor) -> torch.Tensor:
    cum = sorted_p.cumsum(-1)
    if top_p < 1.0:
        sorted_p = sorted_p.masked_fill(cum - sorted_p >= top_p, 0.0)  # keep the smallest nucleus
        cum = sorted_p.cumsum(-1)
    target = uniforms[:, None] * cum[:, -1:]
    pick = torch.searchsorted(cum, target).clamp(max=cum.shape[-1] - 1)  # [rows, 1]
    return order.gather(-1, pick).squeeze(-1)
