"""Record which tokens kvpress's score presses keep, on fixed tensors, for kvflow's fidelity test.

Runs in kvpress's own environment (bench/kvpress/.venv, made by bench/kvpress/setup.sh:
kvpress 0.5.5 pins transformers < 5.3, kvflow needs >= 5.17):

    bash bench/kvpress/setup.sh
    bench/kvpress/.venv/bin/python bench/kvpress/record_kept.py    # -> tests/data/kvpress_golden.pt

For each attention layout (GQA with 2 and with 3 KV heads, MHA), dtype (float32, bfloat16)
and length N, a random-weight Llama attention layer (seeded) reads seeded hidden states of N
tokens at positions 0..N-1, as at kvpress's prefill: its keys and values (keys after RoPE),
and its queries after RoPE for every position, are saved with the case. Each press is then
called as kvpress's `ScorerPress.compress` calls it (`press.score(module, hidden_states,
keys, values, None, {"position_embeddings": ...})`), and the tokens it keeps at several
compression ratios (`scores.topk(int(N * (1 - ratio)))`, as `compress` does) are saved,
with its scores (as float32) for explaining ties.

kvflow's side (tests/test_kvpress_golden.py) gives the same tensors to the kvflow evictor
each press maps to (docs/components.md, "kvpress presses in kvflow") and compares the kept
sets. The file holds tensors, ints, floats, strings and lists only (`torch.load(...,
weights_only=True)` reads it).
"""

from __future__ import annotations

import argparse
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaConfig, LlamaRotaryEmbedding, \
    apply_rotary_pos_emb

import kvpress
from kvpress import (AdaKVPress, CURPress, ExpectedAttentionPress, KeyDiffPress, KnormPress, LagKVPress,
                     SnapKVPress, StreamingLLMPress, TOVAPress)

REPO = Path(__file__).resolve().parents[2]
HEAD_DIM = 16
ROPE_THETA = 10000.0
LAYOUTS = {"gqa2": (4, 2), "gqa3": (6, 3), "mha": (4, 4)}  # name -> (query heads, KV heads)
LENGTHS = (24, 41, 64)
RATIOS = (0.25, 0.5, 0.75)
#: name -> (press factory, kvpress parameters recorded with the case)
PRESSES = {
    "knorm": (KnormPress, {}),
    "keydiff": (KeyDiffPress, {}),
    "lagkv": (LagKVPress, {"n_sink": 4, "lag_size": 6}),
    "lagkv-cross": (LagKVPress, {"n_sink": 4, "lag_size": 6, "cross_scoring": True}),
    "tova": (TOVAPress, {}),
    "cur": (CURPress, {}),
    "cur-kv_avg-w8": (CURPress, {"leverage_type": "kv_avg", "local_window_size": 8}),
    "expected_attention": (ExpectedAttentionPress, {"n_future_positions": 512, "n_sink": 4}),
    "expected_attention-mean": (ExpectedAttentionPress, {"n_future_positions": 64, "n_sink": 4,
                                                         "use_covariance": False, "use_vnorm": False}),
    "snapkv": (SnapKVPress, {"window_size": 8, "kernel_size": 5}),
    "streaming_llm": (StreamingLLMPress, {"n_sink": 4}),
}
#: name -> (wrapped press, its parameters, AdaKVPress's alpha_safeguard): head-adaptive budgets
ADAKV = {
    "adakv-knorm": (KnormPress, {}, 0.2),
    "adakv-keydiff": (KeyDiffPress, {}, 0.2),
    "adakv-cur": (CURPress, {}, 0.3),
    "adakv-knorm-safe": (KnormPress, {}, 0.8),  # a safeguard that binds
}


def layer(q_heads: int, kv_heads: int, dtype: torch.dtype, seed: int):
    config = LlamaConfig(hidden_size=q_heads * HEAD_DIM, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                         head_dim=HEAD_DIM, intermediate_size=64, num_hidden_layers=1, rope_theta=ROPE_THETA,
                         max_position_embeddings=4096)
    torch.manual_seed(seed)
    module = LlamaAttention(config, layer_idx=0).to(dtype).eval()
    module.rotary_emb = LlamaRotaryEmbedding(config)  # what kvpress's press attaches from the model
    return config, module


