"""Evicted requests inside vLLM: kvflow's hooks in the worker, and the path each request takes.

This module runs in the vLLM worker process (`worker.py` imports it before the engine starts,
with kvflow's import roots appended to `sys.path`: vLLM's own torch, transformers and pydantic
stay first). A request opts in with a spec (`worker.py`'s `generate` message):

    {"evictor": "module:Class", "params": {...}, "rng_key": int, "n_protected": int,
     "first": int,              # logical position of the first token the request's KV has not seen
     "from": snapshot id | None, "save_as": snapshot id | None, "drop": [snapshot ids]}

Two paths, chosen per request from its evictor:
- `blocks.py` (every evictor whose (layer, KV head)s keep the same count of tokens): the KV in
  the request's own vLLM blocks, attended by vLLM's own kernel, compacted in place, its tail
  blocks freed to vLLM's pool at each compaction; CPU and GPU, graphs on;
- `beside.py` (budgets that vary by layer or head: PyramidKV, Ada-KV): kvflow's budgeted cache
  beside vLLM's blocks, attention recomputed in Python; CPU and eager only.
`Runtime.refusal` refuses a request before vLLM sees it where its path cannot run.

Seams (no vLLM file is changed):
- the attention backend: `CPU_ATTN` and `FLASH_ATTN` are replaced through vLLM's attention
  backend registry (`register_backend`) by subclasses whose impl runs vLLM's own forward, then
  kvflow's part (`Runtime.attend`);
- the KV cache manager (`install`, on the engine's scheduler): `get_computed_blocks`,
  `allocate_slots`, `free` and the prefix cache's `cache_blocks` route an evicted request to
  its path (an evicted request never reads or fills the prefix cache);
- the model runner's `_prepare_inputs` (the evicted rows' physical lengths and slots, written
  into vLLM's persistent metadata tensors) and the scheduler's `update_from_output` (before it:
  the step's bookkeeping and compactions, so the next schedule sees the freed blocks).

Engine-wide settings (the worker's environment): `KVFLOW_VLLM_QUERY_WINDOW` (W, default 32: the
longest query window an evictor may read; the ring holds W queries per row and layer),
`KVFLOW_VLLM_EVICTED_ROWS` (E, default 64: evicted requests admitted at once),
`KVFLOW_VLLM_STAT_SPAN` (S, default 512: the longest row whose H2O statistic the table keeps,
`statistic.py`), and `KVFLOW_VLLM_REPLAY_PROXY=1` (`replay.py`).
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Any, Optional

import torch

from kvflow.backends.vllm.in_worker.beside import Beside, EvictedRequestError
from kvflow.backends.vllm.in_worker.blocks import InBlocks, Paged
from kvflow.backends.vllm.in_worker.replay import proxy_from_env
from kvflow.backends.vllm.settings import kept_in_table, stat_span

__all__ = ["EvictedRequestError", "RUNTIME", "Runtime", "register"]

_LAYER = re.compile(r"\.(\d+)\.")
HOOKED = ("CPU_ATTN", "FLASH_ATTN")  # the attention backends kvflow's impl subclasses


class Runtime:
    """All evicted requests of one vLLM worker, and the engine facts their paths need."""

    def __init__(self) -> None:
        self.blocks = InBlocks(int(os.environ.get("KVFLOW_VLLM_QUERY_WINDOW", "32") or 32),
                               int(os.environ.get("KVFLOW_VLLM_EVICTED_ROWS", "64") or 64), stat_span())
        self.blocks.proxy = proxy_from_env()
        self.beside = Beside()
        self.installed = False
        self.told: dict = {}  # the worker's own counters as the last end message told them
        self.layers = self.kv_heads = 0
        self.backend = ""  # the attention backend vLLM picked
        self.device = "cpu"
        self.graphs = False  # vLLM replays CUDA graphs of the forward
        self.mixed_graphs = False  # ... of batches with prompts or chunks too (cudagraph_mode FULL)
        self.problem: Optional[str] = None  # why no evicted request can run on this engine
        self._evictors: dict[str, Any] = {}

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

    def in_blocks(self, ev) -> bool:
        return not ev.varies(self.layers)

    def refusal(self, ev) -> Optional[str]:
        """Why this engine cannot run a request of this evictor, or None."""
        if not self.installed:
            return "kvflow's hooks were not installed in this vLLM engine"
        if self.problem:
            return self.problem
        if not self.in_blocks(ev):
            return Beside.refusal(self.backend, self.graphs, self.device)
        if ev.query_window > self.blocks.window:
            return (f"its query window {ev.query_window} is past this engine's {self.blocks.window} "
                    "(KVFLOW_VLLM_QUERY_WINDOW in the environment of kvflow's process)")
        if kept_in_table(ev) and ev.trigger > self.blocks.table.span:
            return (f"H2O's statistic of a request compacted at {ev.trigger} slots is past this engine's table of "
                    f"{self.blocks.table.span} (KVFLOW_VLLM_STAT_SPAN in the environment of kvflow's process)")
        if kept_in_table(ev) and self.mixed_graphs:
            return ("vLLM replays batches with prompts from full CUDA graphs here (cudagraph_mode FULL), where kvflow "
                    "observes a prompt's H2O statistic eagerly: set `engine: {compilation_config: {cudagraph_mode: "
                    "FULL_AND_PIECEWISE}}` on this model entry")
        if ev.observes_attention and not kept_in_table(ev) and (self.graphs or self.blocks.proxy is not None):
            return ("it observes attention with its own observe(), which kvflow runs per request in Python, and this "
                    "engine replays graphs: set `engine: {enforce_eager: true}` on this model entry")
        return None

    def admit(self, rid: str, spec: dict) -> None:
        """Register vLLM request `rid` (internal id) as evicted, before vLLM schedules it."""
        ev = self.evictor(spec)
        why = self.refusal(ev)
        if why:
            raise EvictedRequestError(why)
        if self.in_blocks(ev):
            self.blocks.admit(rid, spec, ev, self.kv_heads, self.layers)
        else:
            self.beside.admit(rid, spec, ev)
        for snap in spec.get("drop") or ():  # a snapshot lives on one path; dropping it on both is harmless
            self.blocks.drop(snap)
            self.beside.snapshots.pop(snap, None)

    def end(self, rid: str) -> Optional[tuple[Optional[str], dict]]:
        """The request ended: (what its forwards met, or None; its counters), or None if it was not evicted."""
        live = self.beside.end(rid)
        if live is not None:
            return live.error, {"evicted_recomputes": live.recomputes}
        r = self.blocks.end(rid)
        if r is not None:
            return r.error, {"evicted_preemptions": r.preemptions, "evicted_blocks_peak": r.blocks_peak,
                             "evicted_compactions": r.compactions, **self._worker_counts()}
        return None

    def _worker_counts(self) -> dict:
        """The worker's own counters since the last end message that told them."""
        now = {"snapshot_spills": self.blocks.spills,
               "ring_replays": self.blocks.proxy.replays if self.blocks.proxy is not None else 0}
        out = {k: v - self.told.get(k, 0) for k, v in now.items()}
        self.told = now
        return out

    def error(self, rid: str) -> Optional[str]:
        live = self.beside.live.get(rid) or self.blocks.live.get(rid)
        return live.error if live is not None else None

    def kept(self, snap: str) -> dict:
        if snap in self.beside.snapshots:
            return self.beside.kept(snap)
        return self.blocks.kept(snap)

    # ------------------------------------------------------------------ forwards

    def attend(self, impl, layer, query, key, value, md, output) -> None:
        idx = getattr(layer, "_kvflow_layer_idx", None)
        if idx is None:
            idx = layer._kvflow_layer_idx = _layer_index(layer.layer_name)
        if self.beside.live:
            self.beside.attend(impl, idx, query, key, value, md, output)
        self.blocks.attended(impl, idx, query, self.layers)

    # ------------------------------------------------------------------ engine hooks

    def make_tables(self, runner) -> None:
        """Before vLLM profiles its memory or makes its KV cache (`_hook_kv_cache_init`): the
        query ring and the statistic's table exist."""
        mc = runner.model_config
        self.blocks.ensure_tables(mc.hf_config.num_hidden_layers, mc.get_num_attention_heads(runner.parallel_config),
                                  mc.get_num_kv_heads(runner.parallel_config), mc.get_head_size(), mc.dtype,
                                  torch.device(runner.device))

    def install(self, engine) -> None:
        """Hook the in-process engine: its model runner and its scheduler's KV cache manager."""
        core = engine.engine_core.engine_core
        config = core.vllm_config
        runner = core.model_executor.driver_worker.worker.model_runner
        self.layers = config.model_config.hf_config.num_hidden_layers
        self.kv_heads = config.model_config.get_num_kv_heads(config.parallel_config)
        self.device = str(config.device_config.device_type)
        mode = getattr(config.compilation_config, "cudagraph_mode", None)
        self.graphs = self.device == "cuda" and mode is not None and str(getattr(mode, "name", mode)) != "NONE"
        self.mixed_graphs = self.graphs and str(getattr(mode, "name", mode)) == "FULL"
        self.blocks.table.fixed = self.graphs or self.blocks.proxy is not None  # a replayed graph reads every entry
        attn = {name: layer for name, layer in config.compilation_config.static_forward_context.items()
                if hasattr(layer, "impl")}
        impls = {type(layer.impl).__name__ for layer in attn.values()}
        names = {layer.attn_backend.get_name() for layer in attn.values()}
        self.backend = ",".join(sorted(names))
        manager = core.scheduler.kv_cache_manager
        groups = manager.coordinator.single_type_managers
        if impls != {"EvictingImpl"} or self.backend not in HOOKED:
            self.problem = (f"vLLM picked attention backend {self.backend} here; kvflow's evicted requests run on "
                            f"{' and '.join(HOOKED)}: put this proposer's model on backend 'sglang' or 'hf'")
        elif len(groups) != 1:
            self.problem = "this model has several KV cache groups (hybrid attention): kvflow evicts one group only"
        elif getattr(config.scheduler_config, "async_scheduling", False):
            self.problem = ("vLLM schedules asynchronously here (async_scheduling), ahead of kvflow's compactions: "
                            "set `engine: {async_scheduling: false}` on this model entry")
        caches = [None] * self.layers
        for name, layer in attn.items():
            kv = layer.kv_cache[0] if isinstance(layer.kv_cache, (list, tuple)) else layer.kv_cache
            caches[_layer_index(name)] = kv
        group = groups[0]
        b, s = self.blocks, self.beside
        layout = Paged.LAYOUTS.get(self.backend, "cpu")
        maps = None
        if layout == "cpu" and not self.problem:
            layer = next(iter(attn.values()))
            maps = cpu_layout(caches[0].dtype, group.block_size, caches[0].shape[-1] // 2, layer.isa,
                              layer.impl.kv_cache_dtype)
        b.paged = Paged(caches, layout, group.block_size, maps)
        b.manager, b.pool, b.group, b.runner, b.block_size = manager, manager.block_pool, group, runner, group.block_size
        s.runner, s.num_layers, s.kv_heads = runner, self.layers, self.kv_heads
        s.block_size, s.null = min(g.block_size for g in groups), manager.block_pool.null_block
        self._hook_manager(manager, groups)
        self._hook_runner(runner, core.scheduler)
        self.installed = True

    def _hook_manager(self, manager, groups) -> None:
        lookup, allocate, free = manager.get_computed_blocks, manager.allocate_slots, manager.free
        cache = manager.coordinator.cache_blocks
        b, s = self.blocks, self.beside

        def get_computed_blocks(request):
            """An evicted request's tokens its KV holds count computed; the prefix cache is never read."""
            rid = request.request_id
            if rid in b.live:
                return manager.empty_kv_cache_blocks, b.computed(request), 0
            if rid in s.live:
                return manager.empty_kv_cache_blocks, s.computed(request), 0
            return lookup(request)

        def allocate_slots(request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
                           num_lookahead_tokens=0, *args, **kwargs):
            rid = request.request_id
            if rid in b.live:
                return b.allocate(request, num_new_tokens, num_lookahead_tokens)
            if rid in s.live:
                return s.allocate(manager, groups, request, num_new_tokens, num_new_computed_tokens,
                                  num_lookahead_tokens)
            while True:  # a full-context request short of blocks: snapshots leave the pool before vLLM waits or preempts
                got = allocate(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                               num_lookahead_tokens, *args, **kwargs)
                if got is not None or not b.spill_one():
                    return got

        def free_blocks(request):
            if request.request_id in b.live:
                b.freed(request)
            return free(request)

        def cache_blocks(request, *args, **kwargs):  # an evicted request's blocks never enter the prefix cache
            if request.request_id not in b.live and request.request_id not in s.live:
                return cache(request, *args, **kwargs)

        manager.get_computed_blocks = get_computed_blocks
        manager.allocate_slots = allocate_slots
        manager.free = free_blocks
        manager.coordinator.cache_blocks = cache_blocks

    def _hook_runner(self, runner, scheduler) -> None:
        prepare, update = runner._prepare_inputs, scheduler.update_from_output
        reserve = scheduler._reserve_prefill_lookahead
        b = self.blocks

        def _reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens):
            """vLLM's last say on a request's tokens this step (running and waiting alike): an
            evicted request in blocks runs at most up to its next compaction, so one request
            ingests any number of tokens with compactions at `hf`'s points (chunked prefill)."""
            n = reserve(request, num_computed_tokens, num_new_tokens)
            r = b.live.get(request.request_id)
            if r is not None and r.evictor.bounded:
                n = min(n, r.evictor.trigger - r.phys)
            return n

        def _prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
            out = prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)
            if b.live:
                b.prepared(runner, num_scheduled_tokens)
            return out

        def update_from_output(scheduler_output, model_output, *args, **kwargs):
            b.forwarded()  # compactions free blocks before vLLM's scheduler reads the step
            b.watch(scheduler_output.total_num_scheduled_tokens, len(scheduler.running))
            return update(scheduler_output, model_output, *args, **kwargs)

        runner._prepare_inputs = _prepare_inputs
        scheduler.update_from_output = update_from_output
        scheduler._reserve_prefill_lookahead = _reserve_prefill_lookahead


