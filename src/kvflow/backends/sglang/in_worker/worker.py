"""The SGLang worker: one `sglang.Engine` in a process of its own, driven over a pipe.

    python -m kvflow.backends.sglang.in_worker.worker     # started by kvflow.backends.sglang.loading

Why a process of its own: SGLang spawns its scheduler and detokenizer processes and SIGKILLs
its parent when one of them dies, so the parent must be expendable — a crashed engine then
costs this worker, and kvflow's own process reports it and can resume.

Protocol: kvflow's served-engine messages (`kvflow.backends.served.wire`: JSON lines, stdin →
requests, stdout → replies; SGLang's own prints go to stderr), with SGLang's extras:
    → {"engine": kwargs, "evict": profile}    first line: build the engine (profile: graph.Profile JSON)
    ← ("ready", info)                        info: sglang version, the server args SGLang resolved
    → ("generate", rid, input_ids, sampling_params, top_logprobs[, dp_rank])
                                             dp_rank: the data-parallel replica (SGLang's routed_dp_rank)
    ← ("tokens", rid, ids, logprobs, top)    new tokens as they stream (deltas)
    ← ("end", rid, finish, meta)             finish: wire.FINISHES (from SGLang's finish_reason)
    → ("score", rid, input_ids, start)       log-probabilities of input_ids[start:]
    ← ("scored", rid, logprobs, meta)
    → ("values", rid, input_ids, start, labels, need)  per-position values of the positions not cached
    ← ("scored", rid, {"first", "values"}, meta)  values of positions first.. ([n, C])
    → ("abort", rid)                         the request ends soon with finish type "abort"
    → ("state", rid)                         the scheduler's state (KV slots in use, kvflow's snapshots)
    ← ("state", rid, dict)                   summed over data-parallel replicas (each under "replicas")
    → ("shutdown",)
    ← ("error", rid, message)                a request failed (rid None: the worker failed)
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import traceback

from kvflow.backends.served.settings import engine_arguments
from kvflow.backends.served.wire import ABORT, LENGTH, STOP_STRING, STOP_TOKEN, read_message, write_message


class _Worker:
    def __init__(self, engine, out) -> None:
        self.engine, self.out = engine, out
        self.loop = engine.loop
        self.tasks: dict[str, asyncio.Task] = {}

    def send(self, *msg) -> None:
        write_message(self.out, msg)

    async def generate(self, rid, input_ids, sampling_params, top_logprobs, dp_rank=None) -> None:
        sent = 0
        try:
            stream = await self.engine.async_generate(
                input_ids=input_ids, sampling_params=sampling_params, return_logprob=True,
                top_logprobs_num=top_logprobs, stream=True, rid=rid, routed_dp_rank=dp_rank)
            async for chunk in stream:
                ids, meta = chunk["output_ids"], chunk["meta_info"]
                lps = meta.get("output_token_logprobs") or []
                top = meta.get("output_top_logprobs") or []
                if len(ids) > sent:
                    self.send("tokens", rid, ids[sent:], [x[0] for x in lps[sent:len(ids)]],
                              [[(t[0], t[1]) for t in (row or [])] for row in top[sent:len(ids)]])
                    sent = len(ids)
                if meta.get("finish_reason") is not None:
                    self.send("end", rid, *finish_of(meta["finish_reason"], _meta(meta)))
                    return
            self.send("end", rid, ABORT, {})
        except Exception as exc:  # noqa: BLE001 - reported to the client, the worker goes on
            self.send("error", rid, f"{type(exc).__name__}: {exc}")
        finally:
            self.tasks.pop(rid, None)

    async def score(self, rid, input_ids, start) -> None:
        try:
            out = await self.engine.async_generate(
                input_ids=input_ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                logprob_start_len=max(0, start - 1), rid=rid)
            lps = [x[0] for x in out["meta_info"]["input_token_logprobs"]]
            # SGLang reports from the token before `start`, whose entry has no logprob
            # (with start 0: from the first token, which has none either)
            self.send("scored", rid, lps[1:], _meta(out["meta_info"]))
        except Exception as exc:  # noqa: BLE001
            self.send("error", rid, f"{type(exc).__name__}: {exc}")
        finally:
            self.tasks.pop(rid, None)

    async def values(self, rid, input_ids, start, labels, need=None) -> None:
        """Per-position values of the positions SGLang runs (the rest is in its radix cache;
        `need`, the positions the scorer needs, is vLLM's: SGLang answers every one it runs):
        labels None: the model's hidden states, which kvflow's PRM class makes its head's
        logits ([tokens, 2]); `start` (or None) then caps the cached prefix, so that the values
        from `start` on come back. labels: log p of those tokens at positions start.. (the
        last from the first sampled token's distribution); the cache is capped at `start`."""
        try:
            if labels is None:
                # one sampled token (unused): with none SGLang returns no hidden states
                kw = {"sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_hidden_states": True}
                if start is not None:
                    kw.update(return_logprob=True, logprob_start_len=start)
                out = await self.engine.async_generate(input_ids=input_ids, rid=rid, **kw)
                values = out["meta_info"]["hidden_states"][0]  # the prefill's positions
                first = len(input_ids) - len(values)
                if first != (out["meta_info"].get("cached_tokens") or 0):
                    # SGLang keeps the hidden states of a chunked prefill's last chunk only
                    raise RuntimeError(f"hidden states for {len(values)} of the {len(input_ids)} input tokens, "
                                       f"{out['meta_info'].get('cached_tokens')} of them cached: the prefill was split "
                                       "into chunks; a PRM's engine needs engine.chunked_prefill_size: -1")
            else:
                out = await self.engine.async_generate(
                    input_ids=input_ids, sampling_params={"max_new_tokens": 1, "temperature": 0.0}, rid=rid,
                    return_logprob=True, logprob_start_len=start, token_ids_logprob=list(labels))
                meta = out["meta_info"]
                # entry j of the input's is token start + j, read from position start + j - 1
                rows = list(meta["input_token_ids_logprobs"][1:]) + [meta["output_token_ids_logprobs"][0]]
                values = [[lp for lp, _tid, *_ in sorted(row, key=lambda x: list(labels).index(x[1]))] for row in rows]
                first = start
            self.send("scored", rid, {"first": first, "values": values}, _meta(out["meta_info"]))
        except Exception as exc:  # noqa: BLE001
            self.send("error", rid, f"{type(exc).__name__}: {exc}")
        finally:
            self.tasks.pop(rid, None)

    async def state(self, rid) -> None:
        try:
            states = await self.engine.tokenizer_manager.get_internal_state()
            self.send("state", rid, merged_state([s.get("kvflow") or {} for s in states]))
        except Exception as exc:  # noqa: BLE001
            self.send("error", rid, f"{type(exc).__name__}: {exc}")
        finally:
            self.tasks.pop(rid, None)

    def handle(self, msg) -> bool:
        kind = msg[0]
        if kind == "state":
            self.tasks[msg[1]] = self.loop.create_task(self.state(msg[1]))
        if kind == "generate":
            self.tasks[msg[1]] = self.loop.create_task(self.generate(*msg[1:]))
        elif kind == "score":
            self.tasks[msg[1]] = self.loop.create_task(self.score(*msg[1:]))
        elif kind == "values":
            self.tasks[msg[1]] = self.loop.create_task(self.values(*msg[1:]))
        elif kind == "abort":
            if msg[1] in self.tasks:
                self.engine.tokenizer_manager.abort_request(msg[1])
        elif kind == "shutdown":
            return False
        return True

    async def serve(self, inbox: asyncio.Queue) -> None:
        while True:
            msg = await inbox.get()
            if msg is None or not self.handle(msg):
                return


def merged_state(replicas: list) -> dict:
    """kvflow's scheduler state over data-parallel replicas (one dict each): counts summed,
    peaks the largest, per-request slots merged; with several, each replica's own under
    `replicas` (in rank order)."""
    if len(replicas) == 1:
        return replicas[0]
    out: dict = {}
    for state in replicas:
        for key, value in state.items():
            if key.startswith("peak_"):
                out[key] = max(out.get(key, value), value)
            elif isinstance(value, dict):
                out.setdefault(key, {}).update(value)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
            else:  # settings (hooks, evict_hooks): the same on every replica
                out.setdefault(key, value)
    out["replicas"] = replicas
    return out


def finish_of(reason: dict, meta: dict) -> tuple[str, dict]:
    """kvflow's finish word (wire.FINISHES) for SGLang's `finish_reason`, and the meta (with
    SGLang's message where it aborted a request itself)."""
    kind, matched = reason.get("type"), reason.get("matched")
    if kind == "abort":
        return ABORT, {**meta, "message": reason.get("message")}
    if kind == "stop" and isinstance(matched, int):
        return STOP_TOKEN, meta
    if kind == "stop" and matched is not None:
        return STOP_STRING, meta
    return LENGTH, meta


def _meta(meta: dict) -> dict:
    return {k: meta.get(k) for k in ("prompt_tokens", "cached_tokens", "completion_tokens")}


def resolved_settings(server_args) -> dict:
    """What SGLang resolved for this device (its final server arguments, not what was asked):
    plain values only, so that they travel over the pipe and into `manifest.json`."""
    import json

    out = {}
    for key, value in server_args.resolved_dict().items():
        try:  # plain values and nested records (e.g. `cuda_graph_config`, per phase) as they print
            out[key] = json.loads(json.dumps(value, allow_nan=False))
        except (TypeError, ValueError):
            continue
    return out


def _is_prm(model_path) -> bool:
    """Does the model directory's config name kvflow's process reward model class?"""
    import json

    try:
        with open(os.path.join(str(model_path), "config.json")) as f:
            return "Qwen2ForProcessRewardModel" in (json.load(f).get("architectures") or [])
    except (OSError, ValueError, TypeError):
        return False


def _read_requests(stream, loop, inbox: asyncio.Queue) -> None:
    while True:
        msg = read_message(stream)
        loop.call_soon_threadsafe(inbox.put_nowait, msg)
        if msg is None:
            return


def main() -> int:
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # SGLang's prints must not reach the pipe
    inp = sys.stdin
    first = read_message(inp)
    if not first:
        return 2
    # the logprobs kvflow promises are the model's own (temperature 1); the plugin seeds rows
    os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
    os.environ["KVFLOW_SGLANG"] = "1"
    if first.get("evict"):  # the decode profile of an engine that serves evicted proposers (graph.Profile)
        os.environ["KVFLOW_SGLANG_EVICT"] = first["evict"]
    if _is_prm(first["engine"].get("model_path")):  # the plugin registers kvflow's PRM class for it
        os.environ["KVFLOW_SGLANG_PRM"] = "1"
    try:
        import sglang

        engine = sglang.Engine(**engine_arguments(first["engine"]))  # kvflow's OpenMP settings: in the environment
    except BaseException as exc:  # noqa: BLE001 - the client shows it, naming the model entry
        write_message(out, ("error", None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"))
        return 1
    write_message(out, ("ready", {"version": sglang.__version__, "settings": resolved_settings(engine.server_args)}))
    worker = _Worker(engine, out)
    inbox: asyncio.Queue = asyncio.Queue()
    threading.Thread(target=_read_requests, args=(inp, worker.loop, inbox), daemon=True).start()
    try:
        worker.loop.run_until_complete(worker.serve(inbox))
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
