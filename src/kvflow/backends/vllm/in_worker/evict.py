"""Evicted requests inside vLLM: kvflow's budgeted cache beside vLLM's paged one.

This module runs in the vLLM worker process (`worker.py` imports it before the engine starts,
with kvflow's import roots appended to `sys.path`: vLLM's own torch, transformers and pydantic
stay first). It imports kvflow's `hf` cache and attention code and nothing of kvflow's
client side. A request opts in with a spec (`worker.py`'s `generate` message):

    {"evictor": "module:Class", "params": {...}, "rng_key": int, "n_protected": int,
     "first": int,              # logical position of the first token the evicted cache has not seen
     "from": snapshot id | None, "save_as": snapshot id | None, "drop": [snapshot ids]}

Layout. An evicted request's resident keys and values per (layer, KV head) live in a
`kvflow.backends.hf.cache.BudgetedCache` of one row (the very cache `hf` decodes with:
same write plans, same compactions, same `Evictor.select` calls, same query window and H2O
statistic), not in vLLM's blocks. vLLM still runs the request as a normal one whose input
is the whole logical sequence: every token keeps vLLM's logical position (RoPE, token ids).
Tokens before the budgeted cache's next position are stand-ins: the cache already holds what
they left, so vLLM counts them computed (on null blocks, block-aligned: the few after the last
whole block it computes, and their outputs are not used). Tokens from there on are the evicted
request's own: each layer's attention for them is recomputed over the budgeted cache
(`kvflow.backends.hf.attention.kvflow_attention`, sdpa with the cache's mask) and written over
what vLLM's kernel returned, and the cache compacts at `budget + buffer`
exactly as on `hf`. So the same evictor keeps the same tokens on both engines.

Seams (no vLLM file is changed):
- the attention backend: `CPU_ATTN` is replaced through vLLM's attention backend registry
  (`register_backend`) by `EvictingBackend`, whose impl runs vLLM's kernel, then the evicted
  rows; layer 0 of a forward plans it (which requests, which tokens: vLLM's input batch and
  the attention metadata), the last layer ends it (`BudgetedCache.end_forward`: compaction);
- the KV cache manager (`install`, on the engine's scheduler): an evicted request takes no block
  of vLLM's pool. Its block table is vLLM's null block at every position (vLLM's kernel writes and
  reads scratch there; the evicted rows never read it), so its KV memory is its budgeted cache
  alone, it never makes vLLM preempt another request, and nothing of it reaches the prefix cache
  (never looked up, never cached);
- preemption: vLLM may still preempt an evicted request to free blocks for another (it frees
  none) and run it again from its first token later: its stand-ins reach the cache's next
  position then, so it goes on where it was.

What this does not do yet: the budgeted caches live in the worker's memory beside vLLM's pool
(bounded: `budget + buffer` tokens per (layer, KV head) and request), not compacted in vLLM's own
blocks; vLLM's kernel still runs an evicted request's rows over its (null) block table, and the
evicted rows are then attended one request at a time in Python; no CUDA graph may replay the
model (the worker refuses evicted requests unless vLLM runs eagerly).
"""

from __future__ import annotations

import importlib
import re
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


_LAYER = re.compile(r"\.(\d+)\.")