RUNTIME: Optional[Runtime] = None


def cpu_layout(dtype, block_size: int, head_dim: int, isa: str, kv_cache_dtype: str):
    """Where vLLM's CPU kernel puts slot t's dim d inside a (block, head)'s key and value regions
    ([block_size, D] int64 maps each): learnt by writing through vLLM's own op into a scratch
    block, once with each slot's index and once with each dim's (small integers: exact in any
    float dtype), so kvflow reads and writes whatever tiling this ISA's kernel uses."""
    from vllm import _custom_ops as ops

    bs, d = block_size, head_dim
    maps = []
    seen = []
    for fill in (torch.arange(1, bs + 1)[:, None].expand(bs, d), torch.arange(1, d + 1)[None, :].expand(bs, d)):
        kv = torch.zeros(1, 1, bs, 2 * d, dtype=dtype)
        key_cache, value_cache = kv.view(1, 1, 2 * bs, d).chunk(2, dim=2)
        x = fill.to(dtype)[:, None, :].contiguous()  # [tokens, kv_heads = 1, D]
        ops.cpu_attn_reshape_and_cache(x, x.clone(), key_cache, value_cache, torch.arange(bs), isa,
                                       kv_cache_dtype=kv_cache_dtype)
        flat = kv.view(2, bs * d)  # the (block, head)'s key region, then its value region
        seen.append(flat.float().round().long())
    for half in (0, 1):
        slot, dim = seen[0][half] - 1, seen[1][half] - 1
        where = torch.full((bs, d), -1, dtype=torch.int64)
        ok = (slot >= 0) & (dim >= 0)
        where[slot[ok], dim[ok]] = torch.arange(bs * d)[ok]
        if int(ok.sum()) != bs * d or bool((where < 0).any()):
            raise RuntimeError(f"vLLM's CPU KV layout ({isa}, {dtype}) is not a permutation of slots and dims: "
                               "kvflow cannot read it")
        maps.append(where)
    return tuple(maps)


