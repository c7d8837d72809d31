"""`NativeCpuPlatform`: SGLang's CPU device operations with pure-torch kernels.

It is SGLang's own CPU platform with three differences: it is an out-of-tree platform (so
SGLang takes it without `SGLANG_USE_CPU_ENGINE`, whose path needs a CPU build of
`sgl_kernel`), fused ops dispatch to their `forward_native` (pure torch), and attention
defaults to the `torch_native` backend.
"""

from __future__ import annotations

from sglang.srt.platforms.cpu import CpuSRTPlatform
from sglang.srt.platforms.device_mixin import PlatformEnum


class NativeCpuPlatform(CpuSRTPlatform):
    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"

    def get_dispatch_key_name(self) -> str:
        return "native"

    def get_default_attention_backend(self) -> str:
        return "torch_native"
