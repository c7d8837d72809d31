"""SGLang's functions that kvflow wraps, in one place, and the thin hooks on them.

Read from SGLang 0.5.23 (`settings.SUPPORTED_VERSIONS`; kvflow refuses another version before
starting an engine). Every engine kvflow starts (`plugin.py`, in each SGLang process):

    SEEDS   SamplingBatchInfo.from_schedule_batch        AFTER    the batch's seeds from its requests
    DRAW    sampler.multinomial_with_seed                REPLACE  seeded draw in pure torch (any device)
    NAP     IdleSleeper.maybe_sleep                      REPLACE  a 100 ms idle nap
    STATE   SchedulerInternalStateController.get_internal_state  AFTER  `server_state()["kvflow"]`

An engine that serves evicted proposers only (`register_evicted`, the work in `evict.Runtime`):

    INIT           Req.init_next_round_input             AROUND   start from a snapshot, never match the tree
    FORWARD_BATCH  ForwardBatch.init_new                 AFTER    positions; the forward's kvflow rows
    ATTENTION      AttentionBackend.forward              AROUND   kvflow's part of each layer
    PROCESSOR.process_batch_result_prefill/decode        AFTER    the tripwire, compactions
    RELEASE        mem_cache.common.release_kv_cache     BEFORE   the snapshot
    ADDER.add_one_req, ._get_running_request_total_token_offset  AROUND  room to the next compaction
    RUNNER_FORWARD ModelRunner.forward                   AROUND   operator counts (KVFLOW_SGLANG_COUNT_OPS=1)
"""

from __future__ import annotations

import contextlib
from array import array
from typing import Optional

SEEDS = "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.from_schedule_batch"
DRAW = "sglang.srt.layers.sampler.multinomial_with_seed"
NAP = "sglang.srt.managers.scheduler_components.idle_sleeper.IdleSleeper.maybe_sleep"
STATE = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"
_INIT = "sglang.srt.managers.schedule_batch.Req.init_next_round_input"
_FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
_ATTENTION = "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.forward"
_PROCESSOR = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
_RELEASE = "sglang.srt.mem_cache.common.release_kv_cache"
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_RUNNER_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"

_KEY = ["kvflow_evict"]
RUNTIME = None  # evict.RUNTIME, set by register_evicted (this module imports nothing heavy)


def _spec(req) -> Optional[dict]:
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return params.get(_KEY[0]) if isinstance(params, dict) else None


def _init_round(original, req, tree_cache=None, *args, **kwargs):
    spec = _spec(req)
    if spec is None:
        return original(req, tree_cache, *args, **kwargs)
    # an evicted request never matches the radix tree: a key of its own misses (its input ids
    # stand in for evicted tokens; the slots hold other tokens per head)
    req.extra_key = "kvflow-evict:" + req.rid
    snap = RUNTIME.snapshots.get(spec.get("from") or "")
    if snap is not None and snap.base and not getattr(req, "_kvflow_padded", False):
        # the client counts the nominal length; the row holds `base` more slots (the holes)
        ids = req.origin_input_ids
        req.origin_input_ids = type(ids)("q", [ids[0]] * snap.base) + ids if isinstance(ids, array) \
            else [ids[0]] * snap.base + list(ids)
        if req.logprob_start_len > 0:  # counted from the start of the (now longer) input
            req.logprob_start_len += snap.base
        req._kvflow_padded = True
    out = original(req, tree_cache, *args, **kwargs)
    RUNTIME.begin(req, tree_cache)
    return out


def _forward_batch(result, *args, **kwargs):
    batch = kwargs.get("batch") or next(a for a in args if hasattr(a, "reqs"))
    RUNTIME.rows = None
    if RUNTIME.live:
        with _counted("plan_ops"):
            RUNTIME.plan(batch, result)
    return result


@contextlib.contextmanager
def _counted(field: str):
    """KVFLOW_SGLANG_COUNT_OPS=1: the operators kvflow's host side dispatches around a forward
    (positions before it: `plan_ops`; tripwire and compactions after it: `host_ops`)."""
    counter = RUNTIME.ops
    if counter is None:
        yield
        return
    counter.total = 0
    with counter:
        yield
    RUNTIME.host_counts[field] = counter.total


def _attention(original, backend, q, k, v, layer, forward_batch, *args, **kwargs):
    out = original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    if forward_batch.forward_mode.is_idle():
        return out
    return RUNTIME.hooked(backend, q, out, layer, forward_batch)



