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


def versions_line(versions: dict[str, str | None] | None = None) -> str:
    """e.g. "torch 2.14.1, transformers 5.24.0, sglang 0.5.23 (kvflow 0.1.0, Python 3.11.7)"."""
    v = versions or installed_versions()
    libs = ", ".join(f"{name} {v.get(name) or 'not installed'}" for name in DISTRIBUTIONS)
    return f"{libs} (kvflow {v['kvflow']}, Python {v['python']})"
