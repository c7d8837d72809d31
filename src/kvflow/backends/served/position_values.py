"""Per-position values for `prm` and `llm_judge` on a serving engine (SGLang, vLLM): the
engine side of the scorers' `PositionValues` contract (issue 26; vLLM: issue 41).
Candidate steps' token log-probabilities for `likelihood` come from the engines' prompt
log-probabilities through `kvflow.backends.served.prompt_logprobs.ScoringSession`.

The same contract as `hf`'s `PrefixForward`: for each request (problem key, token ids,
positions), a small head's outputs at those positions, [k, C] float32. Two kinds of head:

- `head=True`: a process reward model's two-class logits at every position the engine runs
  (SGLang: kvflow's `Qwen2ForProcessRewardModel`, `sglang/prm_model.py`, whose "hidden
  states" they are; vLLM: its own `Qwen2ForProcessRewardModel` on the pooling runner, every
  token's logits without activation);
- `labels=[...]`: a causal LM's log-probabilities of a few label tokens ("+"/"-", "Yes"/"No")
  at a position; softmax over them is softmax over the label logits (log-softmax only shifts
  them), so scorers read both kinds alike.

One message per request to the engine's worker, the same on both engines:
`("values", rid, ids, start, labels, need)` -> `("scored", rid, {"first", "values"}, meta)`,
values [n, C] of positions first.. (NaN where not computed). SGLang runs the tokens its radix
cache does not hold, from `start` on for label log-probabilities; vLLM answers label
log-probabilities at the `need` positions (one one-token request per position, reading the
prefix cache: `logprob_token_ids`) and a PRM's values at every position (vLLM's token pooling
reads no prefix cache).

An engine's cache holds each problem's committed prefix, so a request may run only the tokens
the cache does not hold, and the engine returns values for those positions only. The values
at cached positions (the committed steps' tags, which `aggregate: min | prod | mean` needs)
are kept here, per problem: every value a request returned, with its token ids, for the
problem's last round; a position's value depends only on the tokens up to it, so a new
request takes them over its longest common prefix with those. A needed position that the
engine served from its cache but that is not kept here (the cache held that prefix from
another request: a duplicate question, a problem scored again after release) is asked for
again with the cache capped before it (`start`), never guessed.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from kvflow.errors import EngineError
from kvflow.components.engine import common_prefix


class PositionValues:
    def __init__(self, engine, *, head: bool = False, labels: Optional[Sequence[int]] = None) -> None:
        if head == (labels is not None):
            raise ValueError("PositionValues: either head=True or labels")
        self.engine = engine
        self.labels = None if labels is None else [int(x) for x in labels]
        self.width = 2 if head else len(self.labels)
        self._known: dict[str, list[tuple[list[int], torch.Tensor]]] = {}  # problem -> [(ids, values [T, C], nan = unknown)]
        self.tokens_run = 0  # positions the engine ran (not served from its cache)
        self.requests = 0

    def __call__(self, keys: Sequence[str], ids: Sequence[Sequence[int]],
                 positions: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        vals = [self._from_known(k, x) for k, x in zip(keys, ids)]
        todo = {}
        for i, (x, pos) in enumerate(zip(ids, positions)):
            need = [p for p in pos if math.isnan(float(vals[i][p, 0]))]
            if need:
                todo[i] = (self._start(need), need)
        capped: set[int] = set()
        while todo:
            replies = self._ask({i: (list(ids[i]), start, need) for i, (start, need) in todo.items()})
            again = {}
            for i, (first, values) in replies.items():
                if len(values):  # NaN rows: positions the engine did not compute (kept values stay)
                    got = torch.as_tensor(values, dtype=torch.float32)
                    ran = ~torch.isnan(got[:, 0])
                    vals[i][first : first + len(values)][ran] = got[ran]
                need = [p for p in positions[i] if math.isnan(float(vals[i][p, 0]))]
                if need:
                    if i in capped:
                        raise EngineError(f"{self.engine.worker.where}: {self.engine.engine_name} returned no "
                                          f"value at positions {need}")
                    capped.add(i)
                    again[i] = (min(need), need)  # the cache capped before the first
            todo = again
        rounds: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
        for k, x, v in zip(keys, ids, vals):
            rounds.setdefault(k, []).append((list(x), v))
        self._known.update(rounds)
        return [v[list(pos)] if len(pos) else torch.empty(0, self.width) for v, pos in zip(vals, positions)]

    def release(self, keys: Sequence[str]) -> None:
        for k in keys:
            self._known.pop(k, None)

    def _start(self, need: list[int]) -> Optional[int]:
        """Where a request's values must start: a causal LM's label log-probabilities are
        asked from the first needed position on (which also caps the cache there); a PRM's
        come for whatever the engine runs (None: no cap, the common case)."""
        return None if self.labels is None else min(need)

    def _from_known(self, key: str, x: Sequence[int]) -> torch.Tensor:
        """Values [len(x), C] at the positions kept for this problem (nan elsewhere)."""
        out = torch.full((len(x), self.width), math.nan)
        for ids, values in self._known.get(key, ()):
            n = common_prefix(ids, x)
            hole = torch.isnan(out[:n, 0])
            out[:n][hole] = values[:n][hole]
        return out

    def _ask(self, requests: dict[int, tuple[list[int], Optional[int], list[int]]]) -> dict[int, tuple[int, list]]:
        order = list(requests)
        replies = self.engine.ask([("values", x, start, self.labels, need) for x, start, need in requests.values()],
                                  "scoring")
        out = {}
        for i, (payload, meta) in zip(order, replies):
            self.requests += 1
            self.tokens_run += (meta.get("prompt_tokens") or 0) - (meta.get("cached_tokens") or 0)
            out[i] = (payload["first"], payload["values"])
        return out
