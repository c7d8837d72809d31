"""`keydiff`: keep the tokens whose keys differ most from the mean key direction (KeyDiffPress).

Paper: Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
Inference in Resource-Constrained Environments" (2025), https://arxiv.org/abs/2504.15364.
The anchor is the mean of the row's unit-normalised keys; a token whose key points the
anchor's way carries little that the others do not, so the score is the negative cosine
similarity to the anchor.

kvpress: `KeyDiffPress` (anchor = mean of `F.normalize(keys)` over the whole cache, score
`-F.cosine_similarity(keys, anchor)`); the paper's block-wise iteration is kvpress's
`BlockPress` wrapper, which kvflow does not port (at decode time a compaction already sees
the whole cache). kvflow's anchor averages a row's own resident slots only, so a row scores
the same alone as in a batch. Budget convention: kvflow's (METHODS §0); `window: 0` is
kvpress's rule. Cadence: every `buffer` tokens.

Shapes: keys [rows, kv_heads, N, head_dim] -> scores [rows, kv_heads, N] float32. GQA: not
applicable (keys only, per KV head).
"""

from __future__ import annotations

from kvflow._lazy import torch
from kvflow.components.base import Evictor, EvictorParams
from kvflow_builtin.evictors._common import valid_slots


class KeyDiffParams(EvictorParams):
    pass


class KeyDiffEvictor(Evictor):
    """Keep the tokens least similar to the mean key direction (Park et al. 2025)."""

    Params = KeyDiffParams
    layer_invariant = True  # scores from the rows' tensors alone (Evictor.select_layers stacks layers)

    def score(self, keys, values, queries, *, layer_idx, lengths, generators, **kwargs):
        k = keys.float()
        valid = valid_slots(lengths, k.shape[2], k.device)[:, None, :, None]  # [rows, 1, N, 1]
        unit = torch.nn.functional.normalize(k, p=2, dim=-1) * valid
        anchor = unit.sum(dim=2, keepdim=True) / lengths.to(k.device).clamp(min=1)[:, None, None, None]
        return -torch.nn.functional.cosine_similarity(k, anchor, dim=-1)  # [rows, kv_heads, N]
