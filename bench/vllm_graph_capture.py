"""kvflow's part of vLLM's attention forward under a real CUDA graph (no vLLM needed): prepared
for `bench/gpu_check.sh vllm_graphs`, the GPU counterpart of tests/test_vllm_replay.py.

For uniform budgets kvflow's ops inside vLLM's forward are the query ring write
(`kvflow.backends.vllm.in_worker.blocks.InBlocks.write_ring`) and H2O's statistic
(`statistic.StatTable.accumulate`, over a FLASH_ATTN-layout KV cache of random blocks). Both
are captured with `torch.cuda.graph` the way vLLM captures a decode batch -- warm-ups, then the
capture, with no kvflow request in the batch (every token mapped to the ring's sink row 0,
every statistic entry the sink's) -- for each layer of a 4-layer, 7B-like shape (28 query
heads, 4 KV heads, head_dim 128, bf16) at a capture size. Then the host admits evicted
requests (token maps and statistic entries written in place between forwards, as
`InBlocks.prepared` writes them), new queries are copied into the static input, and the graph
is replayed for three steps; the ring and the statistic are compared with an eager run on a
copy. Prints one JSON line; exit 1 when they differ.

    PYTHONPATH=src:plugins python bench/vllm_graph_capture.py [--bs 64]
    PYTHONPATH=src:plugins python bench/vllm_graph_capture.py --cpu   # the same on a CPU, make_fx for the graph
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, default=64, help="the capture size (tokens per forward)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cpu", action="store_true", help="check the script itself without a GPU (make_fx trace)")
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    from kvflow.backends.vllm.in_worker.blocks import InBlocks, Paged

    dev, dtype = torch.device("cpu" if args.cpu else "cuda"), torch.bfloat16
    layers, q_heads, kv_heads, d, bs, rows = args.layers, 28, 4, 128, args.bs, 16
    block, blocks, span = 16, 64, 64  # FLASH_ATTN's block size; the pool; S: rows of up to 64 slots
    gen = torch.Generator(device="cpu").manual_seed(0)
    caches = [torch.randn(blocks, kv_heads, block, 2 * d, generator=gen).to(dev, dtype) for _ in range(layers)]

    def fresh():
        b = InBlocks(window=32, rows=rows, span=span)
        b.ensure_tables(layers, q_heads, kv_heads, d, dtype, dev)
        b.paged, b.block_size = Paged(caches, "split", block), block
        b.table.fixed = True  # as under vLLM's graphs: a forward reads its first min(T, E + 1) entries
        return b

    graphed, eager = fresh(), fresh()
    q = torch.zeros(bs, q_heads * d, device=dev, dtype=dtype)  # the static input, as vLLM's graph runner keeps it

    def forward(b, q_):
        for lid in range(layers):
            b.write_ring(lid, q_)
            b.table.accumulate(lid, q_, b.paged, q_heads, d ** -0.5)

    if args.cpu:
        from torch.fx.experimental.proxy_tensor import make_fx

        traced = make_fx(lambda q_: forward(graphed, q_))(q)

        def replay():
            traced(q)
    else:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward(graphed, q)
        torch.cuda.current_stream().wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            forward(graphed, q)
        replay = cuda_graph.replay
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rng = torch.Generator(device="cpu").manual_seed(1)
    times = []
    for step in range(3):  # the host admits requests: each token its ring row and position, between forwards
        n_tokens = bs - 3 * step  # fewer tokens than the capture size: the rest padded (row 0)
        # each (row, position) written by one token at most, as `InBlocks.prepared` maps them (two
        # tokens on one place would leave the result to the kernel's write order)
        place = torch.randperm(rows * 32, generator=rng)[:bs]
        tok_row, tok_pos = 1 + place // 32, place % 32
        tok_row[n_tokens:] = 0
        observed = [(t, int(tok_row[t]), int(torch.randint(1, span + 1, (1,), generator=rng)),
                     torch.randperm(blocks, generator=rng)[: span // block].tolist())
                    for t in range(0, min(n_tokens, rows), 2)]  # every other token's row observes (H2O)
        for b in (graphed, eager):
            b.tok_row[:bs].copy_(tok_row.to(dev))
            b.tok_pos[:bs].copy_(tok_pos.to(dev))
            b.table.fill(observed, block)
        q.copy_(torch.randn(bs, q_heads * d, generator=rng).to(dev, dtype))
        sync()
        start = time.perf_counter()
        replay()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
        forward(eager, q)
    same = all(torch.equal(a[1:], b[1:]) for a, b in zip(graphed.ring, eager.ring))
    written = int(sum((r[1:] != 0).any(-1).any(-1).sum() for r in graphed.ring))
    stats_same = all(torch.allclose(a[1:], b[1:], rtol=1e-5, atol=1e-6)
                     for a, b in zip(graphed.table.stats, eager.table.stats))
    observed_rows = int(sum((s[1:] != 0).any(-1).any(-1).sum() for s in graphed.table.stats))
    print(json.dumps({"device": "cpu (make_fx)" if args.cpu else torch.cuda.get_device_name(), "torch": torch.__version__,
                      "capture_tokens": bs, "layers": layers, "ring_same_as_eager": same, "ring_slots_written": written,
                      "statistic_same_as_eager": stats_same, "statistic_rows_observed": observed_rows,
                      "replay_ms": [round(t, 3) for t in times]}))
    return 0 if same and written > 0 and stats_same and observed_rows > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
