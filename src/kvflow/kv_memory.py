"""Bytes of KV cache one sequence holds under an evictor: the accounting shared by the cache
(which allocates exactly this), `kvflow explain`, results and `budget_bytes` conversion, and
admission by KV memory (`run.kv_memory`: `parse_bytes`, `RowCost`, `KVBudget`, at the end).

Everything is per sequence, summed over layers and KV heads, from the model's shape and
dtype alone (no torch). With `quantize` (BreadthKV / KIVI style, `kvflow.backends.hf.quant`)
the `budget` kept tokens split into a quantized part of whole key groups and a
full-precision residual:

    n_quantized = floor((budget - residual) / group_size) * group_size
    per quantized token and KV head = 2 * bits * head_dim / 8            (packed K and V codes)
                                    + 2 * head_dim * s / group_size      (K scale+zero, per channel per group)
                                    + 2 * (head_dim / group_size) * s    (V scale+zero, per token per group)
    per full-precision token and KV head = 2 * head_dim * s              (K and V)

with s the bytes of the cache dtype (scales and zero points are stored in it). The peak adds
`buffer` full-precision tokens (appended between compactions) and one scratch slot that
padded batch writes land in.

Varying allocations (PyramidKV, Ada-KV; `Evictor.layer_widths`) keep the same total after a
compaction (layer budgets sum to budget x layers, a layer's heads to kv_heads x its budget),
but the dense cache stores each layer at its widest: `widths[l] + 1` slots per KV head. With
`quantize` (per-layer budgets only) each layer splits its own budget as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}


@dataclass(frozen=True)
class KVLayout:
    """How one sequence's cache is laid out and what it costs."""

    budget: int  # tokens kept after a compaction (the mean per layer when layers have their own)
    n_quantized: int  # of which quantized (per layer; the first layer's when layers have their own)
    buffer: int
    kept_bytes: int  # bytes after a compaction (what budget_bytes bounds)
    peak_bytes: int  # bytes allocated per sequence (kept + buffer + scratch slot)
    layer_budgets: Optional[tuple[int, ...]] = None  # per layer, when the allocation varies

    @property
    def residual(self) -> int:
        return self.budget - self.n_quantized


