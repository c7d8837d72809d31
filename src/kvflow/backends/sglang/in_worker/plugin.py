"""kvflow's SGLang plugin (entry point group `sglang.srt.plugins`): seeded sampling per request,
and evicted requests (`evict.py`) on engines that serve them.

SGLang samples from a per-request seed (`sampling_params["sampling_seed"]`, hashed with the
token's position: the same seed and prefix give the same tokens, whatever shares the batch)
only under `enable_deterministic_inference`, which refuses the CPU's `torch_native`
attention backend, and whose CPU hash lives in the CPU build of `sgl_kernel` (not on PyPI).
This plugin fills the batch's seed tensor from the requests' own seeds whenever SGLang left
it empty (a request that gave no seed gets a fresh random one, as it would draw without the
plugin), and replaces SGLang's seeded draw (`multinomial_with_seed`: Gumbel-max over a hash
of seed, position and token id) with the same draw over a pure-torch hash, so that seeded
sampling runs on every backend and device. The tokens differ from SGLang's own seeded ones
(another hash), not the distribution.

It also shortens the idle scheduler's nap (`sleep_on_idle`, which kvflow turns on: an idle
SGLang scheduler otherwise busy-polls a whole core, which a mixed pipeline's `hf` base needs)
from 1 s to 100 ms: kvflow sends each step's requests right after the last step's ended, and a
request that lands just before the nap must not wait out a second.

Evicted requests' hooks (`evict.py`) are registered only where the worker passed the engine's
decode profile (`KVFLOW_SGLANG_EVICT`, `graph.Profile`): an engine that serves full-context
proposers or a scorer runs SGLang's own forward untouched.

On a CPU it sizes SGLang's token pool from `max_total_tokens` and the memory the machine can
give, page cache counted as free (`_cpu_pool_budget`), instead of SGLang's memory profile.

It registers kvflow's `Qwen2ForProcessRewardModel` in SGLang's model registry for an engine
that serves one (`prm_model.py`).

It acts only in engines that kvflow's worker started (`KVFLOW_SGLANG=1` in the environment,
which SGLang's spawned processes inherit); in any other SGLang it registers nothing.
"""

from __future__ import annotations

import os
import random
import time

from kvflow.backends.sglang.in_worker.hooks import DRAW as _DRAW, NAP as _NAP, SEEDS as _SEEDS, STATE as _STATE  # noqa: E402
NAP_MS = 100
_POOL = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"
_rng = random.SystemRandom()


def register() -> None:
    if os.environ.get("KVFLOW_SGLANG") != "1":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_SEEDS, _seed_rows, HookType.AFTER)
    HookRegistry.register(_DRAW, seeded_draw, HookType.REPLACE)
    HookRegistry.register(_NAP, _short_nap, HookType.REPLACE)
    HookRegistry.register(_STATE, _internal_state, HookType.AFTER)
    HookRegistry.register(_POOL, _cpu_pool_budget, HookType.AROUND)
    if os.environ.get("KVFLOW_SGLANG_EVICT"):  # set by the worker for an engine that serves evicted proposers only
        from kvflow.backends.sglang.in_worker import hooks

        hooks.register_evicted()  # evicted requests (kvflow's evictors per request, layer and KV head)
    if os.environ.get("KVFLOW_SGLANG_PRM") == "1":  # set by the worker for a PRM checkpoint only:
        from kvflow.backends.sglang.in_worker import prm_model  # SGLang's model registry imports every model (seconds)

        prm_model.register()  # Qwen2 process reward models (SGLang has no such class)