@torch.no_grad()
def case(name: str, q_heads: int, kv_heads: int, dtype: torch.dtype, n: int, seed: int) -> dict:
    config, module = layer(q_heads, kv_heads, dtype, seed)
    gen = torch.Generator().manual_seed(seed + n)
    hidden = torch.randn(1, n, config.hidden_size, generator=gen).to(dtype)
    position_ids = torch.arange(n)[None]
    cos, sin = module.rotary_emb(hidden, position_ids)
    q = module.q_proj(hidden).view(1, n, q_heads, HEAD_DIM).transpose(1, 2)
    k = module.k_proj(hidden).view(1, n, kv_heads, HEAD_DIM).transpose(1, 2)
    v = module.v_proj(hidden).view(1, n, kv_heads, HEAD_DIM).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    presses = {}
    for press_name, (factory, params) in PRESSES.items():
        kept, scored = {}, {}
        for ratio in RATIOS:  # StreamingLLMPress's scores depend on the ratio: score as compress() does
            press = factory(compression_ratio=ratio, **params)
            scores = press.score(module, hidden, k, v, None, {"position_embeddings": (cos, sin)})
            n_kept = int(n * (1 - ratio))
            kept[str(ratio)] = [sorted(row) for row in scores.topk(n_kept, dim=-1).indices[0].tolist()]
            scored[str(ratio)] = scores[0].float()
        presses[press_name] = {"params": params, "scores": scored, "kept": kept}
    module.config._attn_implementation = "sdpa"  # AdaKVPress refuses eager attention
    for press_name, (factory, params, alpha) in ADAKV.items():
        kept, scored = {}, {}
        for ratio in RATIOS:  # AdaKVPress masks the pruned (head, token) pairs instead of gathering
            inner = factory(compression_ratio=ratio, **params)
            press = AdaKVPress(press=inner, alpha_safeguard=alpha)
            press.compress(module, hidden, k, v, None, {"position_embeddings": (cos, sin)})
            _, heads, tokens = module.masked_key_indices
            pruned = {(h, t) for h, t in zip(heads.tolist(), tokens.tolist())}
            kept[str(ratio)] = [[t for t in range(n) if (h, t) not in pruned] for h in range(kv_heads)]
            scored[str(ratio)] = inner.score(module, hidden, k, v, None, {"position_embeddings": (cos, sin)})[0].float()
            del module.masked_key_indices
        presses[press_name] = {"params": {**params, "alpha_safeguard": alpha}, "scores": scored, "kept": kept}
    return {"layout": name, "q_heads": q_heads, "kv_heads": kv_heads, "dtype": str(dtype).replace("torch.", ""),
            "n": n, "seed": seed, "keys": k[0], "values": v[0], "queries": q[0], "presses": presses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "kvpress_golden.pt")
    args = ap.parse_args()
    cases = []
    for i, (name, (q_heads, kv_heads)) in enumerate(LAYOUTS.items()):
        for dtype in (torch.float32, torch.bfloat16):
            for n in LENGTHS:
                cases.append(case(name, q_heads, kv_heads, dtype, n, seed=100 + i))
    record = {
        "kvpress": getattr(kvpress, "__version__", "0.5.5"), "torch": str(torch.__version__),
        "transformers": transformers.__version__, "head_dim": HEAD_DIM, "rope_theta": ROPE_THETA,
        "ratios": list(RATIOS), "machine": platform.processor() or platform.machine(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "command": "bench/kvpress/.venv/bin/python bench/kvpress/record_kept.py", "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(record, args.out)
    print(f"{len(cases)} cases x {len(PRESSES) + len(ADAKV)} presses x {len(RATIOS)} ratios -> {args.out} "
          f"({args.out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
