"""Multi-token forwards in float32 arithmetic on CPUs whose bfloat16 matmuls are slow.

On CPUs without native bfloat16 instructions (AVX2-only x86, no AVX512-BF16/AMX) PyTorch's
bf16 GEMM runs at a fixed few GFLOP/s whatever the number of rows, while float32 GEMM
speeds up with more rows (measured on a 2-core AVX2 EPYC, one thread, [M, 896] x [896, 4864]:
bf16 5.4-7.5 GFLOP/s for M = 1..372, float32 4.3 at M = 1 but 27 at M = 64 and 40 at
M = 372). A forward of many tokens (prefill, ingesting a committed step, scoring candidate
steps) is then several times faster when each linear layer upcasts its input and weight to
float32, multiplies, and rounds the result back to bfloat16, at the cost of converting the
weight on every call (a memory pass). The weights stay bfloat16 in memory.

Numerics: CPU bf16 GEMMs accumulate in float32 and round the output to bf16, as this does;
results may differ from the bf16 kernel in the last bit (summation order). Decode steps of a
few rows are left alone: there the conversion costs more than it saves.

`fp32_min_tokens(model)` decides once per process, weight shape and torch thread count
whether this pays here: it times one linear layer both ways at 64 rows. `KVFLOW_CPU_FP32_MATMUL=0`
turns it off, `=1` turns it on without measuring. On a busy 2-core machine two torch threads
made the float32 GEMM 3-4x slower than one (the bf16 kernel did not care), so the measurement
there says no with two threads and yes with one (`OMP_NUM_THREADS=1`); see docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

MIN_TOKENS = 32  # rows x tokens of a forward from which linear layers upcast
_decisions: dict[tuple, bool] = {}


class _Fp32Linear(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16:
                out = F.linear(x.float(), w.float(), None if b is None else b.float())
                return out.to(torch.bfloat16)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fp32_linear(enabled: bool = True) -> Iterator[None]:
    """Within this context, bf16 `F.linear` calls compute in float32 (see the module docstring)."""
    if not enabled:
        yield
        return
    with _Fp32Linear():
        yield


def fp32_min_tokens(model: torch.nn.Module) -> Optional[int]:
    """Tokens per forward from which to upcast, or None to never (not CPU, not bf16, or not faster)."""
    setting = os.environ.get("KVFLOW_CPU_FP32_MATMUL", "auto").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return None
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.bfloat16:
        return None
    if setting in ("1", "true", "yes", "on"):
        return MIN_TOKENS
    weight = _largest_linear_weight(model)
    if weight is None:
        return None
    key = (tuple(weight.shape), torch.get_num_threads())
    if key not in _decisions:
        _decisions[key] = _upcast_is_faster(weight)
    return MIN_TOKENS if _decisions[key] else None


def _largest_linear_weight(model: torch.nn.Module) -> Optional[torch.Tensor]:
    best = None
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.bfloat16:
            if module.weight.shape[0] * module.weight.shape[1] >= 50_000_000:  # skip the LM head
                continue
            if best is None or module.weight.numel() > best.numel():
                best = module.weight
    return best


@torch.inference_mode()
def _upcast_is_faster(weight: torch.Tensor, rows: int = 64) -> bool:
    x = torch.randn(rows, weight.shape[1], dtype=torch.bfloat16)

    def best_of(fn, n=3):
        fn()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    native = best_of(lambda: F.linear(x, weight))
    upcast = best_of(lambda: F.linear(x.float(), weight.float()).to(torch.bfloat16))
    return upcast < 0.7 * native
