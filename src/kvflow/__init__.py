"""kvflow: step-level decoding pipelines for KV-cache eviction research (KV-Rescue and friends)."""

__version__ = "0.1.0"
