"""H2O's statistic of evicted requests, accumulated inside vLLM's attention forward (capturable).

An evictor that declares `observed_statistic = "accumulated_attention"` (H2O) keeps, per
(layer, KV head) and slot, the attention the request's queries paid that slot, summed over the
query heads of the KV head and over time. kvflow computes it here, not by calling the evictor's
`observe()`, so that a decode forward vLLM captures in a CUDA graph keeps it: after vLLM's kernel
wrote the step's KV, one fixed-shape op per layer reads each observing request's slots from
vLLM's blocks, softmaxes its query over them and adds the result into a table.

Tables (made with the query ring, before vLLM profiles its memory or captures a graph):

    stats[l]   [E + 1, Hkv, S] float32  the statistic by ring row (row 0: the sink padding adds into)
    token      [E + 1]         int64    the step's token index of each entry's query
    length     [E + 1]         int64    slots the entry's query attends (its physical length, >= 1)
    target     [E + 1]         int64    the stats row the entry adds into (0: none)
    blocks     [E + 1, S]      int64    per slot j < S, the vLLM block holding it ...
    offsets    [E + 1, S]      int64    ... and its offset in that block

E = `KVFLOW_VLLM_EVICTED_ROWS`, S = `KVFLOW_VLLM_STAT_SPAN` (default 512, the longest physical
row observed: an H2O request compacts at `trigger` <= S). The host writes the entries of the
step's one-token rows (decode) before the forward (`fill`, from `blocks.InBlocks.prepared`);
a row with several tokens in one step (a prompt, a chunk, which vLLM never replays from a
graph) is observed eagerly by the evictor's own `observe()` into its table row, its queries
together under the causal mask, as `hf` observes a prefill (`blocks.InBlocks.attended`). With
`fixed` set (vLLM replays graphs, or the replay proxy), a forward of T tokens (a captured size)
reads its first min(T, E + 1) entries over S slots (each entry is a token of the step, packed
first); eagerly only the step's entries over their longest row.

The math is H2O's own `observe()` (float32 logits, softmax, sum over the group's heads), so a
request's statistic, and the slots it keeps, are those of the `hf` cache.
"""

from __future__ import annotations

import contextlib

import torch

_BMM_OUT_DTYPE = hasattr(torch.ops.aten.bmm, "dtype")  # bmm(..., out_dtype=) (CUDA and meta kernels; torch >= 2.8)