def _layer_index(name: str) -> int:
    found = _LAYER.findall(name)
    return int(found[-1]) if found else 0


def _backend_class(base_path: str):
    """An attention backend whose impl is vLLM's own (`base_path`'s), then kvflow's part."""
    module, _, name = base_path.rpartition(".")
    base = getattr(importlib.import_module(module), name)
    impl_base = base.get_impl_cls()

    class EvictingImpl(impl_base):
        """vLLM's attention, then kvflow's part: the query ring, H2O's statistic, evictors' own observe(), the
        rows of requests beside vLLM's blocks."""

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, **kwargs):
            out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output=output, **kwargs)
            if attn_metadata is not None and RUNTIME is not None:
                RUNTIME.attend(self, layer, query, key, value, attn_metadata, out)
            return out

    class EvictingBackend(base):
        @staticmethod
        def get_impl_cls():
            return EvictingImpl

    EvictingBackend.__name__ = EvictingBackend.__qualname__ = f"Evicting{name}"
    return EvictingBackend


def __getattr__(name: str):
    """`EvictingCPU_ATTN`, `EvictingFLASH_ATTN`: made on first use (importing this module needs no vLLM)."""
    if name.startswith("Evicting") and name[len("Evicting"):] in HOOKED:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        cls = globals()[name] = _backend_class(AttentionBackendEnum[name[len("Evicting"):]].value)
        return cls
    raise AttributeError(name)


