"""`gzip`: stops looping candidates (KV-Rescue's online detector).

Signal: compression ratio len(zlib.compress(w, 9)) / len(w) of the last `window` characters
w (UTF-8 bytes) of the candidate's text. Loops are confident (low entropy) but compress
extremely well; lower means more repetitive. The codec is raw zlib (DEFLATE with a 2-byte
header and 4-byte checksum, level 9) rather than gzip's ~18-byte framing, which skews short
windows; the check starts once the candidate has `min_tokens` tokens and at least
`min_chars` characters, and runs every `every` tokens to stay cheap.

Shapes: trace.texts (rows strings), trace.n_tokens [rows] -> [rows] bool.
"""

from __future__ import annotations

import zlib

from pydantic import Field

from kvflow._lazy import torch
from kvflow.components.base import Pruner, PrunerParams


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(zlib.compress(data, 9)) / max(1, len(data))


class GzipParams(PrunerParams):
    window: int = Field(256, ge=16, description="Characters of text compressed.")
    threshold: float = Field(0.25, gt=0, description="Compression ratio below which a candidate is stopped.")
    min_tokens: int = Field(32, ge=1, description="No check before this many tokens.")
    min_chars: int = Field(128, ge=16, description="No check before the text has this many characters.")
    every: int = Field(8, ge=1, description="Check every this many tokens.")


class GzipPruner(Pruner):
    """zlib compression ratio of the last `window` characters below `threshold` (repetition)."""

    Params = GzipParams
    signal_name = "compression_ratio"

    def signal(self, trace):
        p = self.params
        out = []
        for text, count in zip(trace.texts, trace.n_tokens.tolist()):
            ready = count >= p.min_tokens and len(text) >= p.min_chars
            out.append(compression_ratio(text[-p.window:]) if ready else float("nan"))
        return torch.tensor(out, dtype=torch.float32)

    def check(self, trace):
        due = (trace.n_tokens % self.params.every) == 0
        if not bool(due.any()):
            return torch.zeros_like(due)
        return (self.signal(trace) < self.params.threshold) & due
