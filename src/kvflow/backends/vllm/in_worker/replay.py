"""A CPU proxy for CUDA-graph replay of kvflow's part of vLLM's attention (`KVFLOW_VLLM_REPLAY_PROXY=1`).

On a GPU, vLLM captures the decode forward in CUDA graphs at engine start (its dummy batches:
no kvflow request) and replays them afterwards: the Python of kvflow's attention hook then runs
once per captured size, never again. On a CPU vLLM captures nothing, so a hook that decides in
Python which tokens are kvflow's would pass every CPU test and be silently wrong on a GPU. Under
this proxy the capturable part of the hook (`blocks.InBlocks.write_ring`, H2O's statistic
`statistic.StatTable.accumulate`) runs as a replayed graph: traced once per (op, layer,
token-count bucket) with `make_fx` while kvflow's Python state is as at capture (no plan, no
evicted row: `capturing()`; tracing runs the ops, as capturing does not), then only the trace runs, on its inputs padded to the
bucket (as vLLM pads to its capture sizes), on the same table tensors (a trace holds them by
reference, as a graph holds its static buffers). A host sync in the hook fails the trace as it
fails a capture. The buckets are vLLM's default capture sizes (1, 2, 4, then multiples of 8 up
to 512); larger steps run eagerly, as vLLM runs them without a graph.

The rest of kvflow's work on vLLM is host side between forwards (metadata written into vLLM's
persistent buffers, compaction), eager by vLLM's own choice (a row's several tokens in one
step: a prompt or chunk, which vLLM never replays from a full graph), or refused under graphs
(an evictor's own `observe()`, budgets that vary by head or layer): `evict.Runtime.refusal`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Optional

import torch

BUCKETS = (1, 2, 4, *range(8, 513, 8))


def bucket(tokens: int) -> Optional[int]:
    return next((b for b in BUCKETS if b >= tokens), None)


class ReplayProxy:
    """Traced-once, replayed-after calls of a hook, per (key, bucket)."""

    def __init__(self) -> None:
        self.graphs: dict[tuple, Callable] = {}
        self.captures = 0
        self.replays = 0

    def run(self, key, fn: Callable, q: torch.Tensor, capturing: Callable = contextlib.nullcontext):
        """fn(q) as a replayed graph runs it; `capturing()` puts kvflow's Python state as at capture."""
        from torch.fx.experimental.proxy_tensor import make_fx

        t = q.shape[0]
        b = bucket(t)
        if b is None:
            return fn(q)
        graph = self.graphs.get((key, b))
        if graph is None:
            with capturing():
                graph = self.graphs[(key, b)] = make_fx(fn)(q.new_zeros((b, *q.shape[1:])))
            self.captures += 1
        self.replays += 1
        padded = torch.cat([q, q.new_zeros((b - t, *q.shape[1:]))]) if b > t else q
        return graph(padded)


def proxy_from_env() -> Optional[ReplayProxy]:
    return ReplayProxy() if os.environ.get("KVFLOW_VLLM_REPLAY_PROXY") == "1" else None