def register() -> Runtime:
    """Replace vLLM's CPU and flash attention backends by kvflow's (before the engine starts)."""
    global RUNTIME
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    RUNTIME = Runtime()
    for backend in HOOKED:
        register_backend(AttentionBackendEnum[backend], f"{__name__}.Evicting{backend}")
    _hook_kv_cache_init()
    return RUNTIME


def _hook_kv_cache_init() -> None:
    """kvflow's tables are made before vLLM profiles its memory (`profile_run`: on a GPU vLLM
    sizes its KV cache from what is left after it, so the query ring is counted, not allocated
    past `gpu_memory_utilization`), or at the latest before vLLM makes its KV cache (an engine
    that skips the profile); always before any CUDA graph is captured (a graph holds them as
    static buffers). Making them is idempotent."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    classes = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        classes.append(CPUModelRunner)
    except ImportError:  # a GPU build
        pass
    for cls in classes:
        for name in ("profile_run", "initialize_kv_cache"):
            original = vars(cls).get(name)
            if original is None or getattr(original, "_kvflow", False):
                continue

            def hooked(self, *args, _original=original, **kwargs):
                if RUNTIME is not None:
                    RUNTIME.make_tables(self)
                return _original(self, *args, **kwargs)

            hooked._kvflow = True
            setattr(cls, name, hooked)