def n_quantized(budget: int, quantize: Any) -> int:
    if quantize is None:
        return 0
    return max(0, (budget - quantize.residual) // quantize.group_size * quantize.group_size)


def full_token_bytes(head_dim: int, elem: int) -> int:
    """Keys and values of one token, one layer, one KV head, at full precision."""
    return 2 * head_dim * elem


def quantized_token_bytes(head_dim: int, elem: int, quantize: Any) -> float:
    """Keys and values of one quantized token, one layer, one KV head, scales included (the
    per-channel key scales of a group are shared by its `group_size` tokens)."""
    bits, g = quantize.bits, quantize.group_size
    codes = 2 * bits * head_dim / 8
    key_scales = 2 * head_dim * elem / g
    value_scales = 2 * (head_dim // g) * elem
    return codes + key_scales + value_scales


def layout(params: Any, n_layers: int, n_kv_heads: int, head_dim: int, elem: int,
           budget: Optional[int] = None, evictor: Any = None) -> KVLayout:
    """The layout of an evictor's params (`budget` overrides params.budget). `evictor`: the
    Evictor itself, for allocations that vary by layer or head (`Evictor.varies`): its
    per-layer budgets and widths (`layer_widths`) then give the bytes."""
    budget = params.budget if budget is None else budget
    q = getattr(params, "quantize", None)
    fp = full_token_bytes(head_dim, elem)
    quant = quantized_token_bytes(head_dim, elem, q) if q is not None else 0
    if evictor is not None and evictor.varies(n_layers):
        budgets = evictor.allocation(n_layers)
        widths = evictor.layer_widths(n_layers, n_kv_heads)
        kept = peak = 0.0
        for b, w in zip(budgets, widths):
            nq = n_quantized(b, q)
            kept += n_kv_heads * (nq * quant + (b - nq) * fp)
            peak += n_kv_heads * (nq * quant + (w - nq + 1) * fp)  # the layer's widest head + buffer + scratch
        return KVLayout(budget, n_quantized(budgets[0], q), params.buffer, int(round(kept)), int(round(peak)),
                        tuple(budgets))
    nq = n_quantized(budget, q)
    heads = n_layers * n_kv_heads
    kept = heads * (nq * quant + (budget - nq) * fp)
    peak = kept + heads * (params.buffer + 1) * fp
    return KVLayout(budget, nq, params.buffer, int(round(kept)), int(round(peak)))


def budget_for_bytes(params: Any, n_layers: int, n_kv_heads: int, head_dim: int, elem: int,
                     evictor_cls: Any = None) -> int:
    """The largest token budget whose kept bytes fit in params.budget_bytes (`evictor_cls`:
    the evictor's class, whose allocation may split a quantized budget per layer)."""
    target = params.budget_bytes
    fp_per_token = n_layers * n_kv_heads * full_token_bytes(head_dim, elem)
    hi = max(1, target // fp_per_token)
    if params.quantize is not None:  # quantized tokens are cheaper: search above the full-precision count
        per_q = n_layers * n_kv_heads * quantized_token_bytes(head_dim, elem, params.quantize)
        hi = max(hi, int(target // per_q) + 1)
    # not a binary search: with quantization the kept bytes are a sawtooth in the budget (one
    # more token can complete a key group and move group_size tokens to low precision)
    for budget in range(hi, 0, -1):
        evictor = None
        if evictor_cls is not None and params.quantize is not None:
            try:
                evictor = evictor_cls(params.with_budget(budget))
                evictor.varies(n_layers)
            except ValueError:  # a budget the other parameters (or the allocation) do not fit in
                continue
        if layout(params, n_layers, n_kv_heads, head_dim, elem, budget=budget, evictor=evictor).kept_bytes <= target:
            return budget
    raise ValueError(f"budget_bytes {target} holds less than one token ({fp_per_token} bytes per token)")


def resolve_evictor(cls: Any, params: Any, n_layers: int, n_kv_heads: int, head_dim: int, elem: int):
    """An evictor for a model of this shape: (params with any `budget_bytes` turned into its token
    budget, the evictor built from them), its allocation for `n_layers` checked; ValueError
    saying what does not fit (too few bytes, budgets the model's layers cannot hold). The one
    way kvflow resolves an evictor for a model (compile, explain, engines' decode profiles)."""
    if getattr(params, "budget_bytes", None) is not None:
        params = params.with_budget(budget_for_bytes(params, n_layers, n_kv_heads, head_dim, elem, evictor_cls=cls))
    evictor = cls(params)
    if getattr(evictor, "bounded", True):
        evictor.allocation(n_layers)
    return params, evictor


# --------------------------------------------------------------------------- run.kv_memory: admission by bytes

#: `run.kv_memory: auto` on a CPU: this fraction of the RAM available when the engines have loaded
AUTO_CPU_FRACTION = 0.5
#: `run.kv_memory: auto` on a GPU: this fraction of the device memory free after the weights loaded
AUTO_GPU_FRACTION = 0.9

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: Any) -> int:
    """A byte size: an int, or a string like `2GiB`, `512MiB`, `1.5GB`, `4096` (binary units
    KiB/MiB/GiB/TiB, decimal kB/MB/GB/TB; case and a space before the unit do not matter).
    ValueError saying what is accepted otherwise."""
    import re

    if isinstance(value, bool):
        raise ValueError("a byte size, not a boolean")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{value} bytes: a KV memory must be at least 1 byte")
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{value!r} is not a byte size: give bytes (an int) or a number with a unit "
                         "(KiB, MiB, GiB, TiB or kB, MB, GB, TB), e.g. 2GiB, or `auto`")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n < 1:
        raise ValueError(f"{value!r} is less than one byte")
    return n


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


@dataclass(frozen=True)
class RowCost:
    """What one proposer's KV rows of one problem cost under `run.kv_memory`.

    A problem holds `rows` = n candidate rows + its own state on each proposer. An evicted row
    costs what the cache allocates for it (`KVLayout.peak_bytes`: budget + buffer + a scratch
    slot, whatever the sequence length); a full-context row costs what it can grow to: its
    prompt + `limits.max_tokens` + the pending token, at `token_bytes` each (a candidate row
    never outgrows it: a step is cut at the trajectory's token room)."""

    name: str
    rows: int
    token_bytes: int  # K and V of one token, every layer and KV head
    evicted_bytes: Optional[int] = None  # bytes of one evicted row; None: a full-context row

    def row_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        if self.evicted_bytes is not None:
            return self.evicted_bytes
        return (prompt_tokens + max_tokens + 1) * self.token_bytes

    def problem_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        return self.rows * self.row_bytes(prompt_tokens, max_tokens)


@dataclass(frozen=True)
class KVBudget:
    """`run.kv_memory` resolved: `bound` bytes for the rows of every problem in flight, each
    problem reserved at admission for what its rows can grow to (`RowCost`) and released when
    it ends, so the bytes accounted never exceed the bound."""

    bound: int
    costs: tuple[RowCost, ...]
    max_tokens: int

    def problem_bytes(self, prompt_tokens: dict[str, int]) -> int:
        """Bytes one problem reserves, given its prompt's length in each proposer's tokens."""
        return sum(c.problem_bytes(prompt_tokens.get(c.name, 0), self.max_tokens) for c in self.costs)

    def smallest_problem(self) -> int:
        """Bytes of a problem with an empty prompt: no problem reserves less."""
        return self.problem_bytes({})

    def problems_that_fit(self, prompt_tokens: Optional[dict[str, int]] = None) -> int:
        """Problems in flight at once at this bound, each with a prompt of `prompt_tokens`."""
        return self.bound // max(1, self.problem_bytes(prompt_tokens or {}))


KV_HINT = "raise run.kv_memory, or lower limits.max_tokens / n / the evictors' budget (`kvflow explain` shows the bytes)"


def kv_refusal(budget: KVBudget, needed: int, what: str) -> str:
    """Why a problem cannot run under `budget` (the message of a refusal naming run.kv_memory)."""
    parts = ", ".join(f"{c.name} {c.rows} rows" for c in budget.costs)
    return (f"one problem alone needs {needed} bytes ({human_bytes(needed)}; {parts}) {what}, more than "
            f"run.kv_memory {budget.bound} bytes ({human_bytes(budget.bound)})")


def row_cost(name: str, n: int, params: Any, n_layers: int, n_kv_heads: int, head_dim: int, elem: int,
             evictor: Any = None) -> RowCost:
    """The `RowCost` of a proposer with `n` candidates whose evictor has `params` (`evictor`:
    the Evictor, None or unbounded for a full cache; its allocation may vary by layer)."""
    token = n_layers * n_kv_heads * full_token_bytes(head_dim, elem)
    if evictor is None or not getattr(evictor, "bounded", False):
        return RowCost(name, n + 1, token)
    lay = layout(params, n_layers, n_kv_heads, head_dim, elem, evictor=evictor)
    return RowCost(name, n + 1, token, lay.peak_bytes)


def auto_kv_memory(device: str) -> tuple[int, str]:
    """(bytes, how) for `run.kv_memory: auto` on `device` once the engines have loaded: on a
    CUDA device AUTO_GPU_FRACTION of its free memory, else AUTO_CPU_FRACTION of the RAM the
    kernel reports available (MemAvailable)."""
    if str(device).startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free * AUTO_GPU_FRACTION), f"{AUTO_GPU_FRACTION:g} x {human_bytes(free)} free on {device}"
    available = mem_available()
    return int(available * AUTO_CPU_FRACTION), f"{AUTO_CPU_FRACTION:g} x {human_bytes(available)} RAM available"


def mem_available() -> int:
    import os

    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
