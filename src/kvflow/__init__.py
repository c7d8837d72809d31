"""kvflow: step-level decoding pipelines for KV-cache eviction research (KV-Rescue and friends)."""

__version__ = "0.1.0"

# Plugins write `@kvflow.hookimpl`; this imports only pluggy (no torch).
from kvflow.hookspecs import hookimpl  # noqa: E402

__all__ = ["__version__", "hookimpl"]
