"""`pyramidkv`: PyramidKV's layer budgets with SnapKV's scores, applied at decode time.

Paper: Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling" (arXiv 2406.02069, 2024). Reference code: Zefan-Cai/PyramidKV
(`pyramidkv_utils.py`, `PyramidKVCluster`); NVIDIA kvpress ships it as `PyramidKVPress`.
Attention is broad in the lower layers and funnels into a few tokens higher up, so the
lower layers keep more tokens and the higher ones fewer, in an arithmetic sequence with the
same total: layer l keeps W + max - l (max - min) / (L - 1) per KV head, min = (B - W) / β,
max = 2 (B - W) - min (β = 20), rounded to integers that sum to exactly B x L
(`kvflow.components.allocation.pyramid_budgets`). Within a layer the tokens are chosen by
SnapKV's observation-window attention (the reference's pooling and window; here every
`snapkv` parameter applies, with snapkv's defaults, i.e. R-KV's SnapKV).

Budget convention: kvflow's (METHODS §0) per layer: `budget` is the mean over layers of the
tokens kept per (layer, KV head), window included; a layer's own budget is above its window
and at most `budget + buffer` (what it holds at a compaction; the reference's short-prompt
rule lowers max to that). The prompt, when protected, keeps what fits in a smaller layer.
Compactions happen for all layers at once, every `buffer` tokens as for snapkv.

Shapes: as `snapkv` (keys [rows, kv_heads, N, head_dim], queries [rows, q_heads, W,
head_dim] -> scores [rows, kv_heads, N]); `select()` returns [rows, kv_heads, layer budget].
"""

from __future__ import annotations

from kvflow.components.allocation import PyramidLayers, PyramidParams
from kvflow_builtin.evictors.snapkv import SnapKVEvictor, SnapKVParams


class PyramidKVParams(PyramidParams, SnapKVParams):
    pass


class PyramidKVEvictor(PyramidLayers, SnapKVEvictor):
    """SnapKV's scores, PyramidKV's per-layer budgets."""

    Params = PyramidKVParams