def _counting(original, runner, forward_batch, *args, **kwargs):
    """KVFLOW_SGLANG_COUNT_OPS=1: the operators each decode forward dispatches."""
    counter = RUNTIME.ops
    if not forward_batch.forward_mode.is_decode():
        return original(runner, forward_batch, *args, **kwargs)
    counter.total = counter.hook = 0
    with counter:
        out = original(runner, forward_batch, *args, **kwargs)
    RUNTIME.op_counts.append({"forward": RUNTIME.decode_forwards, "rows": int(forward_batch.batch_size),
                              "evicted_rows": len(RUNTIME.rows or ()),
                              "ops": counter.total, "hook_ops": counter.hook,
                              "plan_ops": RUNTIME.host_counts.pop("plan_ops", 0)})
    del RUNTIME.op_counts[:-256]  # the latest (what `server_state()` reads)
    return out


def _after_result(result, processor, batch, *args, **kwargs):
    if RUNTIME.live:
        with _counted("host_ops"):
            RUNTIME.forwarded(processor, batch)
        if RUNTIME.ops is not None and RUNTIME.op_counts and "host_ops" not in RUNTIME.op_counts[-1]:
            RUNTIME.op_counts[-1]["host_ops"] = RUNTIME.host_counts.pop("host_ops", 0)
    return result


def _release(req, tree_cache, *args, **kwargs):
    if req.rid in RUNTIME.live:
        RUNTIME.released(req, tree_cache)
    return None


def _room(req, live, admitting: bool) -> int:
    """Tokens an evicted request may still add before its next compaction frees the rest: all
    SGLang's admission control needs to reserve for it (its row never exceeds `budget +
    buffer`), where it would reserve the step cap."""
    size = live.nominal + (len(req.full_untruncated_fill_ids) - req.prefix_len if admitting else 0)
    return max(1, live.evictor.trigger - size)


def _reserving_room(admitting: bool):
    def hook(original, adder, req, *args, **kwargs):
        """For the length of the call, an evicted request's `max_new_tokens` is what fits
        before its next compaction (its own stop rule keeps the real one). A request whose
        snapshot found no room in the pool yet is not admitted (it waits for the next round)."""
        live = RUNTIME.live.get(req.rid)
        if live is None:
            return original(adder, req, *args, **kwargs)
        if admitting and not RUNTIME.restore(req, adder.tree_cache, live):
            from sglang.srt.managers.schedule_policy import AddReqResult

            return AddReqResult.NO_TOKEN
        room, params = _room(req, live, admitting), req.sampling_params
        if len(req.output_ids) + room >= params.max_new_tokens:
            return original(adder, req, *args, **kwargs)
        real, params.max_new_tokens = params.max_new_tokens, len(req.output_ids) + room
        try:
            return original(adder, req, *args, **kwargs)
        finally:
            params.max_new_tokens = real
    return hook


def state() -> dict:
    """The evicted requests' part of `server_state()` (the plugin's state hook adds it)."""
    return {
        "evicted_requests": len(RUNTIME.live),
        "evicted_request_slots": {rid: live.resident for rid, live in RUNTIME.live.items()},
        "peak_request_slots": RUNTIME.peak_slots,
        "compactions": RUNTIME.compactions,
        "retractions": RUNTIME.retractions,
        "observed_tokens": RUNTIME.observed_tokens,
        "hooks": RUNTIME.mode,
        "profile": vars(RUNTIME.profile) | {},
        "table_bytes": RUNTIME.tables.nbytes() if RUNTIME.tables is not None else 0,
        "replay_proxy": None if RUNTIME.proxy is None else {
            "captures": RUNTIME.proxy.captures, "replays": RUNTIME.proxy.replays,
            "replays_by_bucket": {str(b): n for b, n in RUNTIME.proxy.replays_by_bucket.items()}},
        "op_counts": RUNTIME.op_counts[-64:],
        "snapshots": len(RUNTIME.snapshots),
        "snapshot_tokens": sum(s.length for s in RUNTIME.snapshots.values()),
    }


def register_evicted() -> None:
    """The hooks of evicted requests (an engine that serves them only)."""
    global RUNTIME
    from kvflow.backends.sglang.in_worker.evict import KEY, RUNTIME as runtime

    RUNTIME = runtime
    _KEY[0] = KEY
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_INIT, _init_round, HookType.AROUND)
    HookRegistry.register(_FORWARD_BATCH, _forward_batch, HookType.AFTER)
    HookRegistry.register(_ATTENTION, _attention, HookType.AROUND)
    HookRegistry.register(_PROCESSOR + ".process_batch_result_prefill", _after_result, HookType.AFTER)
    HookRegistry.register(_PROCESSOR + ".process_batch_result_decode", _after_result, HookType.AFTER)
    HookRegistry.register(_RELEASE, _release, HookType.BEFORE)
    if RUNTIME.ops is not None:
        HookRegistry.register(_RUNNER_FORWARD, _counting, HookType.AROUND)
    # admission: reserve an evicted request's room to its next compaction, not its step cap
    HookRegistry.register(_ADDER + ".add_one_req", _reserving_room(admitting=True), HookType.AROUND)
    HookRegistry.register(_ADDER + "._get_running_request_total_token_offset", _reserving_room(admitting=False),
                          HookType.AROUND)
