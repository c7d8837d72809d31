"""kvflow's SGLang decode hook under a real CUDA graph (no SGLang needed): prepared for
`bench/gpu_check.sh`, the GPU counterpart of the CPU replay proxy's test.

`graph.decode_step` is captured with `torch.cuda.graph` the way SGLang's decode runner
captures a forward -- two eager warm-ups, then the capture, on capture inputs with no kvflow
row (zero `req_pool_indices`, `seq_lens` of 1) -- for each layer of a 4-layer, 7B-like shape
(28 query / 4 KV heads, head_dim 128, bf16). Then the host admits evicted rows (observing,
with per-head holes, plain) among full-context ones, writes the inputs into the static
buffers, replays, and compares the tables and the output with an eager run on a copy of the
same state. Prints one JSON line; exit 1 when they differ.

    PYTHONPATH=src:plugins python bench/sglang_graph_capture.py [--bs 64]
    PYTHONPATH=src:plugins python bench/sglang_graph_capture.py --cpu   # the same script on a CPU, make_fx for the graph
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cpu", action="store_true", help="check the script itself without a GPU (make_fx trace)")
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    from kvflow.backends.sglang.in_worker import graph

    dev, dtype = torch.device("cpu" if args.cpu else "cuda"), torch.bfloat16
    layers, q_heads, kv_heads, d, bs = args.layers, 28, 4, 128, args.bs
    pool, ctx, slots = 64 * 1024, 4096, 512
    req_to_token = torch.zeros(slots, ctx, dtype=torch.int32, device=dev)
    t = graph.Tables(req_to_token, layers, graph.Profile.general())  # every part of the hook
    for lid in range(layers):
        t.ensure(lid, q_heads, kv_heads, d, dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    k = [torch.randn(pool, kv_heads, d, generator=g, device=dev, dtype=dtype) for _ in range(layers)]
    v = [torch.randn(pool, kv_heads, d, generator=g, device=dev, dtype=dtype) for _ in range(layers)]
    # static inputs, as SGLang's graph runner keeps them
    q = torch.zeros(bs, q_heads * d, device=dev, dtype=dtype)
    out = torch.zeros(bs, q_heads * d, device=dev, dtype=dtype)
    rpi = torch.zeros(bs, dtype=torch.int64, device=dev)
    lens = torch.ones(bs, dtype=torch.int64, device=dev)

    def forward(tables, q_, out_, rpi_, lens_):
        res = []
        for lid in range(layers):
            res.append(graph.decode_step(tables, q_, out_, k[lid], v[lid], req_to_token, rpi_, lens_, lid=lid,
                                         scaling=d ** -0.5, q_heads=q_heads, kv_heads=kv_heads, head_dim=d, v_dim=d))
        return torch.stack(res)

    if args.cpu:
        from torch.fx.experimental.proxy_tensor import make_fx

        traced = make_fx(lambda *a: forward(t, *a))(q, out, rpi, lens)
        replayed: dict = {}

        def replay():
            replayed["out"] = traced(q, out, rpi, lens)
    else:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-ups, as SGLang's
                forward(t, q, out, rpi, lens)
        torch.cuda.current_stream().wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            static_out = forward(t, q, out, rpi, lens)
        replay = cuda_graph.replay
    # the host admits rows: half of the batch kvflow's (every other row observing, every fourth with holes)
    n_rows = bs // 2
    for i in range(bs):
        req_to_token[i + 1, :300] = torch.arange(300, dtype=torch.int32, device=dev) + 300 * i
    for i in range(n_rows):
        row = t.assign(observing=i % 2 == 0)
        t.row_of[i + 1] = row
        if i % 4 == 0:
            t.set_holes(row, torch.full((layers, kv_heads), 100).index_fill_(1, torch.tensor([0]), 60), 100)
    rng = torch.Generator(device=dev).manual_seed(1)
    q.copy_(torch.randn(bs, q_heads * d, generator=rng, device=dev, dtype=dtype))
    out.copy_(torch.randn(bs, q_heads * d, generator=rng, device=dev, dtype=dtype))
    rpi.copy_(torch.arange(1, bs + 1, device=dev))
    lens.copy_(torch.randint(120, 300, (bs,), generator=rng, device=dev))
    eager_t = copy.deepcopy(t)
    want = forward(eager_t, q, out, rpi, lens)
    sync()
    start = time.perf_counter()
    replay()
    sync()
    replay_ms = (time.perf_counter() - start) * 1e3
    if args.cpu:
        static_out = replayed["out"]
    same = {"output": torch.equal(static_out, want), "seen": torch.equal(t.seen, eager_t.seen),
            "tokens": torch.equal(t.tokens, eager_t.tokens),
            "stats": all(torch.allclose(t.stats[l][1:], eager_t.stats[l][1:], rtol=1e-5, atol=1e-6) for l in range(layers)),
            "queries": all(torch.equal(t.queries[l][1:], eager_t.queries[l][1:]) for l in range(layers))}
    seen_ok = bool((t.seen[1 : n_rows + 1] == layers).all())
    print(json.dumps({"device": "cpu (make_fx)" if args.cpu else torch.cuda.get_device_name(), "torch": torch.__version__, "bs": bs, "layers": layers,
                      "kvflow_rows": n_rows, "same_as_eager": same, "tripwire_counts_every_layer": seen_ok,
                      "replay_ms": round(replay_ms, 3)}))
    return 0 if all(same.values()) and seen_ok else 1


if __name__ == "__main__":
    sys.exit(main())
