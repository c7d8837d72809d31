"""`ngram`: stops a candidate step that keeps repeating the same n-gram (a repetition loop).

Under a tight KV budget a reasoning model often falls into a loop ("so the answer is 24 so
the answer is 24 ..."), which it would continue until the length cap. This detector counts,
in the last `window` tokens of the candidate's text, how often each n-gram of `n`
consecutive tokens occurs; when the most frequent one occurs more than `threshold` times,
the candidate is stopped (finish `pruned:ngram`).

Tokens here are the text's words and punctuation marks (the regular expression
`\\w+|[^\\w\\s]`), not model token ids: pruners see each candidate's decoded text
(`StepTrace.texts`), and a text tokenization makes the threshold mean the same for every
model and tokenizer (the base and a helper with different vocabularies get the same verdict).

Signal (`max_ngram_count`, recorded for `kvflow calibrate`): the count of the most frequent
n-gram in the window, nan before `min_tokens` model tokens or before the window holds `n`
tokens. Verdict: signal > threshold. Every call decides from the trace alone (rows leave
the batch as they finish), in O(window) per row.

Shapes: trace.texts (rows strings), trace.n_tokens [rows] -> [rows] bool.
"""

from __future__ import annotations

import re
from collections import Counter

from pydantic import Field, model_validator

from kvflow._lazy import torch
from kvflow.components import Pruner, PrunerParams

TOKEN = re.compile(r"\w+|[^\w\s]")


def max_ngram_count(tokens: list[str], n: int) -> int:
    """How often the most frequent n-gram of `tokens` occurs (0 if there are fewer than n)."""
    grams = Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
    return max(grams.values(), default=0)


class NgramParams(PrunerParams):
    n: int = Field(3, ge=1, description="Tokens per n-gram (text tokens: words and punctuation marks).")
    window: int = Field(64, ge=2, description="Last text tokens of the candidate in which n-grams are counted.")
    threshold: float = Field(4, ge=1, description="Stop a candidate when an n-gram occurs more than this many "
                                                  "times in the window.")
    min_tokens: int = Field(16, ge=0, description="No check before the candidate has this many model tokens.")

    @model_validator(mode="after")
    def _window_holds_an_ngram(self):
        if self.window < self.n:
            raise ValueError(f"window ({self.window}) must hold at least one n-gram (n = {self.n})")
        return self


class NgramRepetitionPruner(Pruner):
    """Stops a candidate whose last `window` text tokens repeat one n-gram more than `threshold` times."""

    Params = NgramParams
    signal_name = "max_ngram_count"

    def signal(self, trace):
        p = self.params
        out = []
        for text, count in zip(trace.texts, trace.n_tokens.tolist()):
            tokens = TOKEN.findall(text)[-p.window:]
            ready = count >= p.min_tokens and len(tokens) >= p.n
            out.append(float(max_ngram_count(tokens, p.n)) if ready else float("nan"))
        return torch.tensor(out, dtype=torch.float32)

    def check(self, trace):
        return self.signal(trace) > self.params.threshold  # nan compares False
