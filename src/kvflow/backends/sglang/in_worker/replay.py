"""A CPU proxy for CUDA-graph replay of kvflow's attention hook, and an operator counter.

Why a proxy: on a CPU, SGLang resolves decode graphs off for `torch_native` attention by itself,
so an evicting engine never replays a graph here, and hooks that would be silently wrong under
replay pass every CPU test. `KVFLOW_SGLANG_REPLAY_PROXY=1` (read in the scheduler process) runs
kvflow's part of each decode layer the way a replayed CUDA graph does:

- **capture**: the first decode forward of a batch-size bucket traces the hook's function with
  `make_fx` on SGLang's capture inputs (zero `req_pool_indices`, `seq_lens` of 1, zero queries)
  while kvflow's Python state says "no kvflow rows" -- what SGLang's graph runner sees at engine
  start. Tracing records the aten ops the function dispatched, baking every Python branch and
  scalar, exactly what stream capture bakes; a host sync (`.item()`, `bool(tensor)`) fails the
  trace, as it fails a capture.
- **replay**: every later decode forward of that bucket runs the traced graph on its inputs
  padded to the bucket (as SGLang pads to its captured sizes), on the same table tensors (a
  traced graph holds them by reference: static buffers). None of the hook's Python runs.

Buckets are SGLang 0.5.23's own decode capture sizes (`generate_decode_cuda_graph_batch_sizes`,
asked for the largest default `max_bs` SGLang resolves on a datacenter GPU: 512 with tp >= 4;
`KVFLOW_SGLANG_REPLAY_MAX_BS` changes it): 1, 2, 4, 8, 12, 16..256 by 8, 272..512 by 16;
larger batches run the hook eagerly, as SGLang runs them without a graph. `replays_by_bucket`
counts replays per size, so a test can require each to run more than once with the host
rewriting the tables between replays. The attention
backend itself (`torch_native`, Python per request) runs eagerly: SGLang's GPU backends are
capturable by construction; only kvflow's part is under test.

`KVFLOW_SGLANG_COUNT_OPS=1` counts the aten operators each decode forward dispatches (a
`TorchDispatchMode` around `ModelRunner.forward`: on a GPU, about one kernel launch each), in
all and inside kvflow's attention hook, read back through `server_state()["op_counts"]`.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

MAX_BS = int(os.environ.get("KVFLOW_SGLANG_REPLAY_MAX_BS", "512") or 512)


def capture_sizes(max_bs: int = MAX_BS) -> tuple[int, ...]:
    """SGLang's decode capture sizes for `max_bs` (its own function where SGLang is installed;
    the same list, as read from SGLang 0.5.23, where it is not)."""
    try:
        from types import SimpleNamespace

        from sglang.srt.arg_groups.cuda_graph_hook import generate_decode_cuda_graph_batch_sizes

        sizes = generate_decode_cuda_graph_batch_sizes(
            SimpleNamespace(disable_cuda_graph_padding=False, speculative_algorithm=None), max_bs)
    except ImportError:
        sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
        sizes = [b for b in sizes if b <= max_bs] + ([max_bs] if max_bs not in sizes else [])
    return tuple(sorted(set(sizes)))


BUCKETS = capture_sizes()


def bucket(bs: int) -> Optional[int]:
    return next((b for b in BUCKETS if b >= bs), None)


class ReplayProxy:
    """Traced-once, replayed-after kvflow hooks, per (bucket, layer)."""

    def __init__(self) -> None:
        self.graphs: dict[tuple, Callable] = {}
        self.captures = 0
        self.replays = 0
        self.replays_by_bucket: dict[int, int] = {}

    def run(self, key, fn: Callable, q: torch.Tensor, out: torch.Tensor, req_pool_indices: torch.Tensor,
            seq_lens: torch.Tensor, capturing: Callable) -> torch.Tensor:
        """fn(q, out, req_pool_indices, seq_lens) -> out, as a graph would run it. `capturing`
        is a context manager that puts kvflow's Python state into its capture-time shape."""
        from torch.fx.experimental.proxy_tensor import make_fx

        bs = q.shape[0]
        b = bucket(bs)
        if b is None:
            return fn(q, out, req_pool_indices, seq_lens)  # past the largest captured size: eager
        graph = self.graphs.get((b, key))
        if graph is None:
            dummy = (q.new_zeros((b, *q.shape[1:])), out.new_zeros((b, *out.shape[1:])),
                     req_pool_indices.new_zeros(b), seq_lens.new_ones(b))
            with capturing():
                graph = self.graphs[(b, key)] = make_fx(fn)(*dummy)
            self.captures += 1
        pad = b - bs
        args = (q, out, req_pool_indices, seq_lens)
        if pad:
            args = (torch.cat([q, q.new_zeros((pad, *q.shape[1:]))]), torch.cat([out, out.new_zeros((pad, *out.shape[1:]))]),
                    torch.cat([req_pool_indices, req_pool_indices.new_zeros(pad)]),
                    torch.cat([seq_lens, seq_lens.new_ones(pad)]))
        self.replays += 1
        self.replays_by_bucket[b] = self.replays_by_bucket.get(b, 0) + 1
        result = graph(*args)
        return result[:bs] if pad else result


def proxy_from_env() -> Optional[ReplayProxy]:
    return ReplayProxy() if os.environ.get("KVFLOW_SGLANG_REPLAY_PROXY") == "1" else None


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts aten operators dispatched; `hook` counts those inside kvflow's hook."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.hook = 0
        self.in_hook = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        self.hook += self.in_hook
        return func(*args, **(kwargs or {}))