def _internal_state(result, controller, *args, **kwargs):
    """`Engine.get_server_info()` gains a `kvflow` entry: KV slots in use and, on an engine that
    serves evicted proposers, their state (`evict.state()`); `evict_hooks` says which."""
    scheduler = controller.scheduler
    allocator = scheduler.token_to_kv_pool_allocator
    out = {
        "kv_slots_total": int(scheduler.max_total_num_tokens),
        "kv_slots_free": int(allocator.available_size()),
        # prefixes the radix tree keeps for reuse but no running request holds (freed on demand)
        "kv_slots_evictable": int(scheduler.tree_cache.evictable_size()),
        "running_requests": len(getattr(scheduler.running_batch, "reqs", None) or ()),
        "evict_hooks": bool(os.environ.get("KVFLOW_SGLANG_EVICT")),
    }
    if out["evict_hooks"]:
        from kvflow.backends.sglang.in_worker import hooks

        out.update(hooks.state())
    result.internal_state["kvflow"] = out
    return result


def _cpu_pool_budget(profile, configurator, *args, **kwargs) -> int:
    """The KV pool's byte budget. On a CPU with `max_total_tokens` set (kvflow's CPU defaults set
    it, `settings.CPU`), the memory the machine can give (`_cpu_available_bytes`), which SGLang's
    token cap then cuts to `max_total_tokens`: the same pool on every machine that holds it.
    SGLang's own profile (free memory after the weights loaded, less a slack of the free memory
    before) reads a cgroup's `memory.current`, which counts the page cache: reading a GGUF file
    while a second test worker loaded a model made free memory seem to fall by 87% (CI,
    2026-12-06: "Loaded weights leave no GPU memory for the KV cache" at fraction 0.8). On a
    GPU, or with no token cap, SGLang's profile."""
    from sglang.srt.runtime_context import get_schedule

    if str(configurator.device) != "cpu" or get_schedule().max_total_tokens is None:
        return profile(configurator, *args, **kwargs)
    return _cpu_available_bytes()


def _cpu_available_bytes() -> int:
    """Memory this process can still get: the kernel's MemAvailable (free memory and page cache
    it can reclaim, `kvflow.kv_memory.mem_available`), and within a cgroup v2 limit its room,
    the cgroup's page cache counted as free as well (the kernel reclaims it before it kills)."""
    from pathlib import Path

    from kvflow.kv_memory import mem_available

    available = mem_available()
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
            used = int((cgroup / "memory.current").read_text()) - int(stat.get("file", 0))
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass  # no cgroup v2 memory controller here
    return max(0, int(available))


def _short_nap(sleeper, *args, **kwargs) -> None:
    if sleeper.poller.poll(NAP_MS):  # returns at once when a request arrives ...
        time.sleep(0.001)  # ... or when a socket stays readable: never a tight loop


def _seed_rows(info, *args, **kwargs):
    if info is None or getattr(info, "sampling_seed", None) is not None:
        return info
    batch = kwargs.get("batch") or next(a for a in args if hasattr(a, "reqs"))
    import torch

    seeds = [r.sampling_params.sampling_seed for r in batch.reqs]
    seeds = [s if s is not None else _rng.getrandbits(63) for s in seeds]
    info.sampling_seed = torch.tensor(seeds, dtype=torch.int64, device=info.temperatures.device)
    return info


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x, k: int):
    return (x >> k) & ((1 << (64 - k)) - 1)  # logical shift of int64 (torch's >> is arithmetic)


def seeded_draw(logprobs, seed, positions):
    """Gumbel-max: argmax over tokens of logprobs + Gumbel noise, the noise a splitmix64 hash
    of (seed, position, token id). logprobs [rows, vocab] (any float; -inf allowed), seed and
    positions [rows] integers; returns [rows, 1] int64 token indices."""
    import torch

    rows, vocab = logprobs.shape
    cols = torch.arange(1, vocab + 1, device=logprobs.device, dtype=torch.int64)
    x = (seed.to(torch.int64) * _GOLDEN + positions.to(torch.int64) * _MIX1)[:, None] + cols[None, :] * _MIX2
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    u = (_shr(x, 40).to(torch.float64) + 0.5) * 2.0**-24  # (0, 1)
    gumbel = -torch.log(-torch.log(u))
    return torch.argmax(logprobs.to(torch.float64) + gumbel, dim=1, keepdim=True)
