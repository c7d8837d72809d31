"""Evicted requests beside vLLM's blocks: kvflow's budgeted cache in the worker (varying budgets, CPU).

The path for evictors whose budget varies by layer (PyramidKV) or by head (Ada-KV): their
(layer, head)s keep different counts of tokens, which vLLM's per-block layout (one length per
request) cannot express, so such a request's keys and values per (layer, KV head) live in a
`kvflow.backends.hf.cache.BudgetedCache` of one row (the very cache `hf` decodes with: same write
plans, compactions and `Evictor.select` calls), not in vLLM's blocks (`blocks.py` serves every
uniform budget). vLLM runs the request as a normal one whose input is the whole logical sequence:
tokens before the budgeted cache's next position are stand-ins (counted computed on null blocks,
block-aligned; the few after the last whole block are computed and their outputs unused), and
each layer's attention for the request's own tokens is recomputed over the budgeted cache
(`kvflow_attention`, sdpa with the cache's mask) and written over vLLM's output.

An evicted request here takes no block of vLLM's pool: its block table is vLLM's null block at
every position (`evict.install`'s manager hooks), so it never makes vLLM preempt another; vLLM
may still preempt it (it frees nothing) and run it again from its first token: its stand-ins
reach the cache's next position then. Python per request and layer, so: CPU only, eager only
(`refusal`: on a GPU or under graphs such a request is refused before vLLM sees it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvflow.backends.hf.attention import kvflow_attention
from kvflow.backends.hf.cache import BudgetedCache
from kvflow.backends.hf.rows import new_rows


class EvictedRequestError(RuntimeError):
    """vLLM ran an evicted request in a way its budgeted cache cannot follow."""


@dataclass
class Live:
    """An evicted request vLLM is running."""

    cache: BudgetedCache  # one row: its resident tokens per (layer, KV head)
    first: int  # logical position of the request's first evicted token (before it: stand-ins)
    next: int  # logical position of the next token the cache takes
    save_as: Optional[str]
    error: Optional[str] = None
    recomputes: int = 0  # forwards that ran tokens it had already taken again (vLLM preempted it: recompute)


class _Module:
    """What `kvflow_attention` / transformers' sdpa read of an attention module."""

    def __init__(self, layer_idx: int, groups: int, scaling: float) -> None:
        self.layer_idx, self.num_key_value_groups, self.scaling = layer_idx, groups, scaling
        self.is_causal, self.training = True, False