def decode_attention(query: torch.Tensor, keys: torch.Tensor, length: torch.Tensor, scaling: float) -> torch.Tensor:
    """H2O's statistic's increment for one query per row: the attention each slot receives,
    summed over the query heads of its KV head, the keys where one gather put them.
    query [M, Hq, D]; keys [M, Hkv, s, D]; length [M] (>= 1). Returns [M, Hkv, s] float32. On
    a GPU a low-precision model multiplies in its own dtype with float32 accumulation and output
    (no float32 copy of the keys); elsewhere in float32, as H2O's `observe()` does."""
    m, q_heads, d = query.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    g = q_heads // kv_heads
    q = query.reshape(m * kv_heads, g, d)  # query heads grouped by KV head
    k = keys.reshape(m * kv_heads, span, d).transpose(1, 2)  # [M*Hkv, D, s] (a view)
    if keys.dtype != torch.float32 and keys.device.type != "cpu" and _BMM_OUT_DTYPE:
        logits = torch.bmm(q.to(keys.dtype), k, out_dtype=torch.float32)
    else:
        logits = torch.bmm(q.float(), k.float())
    logits = logits.mul_(scaling).view(m, kv_heads, g, span)  # [M, Hkv, g, s]
    mask = torch.arange(span, device=keys.device)[None, :] < length[:, None]  # [M, s]
    logits.masked_fill_(~mask[:, None, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).sum(dim=2)


class StatTable:
    """The statistic of every observing evicted request of one worker, and the step's entries."""

    def __init__(self, rows: int, span: int) -> None:
        self.rows, self.span = rows, span  # E, S
        self.stats: list = []  # per layer [E + 1, Hkv, S] float32
        self.token = self.length = self.target = self.blocks = self.offsets = None
        self.entries = self.longest = 0  # this step's entries and their longest row (eager forwards read only these)
        self.fixed = False  # every forward reads all E + 1 entries (graphs replayed, or the proxy)

    def make(self, layers: int, kv_heads: int, device) -> None:
        if self.stats or not self.span:
            return
        e = self.rows + 1
        self.stats = [torch.zeros(e, kv_heads, self.span, dtype=torch.float32, device=device) for _ in range(layers)]
        self.token = torch.zeros(e, dtype=torch.int64, device=device)
        self.length = torch.ones(e, dtype=torch.int64, device=device)
        self.target = torch.zeros(e, dtype=torch.int64, device=device)
        self.blocks = torch.zeros(e, self.span, dtype=torch.int64, device=device)
        self.offsets = torch.zeros(e, self.span, dtype=torch.int64, device=device)

    def clear_row(self, row: int) -> None:
        for s in self.stats:
            s[row].zero_()

    def row(self, row: int) -> list:
        """The row's statistic per layer: [Hkv, S] views."""
        return [s[row] for s in self.stats]

    # ------------------------------------------------------------------ host side, before the forward

    def fill(self, entries: list[tuple[int, int, int, list[int]]], block_size: int) -> None:
        """This step's one-token rows: (token index, stats row, attended slots, block ids)."""
        n = len(entries)
        if n > self.rows:
            raise RuntimeError(f"{n} observing rows in one step, past the statistic's {self.rows} entries")
        self.token.zero_()
        self.length.fill_(1)
        self.target.zero_()
        self.entries, self.longest = n, max((e[2] for e in entries), default=0)
        if not n:
            return
        j = torch.arange(self.span)
        ids = torch.zeros(n, -(-self.span // block_size), dtype=torch.int64)
        for i, (_, _, _, held) in enumerate(entries):
            ids[i, : len(held)] = torch.tensor(held[: ids.shape[1]], dtype=torch.int64)
        dev = self.token.device
        self.blocks[:n] = ids[:, j // block_size].to(dev)
        self.offsets[:n] = (j % block_size)[None].expand(n, -1).to(dev)
        self.token[:n] = torch.tensor([e[0] for e in entries], dtype=torch.int64).to(dev)
        self.target[:n] = torch.tensor([e[1] for e in entries], dtype=torch.int64).to(dev)
        self.length[:n] = torch.tensor([e[2] for e in entries], dtype=torch.int64).to(dev)

    @contextlib.contextmanager
    def as_at_capture(self):
        """The entries as vLLM's capture sees them (its dummy batches: no kvflow row, every entry
        the sink's), restored after: what the replay proxy traces under (tracing runs the ops)."""
        saved = [t.clone() for t in (self.token, self.length, self.target, self.blocks, self.offsets)]
        entries, longest = self.entries, self.longest
        self.fill([], 1)
        try:
            yield
        finally:
            for t, s in zip((self.token, self.length, self.target, self.blocks, self.offsets), saved):
                t.copy_(s)
            self.entries, self.longest = entries, longest

    # ------------------------------------------------------------------ in the forward

    def accumulate(self, lid: int, query: torch.Tensor, paged, q_heads: int, scaling: float) -> None:
        """The step's one-token rows, one layer: the same ops for any batch when `fixed` (capturable)."""
        if self.fixed:  # entries are tokens of the step: a graph of T tokens reads its first T
            m, s = min(query.shape[0], self.rows + 1), self.span
        else:
            m, s = self.entries, self.longest
            if not m:
                return
        t = query.shape[0]
        q = query.reshape(t, q_heads, -1)[self.token[:m]]  # [M, Hq, D]
        keys = paged.keys_by_row(lid, self.blocks[:m, :s], self.offsets[:m, :s])  # [M, Hkv, s, D]: one gather
        add = decode_attention(q, keys, self.length[:m], scaling)  # [M, Hkv, s]
        self.stats[lid][:, :, :s].index_add_(0, self.target[:m], add)
