"""Batch-invariant forwards on `hf`: a row's numbers do not depend on the rows beside it.

`run.deterministic` turns on torch's deterministic algorithms for the run; the `hf` engine
then runs every forward (prefill, decode, ingesting a step, scoring) so that each row is
computed from its own data with shapes of its own, bit for bit the same alone or among any
others (issue 49). What makes a plain batched forward batch-dependent, and what this does:

- **Linear layers.** A GEMM picks its blocking from the number of rows M (on a 2-core Xeon
  with AMX, bf16 [M, 1536] x [1536, 8960]: rows equal a row alone for M <= 32, 5 of 8 differ at
  M = 64). Here every linear layer runs in tiles of exactly `TILE_ROWS` rows (the last one
  padded with zeros), so each row goes through a GEMM of the same shape whatever the batch.
  That relies on a GEMM of one shape treating its rows alike wherever they sit (true of the
  CPU and cuBLAS kernels measured: row i's dot products do not depend on row j);
  `check_tiles` tries it at the first forward on the model's own weight shapes and refuses the
  run, loudly, where it does not hold. On CPUs that compute bf16 in float32
  (`kvflow.backends.hf.matmul`) every tile upcasts, decided from the CPU flags only.
- **Attention.** sdpa's kernels split the keys in blocks whose tails depend on the span of
  the batch (its longest row), so a padded row reduces differently from the same row alone.
  Here attention runs row by row over the row's own keys and real queries, always with an
  explicit boolean mask (`attend_rows`). So does an observing evictor's statistic (H2O).
- Norms, softmax and log-softmax reduce each row along its last dimension the same way
  whatever the batch (checked by the tests), and sampling draws counter-based numbers per row
  (`kvflow.backends.hf.sampling`): nothing to do.

Cost: row-by-row attention is one small call per row and layer, and a decode step of fewer
than `TILE_ROWS` rows pays for `TILE_ROWS` (docs/benchmarks.md#batch-invariant-hf).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from kvflow.errors import UserError

#: rows of every GEMM a linear layer runs in batch-invariant mode: a decode step of this many
#: rows or fewer is one tile (on a CPU decode reads the weights once whatever M, so the padding
#: costs arithmetic, not memory traffic); a prefill of P tokens runs ceil(P / TILE_ROWS) tiles
TILE_ROWS = 32


def enabled() -> bool:
    """Whether forwards are batch-invariant now: under torch's deterministic algorithms, which
    `run.deterministic` turns on for the run (`kvflow.runtime.core.torch_run_settings`)."""
    return torch.are_deterministic_algorithms_enabled()


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], upcast: bool) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed in GEMMs of exactly TILE_ROWS rows.
    x: [..., K]; weight: [N, K]; returns [..., N] in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)  # [M, K]
    m = flat.shape[0]
    pad = (-m) % TILE_ROWS
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, k)])
    if upcast:
        flat, weight = flat.float(), weight.float()
        bias = None if bias is None else bias.float()
    out = torch.cat([F.linear(tile, weight, bias) for tile in flat.split(TILE_ROWS)])[:m]  # [M, N]
    return out.to(x.dtype).reshape(*lead, -1)


class _TiledLinear(TorchFunctionMode):
    def __init__(self, upcast: bool) -> None:
        super().__init__()
        self.upcast = upcast

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            return tiled_linear(x, w, b, self.upcast and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16)
        return func(*args, **kwargs)


@contextlib.contextmanager
def tiles(upcast: bool) -> Iterator[None]:
    """Within this context every `F.linear` runs in TILE_ROWS-row tiles (upcast: in float32)."""
    with _TiledLinear(upcast):
        yield


def linear_tiles(model: torch.nn.Module):
    """The context a forward of `model` runs its linear layers under in batch-invariant mode:
    tiles (float32 where this CPU computes bf16 in float32, kvflow.backends.hf.matmul), after
    `check_tiles`; a null context when the mode is off."""
    if not enabled():
        return contextlib.nullcontext()
    from kvflow.backends.hf.matmul import fp32_min_tokens

    upcast = fp32_min_tokens(model) is not None
    check_tiles(model, upcast)
    return tiles(upcast)


_CHECKED: set = set()


@torch.inference_mode()
def check_tiles(model: torch.nn.Module, upcast: bool) -> None:
    """Tripwire: each distinct linear weight shape of `model`, one row computed at two places of
    two tiles with other neighbours, must give the same bits; else batch-invariant mode cannot
    hold on this device and kernel, and the run stops (UserError naming run.deterministic)."""
    device = next(model.parameters()).device
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Linear) or weight is None:
            continue
        key = (tuple(weight.shape), weight.dtype, str(device), upcast, torch.__version__)
        if key in _CHECKED:
            continue
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(2 * TILE_ROWS, weight.shape[1], generator=gen).to(device, weight.dtype)
        w = weight if not upcast else weight.float()
        first = F.linear(x[:TILE_ROWS].float() if upcast else x[:TILE_ROWS], w)[0]
        moved = x[TILE_ROWS:].clone()
        moved[TILE_ROWS - 1] = x[0]
        second = F.linear(moved.float() if upcast else moved, w)[TILE_ROWS - 1]
        if not torch.equal(first, second):
            raise UserError(
                f"run.deterministic: on {device} with torch {torch.__version__}, a matrix multiply of "
                f"{tuple(weight.shape)} {weight.dtype} weights gives a row different bits at another place of "
                f"the same-shaped call, so kvflow cannot make this model's forward batch-invariant here",
                "unset run.deterministic, or run in float32 (models.<key>.dtype: float32) and try again")
        _CHECKED.add(key)


def attend_rows(attention: Callable, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                queries: torch.Tensor, mask: torch.Tensor, ends: list[int], **kwargs) -> torch.Tensor:
    """Attention row by row, each over its own keys and real queries with a boolean mask.

    attention: transformers' sdpa forward; query: [rows, q_heads, T, D]; key, value: [rows,
    kv_heads, span, D]; queries: [rows] int64 (host) real queries per row (the first ones);
    mask: [rows, 1 or heads, T, span] bool, what each query may attend; ends: each row's keys
    (`key_ends`). Returns [rows, T, q_heads, D] (padding queries: 0).
    """
    rows, heads, width, dim = query.shape
    out = query.new_zeros(rows, width, heads, dim)
    for r in range(rows):
        t, s = int(queries[r]), ends[r]
        if t == 0:
            continue
        o, _ = attention(module, query[r : r + 1, :, :t], key[r : r + 1, :, :s], value[r : r + 1, :, :s],
                         mask[r : r + 1, :, :t, :s], **kwargs)
        out[r, :t] = o[0]
    return out


def observe_rows(cache, layer_idx: int, query: torch.Tensor, keys: torch.Tensor, queries: torch.Tensor,
                 ends: list[int], scaling: float) -> None:
    """An observing evictor's statistic (e.g. H2O's) updated row by row, each over its own keys
    and real queries. query: [rows, q_heads, T, D]; keys: [rows, kv_heads, span, D]."""
    stats, observe_mask = cache.layers[layer_idx].stats, cache.plan(layer_idx).observe_mask
    for r in range(query.shape[0]):
        t, s = int(queries[r]), ends[r]
        if t:
            cache.evictor.observe(stats[r : r + 1, :, :s], query[r : r + 1, :, :t], keys[r : r + 1, :, :s],
                                  observe_mask[r : r + 1, ..., :t, :s], layer_idx=layer_idx, scaling=scaling)


def key_ends(mask: torch.Tensor, queries: torch.Tensor) -> list[int]:
    """Per row, 1 + the last slot its last real query attends (0 for a row with no query): where
    the row's keys end, whatever the span of its batch.
    mask: [rows, heads or 1, T, span] bool; queries: [rows] int64 (host)."""
    ends = []
    for r in range(mask.shape[0]):
        t = int(queries[r])
        if t == 0:
            ends.append(0)
            continue
        seen = mask[r, :, t - 1].any(0).nonzero()
        ends.append(int(seen.max()) + 1 if len(seen) else 0)
    return ends


def causal_mask(lengths: torch.Tensor, queries: torch.Tensor, width: int, span: int) -> torch.Tensor:
    """[rows, 1, width, span] bool: query t of row r (appended after lengths[r] cached tokens)
    attends slots <= lengths[r] + t (the plain causal mask a write plan leaves out)."""
    key = torch.arange(span)
    t = torch.arange(width)
    return (key[None, None, :] <= (lengths[:, None, None] + t[None, :, None]))[:, None]
