"""kvpress at decode time: a compression stores the kept tokens in `topk` order, not in time
order, so the next compression's slot-based rules read the wrong tokens (docs/components.md,
"kvpress at decode time").

`ScorerPress.compress` gathers `keys.gather(2, scores.topk(n_kept).indices)`: the kept tokens
land in descending score order. Rules that read a slot's index as its age then misfire from
the second compression of a `DecodingPress` on: StreamingLLM's sinks are "slots 0..n_sink-1",
LagKV's partitions and CurDKV's local blocks are runs of adjacent slots, ExpectedAttention's
sinks are the first slots. This script shows StreamingLLMPress losing the attention sinks:
tokens are tagged in the values' last channel; 24 tokens are compressed to 12, 12 new tokens
appended, and the 24 compressed to 12 again.

    bench/kvpress/.venv/bin/python bench/kvpress/decode_order.py

kvflow stores kept tokens in time order (`Evictor.select` returns ascending slots), so its
`streaming` keeps tokens 0-3 through every compaction.
"""

import torch
from kvpress import StreamingLLMPress


class Layer:  # what ScorerPress.compress reads of the attention module
    head_dim = 8


def tokens(n: int, first: int):
    keys, values = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
    values[..., -1] = torch.arange(first, first + n).float()  # the token's index, to follow it
    return keys, values


def main() -> None:
    torch.manual_seed(0)
    press = StreamingLLMPress(compression_ratio=0.5, n_sink=4)
    keys, values = tokens(24, 0)
    keys, values = press.compress(Layer(), None, keys, values, None, {})
    print("after the 1st compression, stored order:", values[0, 0, :, -1].int().tolist())
    new_keys, new_values = tokens(12, 24)
    keys, values = torch.cat([keys, new_keys], 2), torch.cat([values, new_values], 2)
    keys, values = press.compress(Layer(), None, keys, values, None, {})
    kept = sorted(values[0, 0, :, -1].int().tolist())
    print("after the 2nd compression, kept tokens:", kept)
    print("attention sinks 0-3 kept:", [t for t in range(4) if t in kept], "(all four expected)")


if __name__ == "__main__":
    main()
