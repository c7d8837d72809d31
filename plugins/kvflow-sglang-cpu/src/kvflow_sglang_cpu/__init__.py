"""kvflow's out-of-tree SGLang platform for machines without a GPU (see README.md).

SGLang calls `activate()` (the `sglang.srt.platforms` entry point) in the engine and in each
process it spawns; it returns the dotted name of the platform class, or None where a CUDA
device is visible so that SGLang keeps its own CUDA platform.
"""

from __future__ import annotations

import os

PLATFORM = "kvflow_sglang_cpu.platform.NativeCpuPlatform"


def activate() -> str | None:
    """The platform's dotted name when SGLang should run on the CPU, else None."""
    if os.environ.get("KVFLOW_SGLANG_CPU") == "0":
        return None
    import torch  # already imported by SGLang when it asks

    return None if torch.cuda.is_available() else PLATFORM
