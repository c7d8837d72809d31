"""The n-gram pruner passes kvflow's pruner contract, and counts n-grams as written by hand."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.components.base import StepTrace
from kvflow.testing.pruner_contract import PrunerContract
from kvflow_example_ngram.pruner import TOKEN, NgramRepetitionPruner, max_ngram_count


# --8<-- [start:contract]
class TestNgramContract(PrunerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def pruner_factory(cls):
        return lambda **params: NgramRepetitionPruner(NgramRepetitionPruner.Params(**params))
# --8<-- [end:contract]


def pruner(**params):
    return NgramRepetitionPruner(NgramRepetitionPruner.Params(**params))


def trace(texts, n_tokens):
    return StepTrace(entropies=torch.zeros(len(texts), 8), n_tokens=torch.tensor(n_tokens), texts=texts)


def test_text_tokens_are_words_and_punctuation():
    assert TOKEN.findall("So 48 / 2 = 24, done.") == ["So", "48", "/", "2", "=", "24", ",", "done", "."]


def test_max_ngram_count_by_hand():
    tokens = "a b c a b c a b d".split()
    assert max_ngram_count(tokens, 1) == 3  # a, b: 3 times each
    assert max_ngram_count(tokens, 2) == 3  # (a, b) at 0, 3, 6
    assert max_ngram_count(tokens, 3) == 2  # (a, b, c) at 0, 3
    assert max_ngram_count(tokens, 9) == 1 and max_ngram_count(tokens, 10) == 0


def test_stops_a_loop_only_above_the_threshold():
    loop = "so the answer is 24 " * 5  # "so the answer" occurs 5 times
    once = "In May she sold 48 / 2 = 24 clips, so the answer is 72."
    p = pruner(n=3, window=64, threshold=4, min_tokens=0)
    assert p.signal(trace([loop, once], [40, 40])).tolist() == [5.0, 1.0]
    assert p.check(trace([loop, once], [40, 40])).tolist() == [True, False]
    assert p.check(trace([loop], [40])).tolist() == [True]
    assert pruner(n=3, window=64, threshold=5, min_tokens=0).check(trace([loop], [40])).tolist() == [False]


def test_only_the_window_counts():
    text = "so the answer is 24 " * 5 + "then we add 3 and 4 to get 7 , then divide by 7 ."
    # The last 20 text tokens (the last loop "so the answer is 24" and the 15 after it) hold it once.
    assert pruner(n=3, window=20, threshold=1, min_tokens=0).signal(trace([text], [50])).tolist() == [1.0]
    assert pruner(n=3, window=64, threshold=1, min_tokens=0).signal(trace([text], [50])).tolist() == [5.0]


def test_waits_for_min_tokens_and_a_full_ngram():
    p = pruner(n=3, window=64, threshold=1, min_tokens=16)
    out = p.signal(trace(["a a a a a a", "a a"], [15, 30])).tolist()
    assert all(math.isnan(x) for x in out)  # too few model tokens; too few text tokens for a 3-gram
    assert p.check(trace(["a a a a a a"], [16])).tolist() == [True]


def test_window_must_hold_an_ngram():
    with pytest.raises(ValueError, match="window"):
        NgramRepetitionPruner.Params(n=8, window=4)
