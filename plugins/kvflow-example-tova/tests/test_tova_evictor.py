"""TOVA passes kvflow's evictor contract, and its scores match attention computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.testing.evictor_contract import EvictorContract
from kvflow_example_tova.evictor import TovaEvictor


# --8<-- [start:contract]
class TestTovaContract(EvictorContract):
    @pytest.fixture(scope="class", params=["group", "layer"])
    @classmethod
    def evictor_factory(cls, request):
        return lambda **params: TovaEvictor(TovaEvictor.Params(heads=request.param, **params))
# --8<-- [end:contract]


def tova(budget, **params):
    return TovaEvictor(TovaEvictor.Params(budget=budget, **params))


def select(evictor, keys, queries, lengths):
    rows = keys.shape[0]
    return evictor.select(keys, keys, queries, layer_idx=0, lengths=torch.tensor(lengths),
                          n_protected=torch.zeros(rows, dtype=torch.long), generators=[])


# --8<-- [start:reference]
# One row, one KV head shared by two query heads, head_dim 1 (so 1/sqrt(d) = 1).
# Keys ln(1..4): the query +1 attends (1, 2, 3, 4) / 10, the query -1 attends
# (1, 1/2, 1/3, 1/4) / (25/12) = (12, 6, 4, 3) / 25. Their mean over the group:
# (0.29, 0.22, 0.23, 0.26): tokens 0 and 3 are the two the newest query attends to most.
KEYS = torch.log(torch.tensor([1.0, 2.0, 3.0, 4.0])).view(1, 1, 4, 1)
QUERIES = torch.tensor([1.0, -1.0]).view(1, 2, 1, 1)  # [rows, q_heads, W=1, d]


def test_scores_are_the_newest_querys_attention_averaged_over_the_group():
    scores = tova(2).score(KEYS, KEYS, QUERIES, layer_idx=0, lengths=torch.tensor([4]), n_protected=None,
                           generators=[])
    assert scores.shape == (1, 1, 4)
    torch.testing.assert_close(scores[0, 0], torch.tensor([0.29, 0.22, 0.23, 0.26]))
    assert select(tova(2), KEYS, QUERIES, [4])[0, 0].tolist() == [0, 3]
    assert select(tova(3), KEYS, QUERIES, [4])[0, 0].tolist() == [0, 2, 3]
# --8<-- [end:reference]


def test_only_the_newest_query_counts():
    older = torch.tensor([[-5.0, 5.0], [3.0, 3.0]]).view(1, 2, 2, 1)  # two older queries per head
    queries = torch.cat([older, QUERIES], dim=2)  # W = 3, the newest last
    assert select(tova(2), KEYS, queries, [4])[0, 0].tolist() == [0, 3]


def test_padding_slots_take_no_attention():
    # Slot 3 is padding: softmax over (1, 2, 3): (1, 2, 3) / 6 and (6, 3, 2) / 11;
    # mean (0.356, 0.303, 0.341): keep 0 and 2.
    keys = KEYS.clone()
    keys[..., 3, :] = 1e3  # a stale value in the padding slot
    scores = tova(2).score(keys, keys, QUERIES, layer_idx=0, lengths=torch.tensor([3]), n_protected=None,
                           generators=[])
    want = [(1 / 6 + 6 / 11) / 2, (2 / 6 + 3 / 11) / 2, (3 / 6 + 2 / 11) / 2, 0.0]
    torch.testing.assert_close(scores[0, 0], torch.tensor(want))
    assert select(tova(2), keys, QUERIES, [3])[0, 0].tolist() == [0, 2]


def test_groups_follow_gqa_and_layer_mode_shares_one_choice():
    # Two KV heads, two query heads each (heads 0, 1 read KV head 0; heads 2, 3 read KV head 1).
    keys = torch.cat([KEYS, torch.log(torch.tensor([4.0, 3.0, 2.0, 1.0])).view(1, 1, 4, 1)], dim=1)
    queries = torch.tensor([1.0, -1.0, 1.0, 1.0]).view(1, 4, 1, 1)
    per_group = select(tova(2), keys, queries, [4])[0]
    assert per_group[0].tolist() == [0, 3]  # as above
    assert per_group[1].tolist() == [0, 1]  # (4, 3, 2, 1) / 10 from both heads
    layer = tova(2, heads="layer").score(keys, keys, queries, layer_idx=0, lengths=torch.tensor([4]),
                                         n_protected=None, generators=[])
    # mean over the four heads: ((0.29, 0.22, 0.23, 0.26) + (0.4, 0.3, 0.2, 0.1)) / 2
    torch.testing.assert_close(layer[0, 0], torch.tensor([0.345, 0.26, 0.215, 0.18]))
    torch.testing.assert_close(layer[0, 1], layer[0, 0])
    assert select(tova(2, heads="layer"), keys, queries, [4])[0].tolist() == [[0, 1], [0, 1]]


def test_scale_is_one_over_sqrt_head_dim():
    # head_dim 4 with the same dot products as above times 2 = sqrt(4): identical attention
    keys = torch.zeros(1, 1, 4, 4)
    keys[..., 0] = 2 * KEYS[..., 0]
    queries = torch.zeros(1, 2, 1, 4)
    queries[..., 0] = QUERIES[..., 0]
    scores = tova(2).score(keys, keys, queries, layer_idx=0, lengths=torch.tensor([4]), n_protected=None,
                           generators=[])
    torch.testing.assert_close(scores[0, 0], torch.tensor([0.29, 0.22, 0.23, 0.26]))
    assert math.isclose(float(scores.sum()), 1.0, rel_tol=1e-6)


def test_defaults_follow_the_paper():
    params = TovaEvictor.Params()
    assert (params.buffer, params.window, params.protect_prompt) == (1, 0, False)
    assert TovaEvictor(params).query_window == 1
