"""`lagkv`: lag-relative information of keys and values, partition by partition (LagKVPress).

Paper: Liang et al., "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are
Important" (2025), https://arxiv.org/abs/2504.04704. After `n_sink` sinks the row is cut into
partitions of `lag_size` tokens; each partition is scored against the next one (its "lag"):
every channel is min-max scaled by the next partition's range, a token's spread (standard
deviation over channels) is softmaxed within the partition, keys and values averaged. With
`cross_scoring: false` (the default) the scores become within-partition ranks / lag_size,
so every partition keeps its most informative tokens. The sinks and the tail (the last
whole partition, which has no lag yet, plus the partial one after it) score 1, above all.
A row shorter than `n_sink + 2 x lag_size` has nothing to score yet: its sinks score 1 and
the rest a ramp rising with the slot (the newest are kept), as in the reference.

kvpress: `LagKVPress` with the same parameters and defaults. kvpress computes in the cache's
dtype; kvflow in float32, one row at a time over its own length (partitions start at the
row's slot `n_sink`, so a row scores the same alone as in a batch). Note: at kvflow's default
budget and buffer (64 + 128) the row never holds `n_sink + 2 x 128` tokens, and LagKV keeps
the sinks and the newest tokens, like `streaming`: give a `lag_size` of at most
(budget + buffer - n_sink) / 2 for it to score anything. Budget convention: kvflow's
(METHODS §0); `window: 0` is kvpress's rule. Cadence: every `buffer` tokens.

Shapes: keys, values [rows, kv_heads, N, head_dim] -> scores [rows, kv_heads, N] float32.
GQA: not applicable (keys and values only, per KV head).
"""

from __future__ import annotations

from pydantic import Field

from kvflow._lazy import torch
from kvflow.components.base import Evictor, EvictorParams


class LagKVParams(EvictorParams):
    n_sink: int = Field(4, ge=0, description="Leading slots always kept (scored 1).")
    lag_size: int = Field(128, ge=2, description="Partition length; each partition is scored against the next.")
    cross_scoring: bool = Field(False, description="Keep the softmaxed spreads (comparable across partitions) "
                                                   "instead of within-partition ranks.")


def _spread(parts):
    """parts [heads, P + 1, lag, d] -> [heads, P, lag]: each partition's tokens scaled by the
    next partition's per-channel range, std over channels, softmax within the partition."""
    ref, cur = parts[:, 1:], parts[:, :-1]
    low = ref.amin(dim=-2, keepdim=True)
    high = ref.amax(dim=-2, keepdim=True)
    return ((cur - low) / (high - low)).std(dim=-1).softmax(dim=-1)


class LagKVEvictor(Evictor):
    """Keep each partition's tokens that stand out against the next partition (Liang et al. 2025)."""

    Params = LagKVParams
    layer_invariant = True  # scores from the rows' tensors alone (Evictor.select_layers stacks layers)

    def _row(self, keys, values, length: int):
        """keys, values [kv_heads, length, d] -> scores [kv_heads, length] float32."""
        p = self.params
        heads = keys.shape[0]
        score = torch.ones(heads, length, dtype=torch.float32, device=keys.device)
        if length < p.n_sink + 2 * p.lag_size:
            if length > p.n_sink:
                ramp = torch.arange(length - p.n_sink, device=keys.device, dtype=torch.float32)
                score[:, p.n_sink :] = ramp / (length - p.n_sink)
            return score
        end = p.n_sink + ((length - p.n_sink) // p.lag_size) * p.lag_size
        d = keys.shape[-1]
        k = keys[:, p.n_sink : end].float().reshape(heads, -1, p.lag_size, d)
        v = values[:, p.n_sink : end].float().reshape(heads, -1, p.lag_size, values.shape[-1])
        scored = (_spread(k) + _spread(v)) / 2  # [heads, P, lag]
        if not p.cross_scoring:
            scored = scored.argsort(dim=-1).argsort(dim=-1).float() / p.lag_size
        score[:, p.n_sink : end - p.lag_size] = scored.reshape(heads, -1)
        return score  # the tail [end - lag, length) stays 1

    def score(self, keys, values, queries, *, layer_idx, lengths, generators, **kwargs):
        rows, kv_heads, n, _ = keys.shape
        out = torch.zeros(rows, kv_heads, n, dtype=torch.float32, device=keys.device)
        for r, length in enumerate(lengths.tolist()):
            out[r, :, :length] = self._row(keys[r, :, :length], values[r, :, :length], length)
        return out
