"""The versions kvflow runs on (kvflow, Python, torch, transformers, SGLang), read from the
installed distributions' metadata: nothing heavy is imported. `kvflow run` prints them at its
start and records them in `manifest.json`; `kvflow explain` prints them too."""

from __future__ import annotations

import importlib.metadata
import platform

import kvflow

#: the distributions whose versions change what a run computes
DISTRIBUTIONS = ("torch", "transformers", "sglang")


def installed_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"kvflow": kvflow.__version__, "python": platform.python_version()}
    for name in DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


#: CPU flags that decide how bf16 matrix multiplies round here (kvflow.backends.hf.matmul),
#: best first: runs on CPUs that differ in these may differ at the last bit, hence in tokens
BF16_MATMUL_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu() -> dict[str, str | int | None]:
    """The CPU a run computes on (`manifest.json` `cpu`): its model name, logical cores, and
    which native bf16 matrix instructions it has (`amx_bf16`, `avx512_bf16`, or None: bf16 is
    computed in float32 there), from /proc/cpuinfo (None fields elsewhere)."""
    import os

    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if model is None and line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif not flags and line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                if model and flags:
                    break
    except OSError:
        pass
    bf16 = next((f for f in BF16_MATMUL_FLAGS if f in flags), None)
    return {"model": model or platform.processor() or platform.machine() or None, "cores": os.cpu_count(),
            "bf16_matmul": bf16}


def versions_line(versions: dict[str, str | None] | None = None) -> str:
    """e.g. "torch 2.14.1, transformers 5.24.0, sglang 0.5.23 (kvflow 0.1.0, Python 3.11.7)"."""
    v = versions or installed_versions()
    libs = ", ".join(f"{name} {v.get(name) or 'not installed'}" for name in DISTRIBUTIONS)
    return f"{libs} (kvflow {v['kvflow']}, Python {v['python']})"
