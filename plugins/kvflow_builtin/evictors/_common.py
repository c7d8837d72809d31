"""Tensor helpers shared by the attention-based built-in evictors (snapkv, rkv, vase, h2o).

Every helper works on a whole batch of rows at once and only ever looks at a row's own
resident slots (`lengths[row]`), so a row scores the same alone as in any batch. Nothing
expands the KV heads to query heads: queries are viewed as [rows, kv_heads, g, ...] and
multiplied against the [rows, kv_heads, N, head_dim] keys directly.
"""

from __future__ import annotations

import math
from typing import Literal

from kvflow._lazy import torch

GqaReduce = Literal["max", "mean"]
Pooling = Literal["max", "avg", "none"]
SoftmaxKeys = Literal["older", "causal"]


def window_attention(keys, queries, lengths, *, gqa: GqaReduce, softmax_keys: SoftmaxKeys):
    """Attention the last W queries pay to each older token, averaged over the W queries.

    keys:    [rows, kv_heads, N, d] (post-RoPE), slots >= lengths[row] are padding
    queries: [rows, q_heads, W, d], the queries of each row's W newest cached tokens
    gqa:     "max" -> max over the g query heads of a KV head on the raw logits, before the
             softmax (R-KV's rule); "mean" -> one softmax per query head (reduced later by
             `reduce_group`, after pooling)
    softmax_keys: "older" -> softmax over the row's L - W older tokens only (R-KV);
             "causal" -> softmax over all L tokens with a causal mask inside the window, then
             the window columns are dropped (the original SnapKV)
    returns: [rows, kv_heads, G, N] float32 with G = 1 ("max") or g ("mean"); zero outside
             each row's older region [0, L - W)
    """
    rows, kv_heads, n, d = keys.shape
    q_heads, w = queries.shape[1], queries.shape[2]
    g = q_heads // kv_heads
    q = queries.float().reshape(rows, kv_heads, g * w, d)
    logits = torch.matmul(q, keys.float().transpose(-1, -2)) / math.sqrt(d)  # [rows, kv, g*W, N]
    logits = logits.view(rows, kv_heads, g, w, n)
    if gqa == "max":
        logits = logits.amax(dim=2, keepdim=True)
    slot = torch.arange(n, device=keys.device)
    older_end = (lengths.to(keys.device) - w)[:, None]  # [rows, 1]: first slot of the window
    older = slot[None, :] < older_end  # [rows, N]
    if softmax_keys == "older":
        allowed = older[:, None, :]  # [rows, 1, N]
    else:  # query i sits at slot L - W + i and sees every slot up to itself
        qpos = older_end + torch.arange(w, device=keys.device)[None, :]  # [rows, W]
        allowed = slot[None, None, :] <= qpos[:, :, None]  # [rows, W, N]
    logits = logits.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(dim=3)  # [rows, kv, G, N]; L <= W rows: 0
    return probs * older[:, None, None, :]


def pool(x, pooling: Pooling, kernel: int):
    """Smooth scores along the token axis (stride 1, padding kernel // 2, same length).

    x: [..., N], zero outside the region being pooled. Zero padding equals the references'
    padding here: avg_pool1d counts its zero padding (count_include_pad), and max_pool1d's
    -inf padding never wins over a window's own non-negative centre.
    """
    if pooling == "none" or kernel <= 1:
        return x
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1])
    fn = torch.nn.functional.max_pool1d if pooling == "max" else torch.nn.functional.avg_pool1d
    return fn(flat, kernel_size=kernel, stride=1, padding=kernel // 2).reshape(shape)


def reduce_group(x):
    """[rows, kv_heads, G, N] -> [rows, kv_heads, N] by the mean over the query heads of a KV head."""
    return x.mean(dim=2)


def attention_signal(keys, queries, lengths, *, gqa: GqaReduce, softmax_keys: SoftmaxKeys, pooling: Pooling,
                     kernel: int):
    """SnapKV-style importance: [rows, kv_heads, N] float32, zero outside the older region."""
    att = window_attention(keys, queries, lengths, gqa=gqa, softmax_keys=softmax_keys)
    att = pool(att, pooling, kernel)
    w = queries.shape[2]
    older = torch.arange(keys.shape[2], device=keys.device)[None, :] < (lengths.to(keys.device) - w)[:, None]
    return reduce_group(att) * older[:, None, :]


def row_uniforms(generators, lengths, kv_heads: int, n: int, device):
    """Uniform(0, 1) draws [rows, kv_heads, N]: row r draws [kv_heads, lengths[r]] from its own
    generator (so its numbers do not depend on the batch), zeros elsewhere."""
    out = torch.zeros(len(generators), kv_heads, n, dtype=torch.float32)
    for r, (length, gen) in enumerate(zip(lengths.tolist(), generators)):
        out[r, :, :length] = torch.rand(kv_heads, length, generator=gen)
    return out.to(device)


def valid_slots(lengths, n: int, device):
    """[rows, N] bool: slot < lengths[row]."""
    return torch.arange(n, device=device)[None, :] < lengths.to(device)[:, None]


def odd_kernel(value: int) -> int:
    """Pydantic field validator: pooling kernels must be odd to keep the token axis length."""
    if value % 2 == 0:
        raise ValueError(f"kernel must be odd (got {value})")
    return value
