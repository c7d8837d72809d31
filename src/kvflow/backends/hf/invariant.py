"""Batch-invariant forwards on `hf`: a row's numbers do not depend on the rows beside it.

`run.deterministic` turns on torch's deterministic algorithms for the run; the `hf` engine
then runs every forward (prefill, decode, ingesting a step, scoring) so that each row is
computed from its own data with shapes of its own, bit for bit the same alone or among any
others (issue 49). What makes a plain batched forward batch-dependent, and what this does:

- **Linear layers.** A GEMM picks its blocking from the number of rows M (on a 2-core Xeon
  with AMX, bf16 [M, 1536] x [1536, 8960]: rows equal a row alone for M <= 32, 5 of 8 differ at
  M = 64). Here every linear layer runs in tiles of exactly T rows (the last one padded with
  zeros), so each row goes through a GEMM of the same shape whatever the batch. That relies
  on a GEMM of one shape treating its rows alike wherever they sit: true of the kernels
  measured, as long as T is a whole number of the kernel's row blocks (a last, partial block
  may be computed by another micro-kernel). `choose_tile` tries the candidates of
  `TILE_CANDIDATES` in order on the model's own weight shapes at the first forward and keeps
  the first under which a row gets the same bits at the first, a middle and the last place of
  two calls with other neighbours (the kernels decide, not a timing: the same machine always
  picks the same T), and refuses the run, loudly, where none does. On CPUs that compute bf16
  in float32 (`kvflow.backends.hf.matmul`) every tile upcasts, decided from the CPU flags only.
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
import weakref
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from kvflow.errors import UserError

#: rows of every GEMM a linear layer runs in batch-invariant mode, tried in this order
#: (`choose_tile`): a decode step of T rows or fewer is one tile (on a CPU decode reads the
#: weights once whatever M, so the padding costs arithmetic, not memory traffic); a prefill of P
#: tokens runs ceil(P / T) tiles. 48 and 96 are whole numbers of 6-, 8-, 12- and 16-row blocks
TILE_CANDIDATES = (32, 48, 64, 96, 16)
TILE_ROWS = TILE_CANDIDATES[0]  # the usual choice (a GEMM's tile where `choose_tile` keeps the first)


def enabled() -> bool:
    """Whether forwards are batch-invariant now: under torch's deterministic algorithms, which
    `run.deterministic` turns on for the run (`kvflow.runtime.core.torch_run_settings`)."""
    return torch.are_deterministic_algorithms_enabled()


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], upcast: bool,
                 rows: int = TILE_ROWS) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed in GEMMs of exactly `rows` rows.
    x: [..., K]; weight: [N, K]; returns [..., N] in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)  # [M, K]
    m = flat.shape[0]
    pad = (-m) % rows
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, k)])
    if upcast:
        flat, weight = flat.float(), weight.float()
        bias = None if bias is None else bias.float()
    out = torch.cat([F.linear(tile, weight, bias) for tile in flat.split(rows)])[:m]  # [M, N]
    return out.to(x.dtype).reshape(*lead, -1)


class _TiledLinear(TorchFunctionMode):
    def __init__(self, upcast: bool, rows: int) -> None:
        super().__init__()
        self.upcast, self.rows = upcast, rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            upcast = self.upcast and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            return tiled_linear(x, w, b, upcast, self.rows)
        return func(*args, **kwargs)


@contextlib.contextmanager
def tiles(upcast: bool, rows: int = TILE_ROWS) -> Iterator[None]:
    """Within this context every `F.linear` runs in `rows`-row tiles (upcast: in float32)."""
    with _TiledLinear(upcast, rows):
        yield


def linear_tiles(model: torch.nn.Module):
    """The context a forward of `model` runs its linear layers under in batch-invariant mode:
    tiles of `choose_tile`'s rows (float32 where this CPU computes bf16 in float32,
    kvflow.backends.hf.matmul), both decided at the model's first forward; a null context when
    the mode is off."""
    if not enabled():
        return contextlib.nullcontext()
    found = _TILES.get(model)
    if found is None:
        from kvflow.backends.hf.matmul import fp32_min_tokens

        upcast = fp32_min_tokens(model) is not None
        found = _TILES[model] = (upcast, choose_tile(model, upcast))
    return tiles(*found)


_TILES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (upcast, tile rows)
_CHOSEN: dict = {}  # (weight shapes, dtype, device, upcast, torch) -> the tile rows kept


def choose_tile(model: torch.nn.Module, upcast: bool) -> int:
    """The first of TILE_CANDIDATES under which every linear weight shape of `model` treats a
    row alike wherever it sits (`rows_alike`); a UserError naming run.deterministic where none
    does (batch-invariant forwards cannot hold on this device and kernel). Once per model shape."""
    device = next(model.parameters()).device
    linears: dict = {}  # (shape, dtype) -> one weight of it
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and getattr(m, "weight", None) is not None:
            linears.setdefault((tuple(m.weight.shape), m.weight.dtype), m.weight)
    key = (tuple(sorted(linears, key=str)), str(device), upcast, torch.__version__)
    if key not in _CHOSEN:
        rows = next((t for t in TILE_CANDIDATES if all(rows_alike(w, t, upcast) for w in linears.values())), None)
        if rows is None:
            raise UserError(
                f"run.deterministic: on {device} with torch {torch.__version__}, this model's matrix multiplies "
                f"give a row different bits at another place of a same-shaped call for every tile of "
                f"{', '.join(map(str, TILE_CANDIDATES))} rows, so kvflow cannot make its forward batch-invariant here",
                "unset run.deterministic, or run in float32 (models.<key>.dtype: float32) and try again")
        _CHOSEN[key] = rows
    return _CHOSEN[key]


@torch.inference_mode()
def rows_alike(weight: torch.Tensor, rows: int, upcast: bool) -> bool:
    """Whether one row multiplied by `weight` in a GEMM of `rows` rows gets the same bits at
    the first place of one call and at the middle and last places of two others, among other
    rows (random, seeded)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3 * rows, weight.shape[1], generator=gen).to(weight.device, weight.dtype)
    w = weight.float() if upcast else weight

    def product(t: torch.Tensor) -> torch.Tensor:
        return F.linear(t.float() if upcast else t, w)

    first = product(x[:rows])[0]
    for place, block in ((rows // 2, x[rows : 2 * rows]), (rows - 1, x[2 * rows :])):
        moved = block.clone()
        moved[place] = x[0]
        if not torch.equal(product(moved)[place], first):
            return False
    return True


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
    rows, span = mask.shape[0], mask.shape[-1]
    last = (queries - 1).clamp(min=0).to(mask.device)  # [rows] each row's last real query
    seen = mask[torch.arange(rows, device=mask.device), :, last].any(1)  # [rows, span]
    slot = torch.arange(1, span + 1, device=mask.device)
    ends = (seen * slot).amax(-1) if span else torch.zeros(rows, dtype=torch.long, device=mask.device)
    return torch.where(queries.to(mask.device) > 0, ends, 0).tolist()  # one read of the device


def causal_mask(lengths: torch.Tensor, queries: torch.Tensor, width: int, span: int) -> torch.Tensor:
    """[rows, 1, width, span] bool: query t of row r (appended after lengths[r] cached tokens)
    attends slots <= lengths[r] + t (the plain causal mask a write plan leaves out)."""
    key = torch.arange(span)
    t = torch.arange(width)
    return (key[None, None, :] <= (lengths[:, None, None] + t[None, :, None]))[:, None]
