"""What a pruner's trace holds, from the top-k temperature-1 log-probabilities that an engine in
another process (SGLang's, vLLM's) returns per token: the sampling distribution's entropy (an
estimate where k does not cover the support) and DeepConf's token confidence (exact: the mean
of the top `CONFIDENCE_TOP_K`)."""

from __future__ import annotations

import math
from typing import Sequence

from kvflow.components.base import CONFIDENCE_TOP_K


def entropy_estimate(top: Sequence[tuple[float, int]], temperature: float, vocab: int) -> float:
    """Entropy (nats) of the sampling distribution from the top-k temperature-1 logprobs.

    The k listed tokens get p_i^(1/T) (T = 1 for greedy, as on `hf`); the missing mass
    r = 1 - sum p_i is taken as spread evenly over the other vocab - k tokens. Exact when k
    covers the whole support; otherwise an estimate (at T = 1 an upper bound)."""
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    logs = [lp * inv_t for lp, _ in top]
    rest = max(0.0, 1.0 - sum(math.exp(lp) for lp, _ in top))
    others = max(0, vocab - len(top))
    if rest > 0 and others:
        tail_log = math.log(rest / others) * inv_t  # log q of one tail token
        logs_all = logs + [tail_log + math.log(others)]  # the tail as one lump, for the partition
    else:
        tail_log, logs_all = None, logs
    m = max(logs_all)
    log_z = m + math.log(sum(math.exp(x - m) for x in logs_all))
    h = -sum(math.exp(x - log_z) * (x - log_z) for x in logs)
    if tail_log is not None:
        h -= others * math.exp(tail_log - log_z) * (tail_log - log_z)
    return h


def token_confidence(top: Sequence[tuple[float, int]], vocab: int) -> float:
    """DeepConf's token confidence from the top temperature-1 logprobs an engine returned:
    pairs (logprob, token id): minus the mean of the largest min(CONFIDENCE_TOP_K, vocab)."""
    k = min(CONFIDENCE_TOP_K, vocab, len(top))
    return -sum(sorted((lp for lp, _ in top), reverse=True)[:k]) / k if k else float("nan")
