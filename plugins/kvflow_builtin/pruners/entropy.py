"""`entropy`: stops incoherent candidates (KV-Rescue's online detector).

Signal: the mean, over the candidate's last `window` tokens, of the per-token entropy
H = -Σ p log p (nats) over the full vocabulary of the *sampling* distribution, i.e. after
temperature and before top-p (what `kvflow.backends.hf.decode.sample` records). Incoherent
text under a partial cache forms a separate high-entropy mode, so one flat threshold works.
Flags a candidate once it has `min_tokens` tokens and the signal exceeds `threshold`.

Shapes: trace.entropies [rows, max_step_tokens], trace.n_tokens [rows] -> [rows] bool.
"""

from __future__ import annotations

from pydantic import Field

from kvflow._lazy import torch
from kvflow.components.base import Pruner, PrunerParams


class EntropyParams(PrunerParams):
    window: int = Field(32, ge=1, description="Tokens averaged.")
    threshold: float = Field(2.5, gt=0, description="Mean entropy (nats) above which a candidate is stopped.")
    min_tokens: int = Field(32, ge=1, description="No check before this many tokens.")


class EntropyPruner(Pruner):
    """Mean token entropy over the last `window` tokens above `threshold` (incoherence)."""

    Params = EntropyParams
    signal_name = "mean_entropy"

    def signal(self, trace):
        window = self.params.window
        counts = trace.n_tokens  # [rows]
        cols = torch.arange(trace.entropies.shape[1])[None, :]  # [1, T]
        in_window = (cols < counts[:, None]) & (cols >= (counts - window)[:, None])  # [rows, T]
        total = (trace.entropies * in_window).sum(-1)
        mean = total / in_window.sum(-1).clamp(min=1)
        return mean.masked_fill(counts < max(self.params.min_tokens, 1), float("nan"))

    def check(self, trace):
        return self.signal(trace) > self.params.threshold  # nan compares False