class Beside:
    """The evicted requests of one vLLM worker that live beside vLLM's blocks."""

    def __init__(self) -> None:
        self.live: dict[str, Live] = {}  # vLLM's (internal) request id -> its state
        self.snapshots: dict[str, BudgetedCache] = {}
        self.num_layers = 0
        self.kv_heads = 0
        self.block_size = 0
        self.null = None  # vLLM's null block
        self.plan: list[tuple[Live, int, int]] = []  # this forward's evicted rows: (live, first token, end)
        self.runner: Any = None

    @staticmethod
    def refusal(backend: str, graphs: bool, device: str) -> Optional[str]:
        """Why this engine cannot run such a request, or None."""
        if device != "cpu" or backend != "CPU_ATTN":
            return (f"its budget varies by layer or head, which vLLM's kernel cannot attend (one length per request); "
                    f"kvflow then recomputes its attention in Python beside vLLM's blocks, on a CPU only (this engine: "
                    f"{device}, {backend}): put this proposer's model on backend 'sglang' or 'hf'")
        if graphs:
            return ("its budget varies by layer or head, which kvflow attends in Python beside vLLM's kernel, and this "
                    "engine replays graphs: set `engine: {enforce_eager: true}` on this model entry")
        return None

    def admit(self, rid: str, spec: dict, evictor) -> None:
        """Register vLLM request `rid` (internal id) as evicted, before vLLM schedules it."""
        for snap in spec.get("drop") or ():
            self.snapshots.pop(snap, None)
        if spec.get("from"):
            base = self.snapshots.get(spec["from"])
            if base is None:
                raise EvictedRequestError(f"snapshot {spec['from']!r} does not exist (dropped, or never made)")
            cache = base.select(torch.tensor([0]))
        else:
            cache = BudgetedCache(evictor, self.num_layers, new_rows(1), torch.device("cpu"),
                                  kv_heads=self.kv_heads)
        cache.rows.rng_keys[0] = int(spec["rng_key"])
        cache.rows.n_protected[0] = int(spec["n_protected"])
        if int(cache.rows.positions[0]) != int(spec["first"]):
            raise EvictedRequestError(f"snapshot holds {int(cache.rows.positions[0])} tokens, the request starts "
                                      f"its evicted part at {spec['first']}")
        self.live[rid] = Live(cache, int(spec["first"]), int(spec["first"]), spec.get("save_as"))

    def end(self, rid: str) -> Optional[Live]:
        """The request ended (finished or aborted): keep its cache as its snapshot. Returns its
        state (`error`: what its forwards met, if anything), or None for a request not evicted."""
        live = self.live.pop(rid, None)
        if live is not None and live.save_as and live.error is None:
            self.snapshots[live.save_as] = live.cache
        return live

    def kept(self, snap: str) -> dict:
        """A snapshot's resident keys and values per (layer, KV head), in time order (plain lists)."""
        cache = self.snapshots[snap]
        keys, values = [], []
        for i in range(len(cache.layers)):
            k, v, heads = cache.resident(i, torch.tensor([0]))
            keys.append([k[0, h, :n].tolist() for h, n in enumerate(heads[0].tolist())])
            values.append([v[0, h, :n].tolist() for h, n in enumerate(heads[0].tolist())])
        return {"keys": keys, "values": values, "compactions": int(cache.rows.compactions[0])}

    # ------------------------------------------------------------------ forwards

    def _begin(self, md) -> None:
        """Plan a forward (at its first layer): each evicted request's tokens from the
        evicted cache's next position on."""
        self.plan = []
        batch = self.runner.input_batch
        qsl = md.query_start_loc.tolist()
        seq_lens = md.seq_lens.tolist()
        for i, rid in enumerate(batch.req_ids[: len(qsl) - 1]):
            live = self.live.get(rid)
            if live is None or live.error:
                continue
            q_len = qsl[i + 1] - qsl[i]
            start = seq_lens[i] - q_len  # logical position of the request's first token in this forward
            if start < live.next and live.next > live.first:
                # vLLM preempted it and recomputes its tokens (stand-ins now): its evicted cache holds them already
                live.recomputes += 1
            if start + q_len <= live.next:
                continue  # stand-ins only
            if start > live.next:
                live.error = (f"vLLM skipped tokens {live.next}..{start - 1} of an evicted request (a prefix-cache "
                              "hit past its evicted part): its evicted cache cannot follow")
                continue
            n = start + q_len - live.next
            if n > int(live.cache.room()[0]):
                live.error = f"vLLM ran {n} tokens of an evicted request in one forward, past budget + buffer"
                continue
            live.cache.begin_forward(torch.tensor([n]), n)
            self.plan.append((live, qsl[i + 1] - n, qsl[i + 1]))

    def attend(self, impl, layer_idx: int, query, key, value, md, output) -> None:
        if layer_idx == 0:
            self._begin(md)
        if not self.plan:
            return
        module = _Module(layer_idx, impl.num_heads // impl.num_kv_heads, impl.scale)
        out = output.view(output.shape[0], impl.num_heads, impl.head_size)
        for live, a, b in self.plan:
            q = query[a:b].transpose(0, 1)[None]  # [1, q_heads, n, D]
            k = key[a:b].transpose(0, 1)[None]  # [1, kv_heads, n, D]
            v = value[a:b].transpose(0, 1)[None]
            layer = live.cache.layers[layer_idx]
            keys, values = layer.update(k, v)
            mask = live.cache.plan(layer_idx).mask
            attn, _ = kvflow_attention(module, q, keys, values, mask, kvflow_cache=live.cache, scaling=impl.scale,
                                       dropout=0.0)
            out[a:b] = attn[0].to(out.dtype)  # [n, q_heads, D]
        if layer_idx == self.num_layers - 1:
            for live, a, b in self.plan:
                live.cache.end_forward(torch.tensor([b - a]))  # compacts at budget + buffer, as on hf
                live.next += b - a
            self.plan = []

    # ------------------------------------------------------------------ the KV cache manager (scheduler side)

    def computed(self, request) -> int:
        """The request's tokens before its cache's next position are stand-ins (the budgeted cache
        holds what they left): "computed" on null blocks (vLLM's hits end on a block)."""
        live = self.live[request.request_id]
        return min(live.next, request.num_tokens - 1) // self.block_size * self.block_size

    def allocate(self, manager, groups, request, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens):
        """No block of vLLM's pool: the block table is vLLM's null block at every position (what
        vLLM's kernel writes and reads there is scratch; the evicted rows attend over the budgeted
        cache), so the request is never short of blocks and frees none."""
        tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens + num_lookahead_tokens
        added = []
        for group in groups:
            blocks = group.req_to_blocks[request.request_id]
            more = [self.null] * max(0, -(-tokens // group.block_size) - len(blocks))
            blocks.extend(more)
            added.append(more)
        return manager.create_kv_cache_blocks(tuple(added))