class Runtime:
    """All evicted requests of one vLLM worker."""

    def __init__(self) -> None:
        self.live: dict[str, Live] = {}  # vLLM's (internal) request id -> its state
        self.snapshots: dict[str, BudgetedCache] = {}
        self.runner: Any = None  # vLLM's model runner (`install`)
        self.num_layers = 0
        self.kv_heads = 0
        self.plan: list[tuple[Live, int, int]] = []  # this forward's evicted rows: (live, first token, end)
        self._evictors: dict[str, Any] = {}
        self.hooked = False  # every attention layer runs `EvictingImpl` (vLLM picked CPU_ATTN)
        self.eager = False  # vLLM runs the model eagerly (no graph replays a forward past these hooks)

    def refusal(self) -> Optional[str]:
        """Why this engine cannot run an evicted request, or None."""
        if self.runner is None:
            return "kvflow's hooks were not installed in this vLLM engine"
        if not self.hooked:
            return ("vLLM picked an attention backend other than CPU_ATTN for this model; kvflow's evicted "
                    "requests run on vLLM's CPU attention only (for now): put this proposer's model on 'hf' or 'sglang'")
        if not self.eager:
            return ("vLLM captures graphs here (enforce_eager: false): a replayed graph would skip kvflow's "
                    "evicted attention; set `engine: {enforce_eager: true}` on this model entry")
        return None

    # ------------------------------------------------------------------ requests

    def evictor(self, spec: dict):
        key = spec["evictor"] + repr(sorted(spec["params"].items()))
        ev = self._evictors.get(key)
        if ev is None:
            module, _, name = spec["evictor"].partition(":")
            cls = importlib.import_module(module)
            for part in name.split("."):
                cls = getattr(cls, part)
            ev = self._evictors[key] = cls(cls.Params(**spec["params"]))
        return ev

    def admit(self, rid: str, spec: dict) -> None:
        """Register vLLM request `rid` (internal id) as evicted, before vLLM schedules it."""
        for snap in spec.get("drop") or ():
            self.snapshots.pop(snap, None)
        if spec.get("from"):
            base = self.snapshots.get(spec["from"])
            if base is None:
                raise EvictedRequestError(f"snapshot {spec['from']!r} does not exist (dropped, or never made)")
            cache = base.select(torch.tensor([0]))
        else:
            cache = BudgetedCache(self.evictor(spec), self.num_layers, new_rows(1), torch.device("cpu"),
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

    # ------------------------------------------------------------------ engine hooks

    def install(self, engine) -> None:
        """Hook the in-process engine: its model runner (the input batch of each forward) and
        its scheduler's KV cache manager (an evicted request's stand-ins and blocks)."""
        core = engine.engine_core.engine_core
        self.runner = core.model_executor.driver_worker.worker.model_runner
        model_config = self.runner.model_config
        self.num_layers = model_config.hf_config.num_hidden_layers
        self.kv_heads = model_config.get_num_kv_heads(core.vllm_config.parallel_config)
        self.eager = bool(model_config.enforce_eager)
        layers = core.vllm_config.compilation_config.static_forward_context.values()
        impls = [type(layer.impl).__name__ for layer in layers if hasattr(layer, "impl")]
        self.hooked = bool(impls) and all(name == "EvictingImpl" for name in impls)
        manager = core.scheduler.kv_cache_manager
        groups = manager.coordinator.single_type_managers
        null = manager.block_pool.null_block
        block_size = min(group.block_size for group in groups)
        lookup, allocate, cache = manager.get_computed_blocks, manager.allocate_slots, manager.coordinator.cache_blocks

        def get_computed_blocks(request):
            """An evicted request's tokens before its cache's next position are stand-ins (the
            budgeted cache holds what they left): "computed" on null blocks, never looked up."""
            live = self.live.get(request.request_id)
            if live is None:
                return lookup(request)
            n = min(live.next, request.num_tokens - 1) // block_size * block_size  # vLLM's hits end on a block
            return manager.empty_kv_cache_blocks, n, 0

        def allocate_slots(request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
                           num_lookahead_tokens=0, *args, **kwargs):
            """An evicted request takes no block of vLLM's pool: its block table is vLLM's null
            block for every position (what vLLM's kernel writes and reads there is scratch; the
            evicted rows attend over the budgeted cache), so it is never short of blocks and frees
            none, and nothing of it reaches the prefix cache."""
            live = self.live.get(request.request_id)
            if live is None:
                return allocate(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                num_lookahead_tokens, *args, **kwargs)
            tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens + num_lookahead_tokens
            added = []
            for group in groups:
                blocks = group.req_to_blocks[request.request_id]
                more = [null] * max(0, -(-tokens // group.block_size) - len(blocks))
                blocks.extend(more)
                added.append(more)
            return manager.create_kv_cache_blocks(tuple(added))

        def cache_blocks(request, *args, **kwargs):  # a null block must never be hashed into the prefix cache
            if request.request_id not in self.live:
                return cache(request, *args, **kwargs)

        manager.get_computed_blocks = get_computed_blocks
        manager.allocate_slots = allocate_slots
        manager.coordinator.cache_blocks = cache_blocks


RUNTIME = Runtime()


def _layer_index(name: str) -> int:
    found = _LAYER.findall(name)
    return int(found[-1]) if found else 0


def _backend_classes():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

    class EvictingImpl(CPUAttentionBackendImpl):
        """vLLM's CPU attention, then the evicted requests' rows over their budgeted caches."""

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, **kwargs):
            out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output=output, **kwargs)
            if attn_metadata is not None and RUNTIME.live:
                idx = getattr(layer, "_kvflow_layer_idx", None)
                if idx is None:
                    idx = layer._kvflow_layer_idx = _layer_index(layer.layer_name)
                RUNTIME.attend(self, idx, query, key, value, attn_metadata, out)
            return out

    class EvictingBackend(CPUAttentionBackend):
        @staticmethod
        def get_impl_cls():
            return EvictingImpl

    return EvictingBackend


def __getattr__(name: str):
    if name == "EvictingBackend":  # made on first use: importing this module needs no vLLM
        cls = globals()["EvictingBackend"] = _backend_classes()
        return cls
    raise AttributeError(name)


def register() -> None:
    """Replace vLLM's CPU attention backend with `EvictingBackend` (before the engine starts)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.EvictingBackend")
