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

`fp32_min_tokens(model)` decides from the CPU's instruction set, not from a timing, so the
same machine always computes the same way (a timing would make the numerics, hence sampled
tokens, depend on how busy the machine was): upcast on x86 CPUs without native bfloat16
matmul (no `avx512_bf16` / `amx_bf16` in /proc/cpuinfo), never elsewhere.
`KVFLOW_CPU_FP32_MATMUL=0` turns it off, `=1` turns it on. On a busy 2-core machine two torch
threads made the float32 GEMM 3-4x slower than one (the bf16 kernel did not care), so use
one thread there (`OMP_NUM_THREADS=1`); see docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

MIN_TOKENS = 32  # rows x tokens of a forward from which linear layers upcast


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
    """Tokens per forward from which to upcast, or None to never (not CPU, not bf16, or a CPU with native bf16)."""
    setting = os.environ.get("KVFLOW_CPU_FP32_MATMUL", "auto").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return None
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.bfloat16:
        return None
    if setting in ("1", "true", "yes", "on"):
        return MIN_TOKENS
    return MIN_TOKENS if _cpu_lacks_bf16_matmul() else None


def _cpu_lacks_bf16_matmul() -> bool:
    """True on x86 CPUs without AVX512-BF16 or AMX-BF16 (where PyTorch's bf16 GEMM is slow)."""
    try:
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    except OSError:
        return False
    return "avx2" in flags.split() and not ({"avx512_bf16", "amx_bf16"} & set(flags.split()))
