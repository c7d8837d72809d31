"""The vLLM worker: one `vllm` `LLMEngine` in a process of its own, driven over pipes with JSON lines.

    <vllm venv>/bin/python <this file>     # started by kvflow.backends.vllm.loading

It runs in vLLM's own environment (`scripts/install.sh vllm` makes `.venv-vllm`: vLLM's CPU
build pins a torch that SGLang's cannot share), where kvflow is not installed: this file is run
by its path, and imports the standard library and vLLM, plus kvflow's evicted requests
(`evict.py`) and evictors' modules from the import path of kvflow's process (the client sends
it; appended to `sys.path`, so vLLM's own torch, transformers and pydantic win). Everything that crosses the pipe is plain data (lists, numbers, strings).

The engine steps in this process's own loop: between two `LLMEngine.step()` calls it reads every
request that arrived (new requests, aborts), and after each step it streams the new tokens, so
kvflow's stop rules and pruners see every token and an aborted candidate stops within a step.

Protocol: kvflow's served-engine messages (`kvflow.backends.served.wire`: one JSON value per line;
stdin -> requests, stdout -> replies; vLLM's own prints go to stderr), with vLLM's extras:
    -> {"engine": kwargs, "paths": [dirs]}       first line: `EngineArgs(**kwargs)`, kvflow's import roots
    <- ["ready", info]                           info: vllm version, the settings vLLM resolved
    -> ["generate", rid, input_ids, params, evict]  params: `SamplingParams` fields (plain values);
                                                 evict: None, or an evicted request's spec (`evict.py`)
    -> ["kept", rid, snapshot]                   <- ["kept", rid, {keys, values, compactions}]
    <- ["tokens", rid, ids, logprobs, top]       new tokens (deltas): each one's own logprob and its
                                                 top-k [[logprob, id], ...] (temperature 1: raw_logprobs)
    <- ["end", rid, finish, meta]                finish: wire.FINISHES; meta: token counts,
                                                 the most KV blocks in use after any step so far (an
                                                 evicted request's: the forwards vLLM recomputed it in)
    -> ["score", rid, input_ids, start]          log-probabilities of input_ids[start:] (prompt logprobs)
    <- ["scored", rid, logprobs, meta]
    -> ["values", rid, input_ids, start, labels, need]  per-position values (kvflow.backends.served.position_values):
                                                 labels: log p of those tokens at each position in need (one
                                                 one-token request per position, reading the prefix cache);
                                                 labels null: a pooling engine's (a PRM's) logits at every position
    <- ["scored", rid, {"first", "values"}, meta]  values [n, C] of positions first.. (NaN: not asked)
    -> ["abort", rid]                            the request ends now with finish "abort"
    -> ["shutdown"]
    <- ["error", rid, message]                   a request failed (rid null: the worker failed)
"""

from __future__ import annotations

import importlib.util
import os
import queue
import sys
import threading
import traceback
from pathlib import Path


def _load_wire():
    """kvflow's wire format (`kvflow/backends/served/wire.py`, standard library only), loaded from
    its file: no directory of kvflow's environment joins the import path before vLLM has
    imported itself (its optional imports, torchvision's say, must not find kvflow's builds)."""
    path = Path(__file__).resolve().parents[2] / "served" / "wire.py"
    spec = importlib.util.spec_from_file_location("kvflow_served_wire", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wire = _load_wire()


def _send(out, *msg) -> None:
    wire.write_message(out, msg)


def _read(stream, inbox: queue.Queue) -> None:
    while True:
        msg = wire.read_message(stream)
        inbox.put(msg)
        if msg is None:  # the client closed the pipe
            return


def _finish(reason: str) -> str:
    """kvflow's finish word (wire.FINISHES) for vLLM's `finish_reason` (kvflow asks vLLM to stop
    on EOS tokens only, so "stop" is a stop token)."""
    return {"stop": wire.STOP_TOKEN, "length": wire.LENGTH, "abort": wire.ABORT}[reason]


def resolved_settings(engine) -> dict:
    """What vLLM resolved for this machine (plain values, for `manifest.json`)."""
    config = engine.vllm_config
    model, cache, sched = config.model_config, config.cache_config, config.scheduler_config
    return {"device": str(config.device_config.device_type), "dtype": str(model.dtype).removeprefix("torch."),
            "max_model_len": model.max_model_len, "logprobs_mode": model.logprobs_mode,
            "max_logprobs": model.max_logprobs, "enforce_eager": model.enforce_eager,
            "block_size": cache.block_size, "kv_blocks": cache.num_gpu_blocks, "enable_prefix_caching": cache.enable_prefix_caching,
            "kv_cache_dtype": str(cache.cache_dtype), "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "tensor_parallel_size": config.parallel_config.tensor_parallel_size, "runner": model.runner_type,
            "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1"}


class _Serve:
    def __init__(self, engine, out) -> None:
        from vllm import PoolingParams, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.engine, self.out = engine, out
        self.SamplingParams, self.PoolingParams, self.DELTA = SamplingParams, PoolingParams, RequestOutputKind.DELTA
        self.pooling = engine.vllm_config.model_config.runner_type == "pooling"  # a PRM: values, no tokens
        self.kinds: dict[str, str] = {}  # rid -> "generate" | "score" | "values" | "value", while vLLM runs it
        self.parts: dict[str, tuple[str, int]] = {}  # a label request's rid -> (its values request, position)
        self.pending: dict[str, dict] = {}  # a values request of label requests -> what came back so far
        self.made: dict[str, int] = {}  # rid -> tokens streamed so far
        self.prompt: dict[str, tuple[int, int]] = {}  # rid -> (prompt tokens, start of the scored part)
        self.top_k: dict[str, int] = {}  # rid -> top log-probabilities asked per token
        self.internal: dict[str, str] = {}  # rid -> vLLM's own id of an evicted request
        self.evicting = None  # evict.RUNTIME where kvflow's paths were given, else None
        self.pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        self.peak_blocks = 0  # most blocks of vLLM's KV pool requests held after any step so far

    def _admit_evicted(self, rid: str, spec: dict) -> None:
        if self.evicting is None:
            raise RuntimeError("this vLLM worker was started without kvflow's evicted requests")
        why = self.evicting.refusal(self.evicting.evictor(spec))  # imported and built before vLLM sees the request
        if why:
            raise RuntimeError(why)

    def handle(self, msg) -> bool:
        kind = msg[0]
        if kind == "shutdown":
            return False
        rid = msg[1]
        try:
            if kind == "generate":
                _, rid, ids, params, evict = msg
                if evict:
                    self._admit_evicted(rid, evict)
                sp = self.SamplingParams(**params, output_kind=self.DELTA, detokenize=False)
                internal = self.engine.add_request(rid, {"prompt_token_ids": ids}, sp)
                if evict:
                    self.internal[rid] = internal
                    try:
                        self.evicting.admit(internal, evict)
                    except Exception:
                        self.engine.abort_request([rid])
                        self.internal.pop(rid)
                        raise
                self.kinds[rid], self.made[rid], self.prompt[rid] = "generate", 0, (len(ids), 0)
                self.top_k[rid] = int(params.get("logprobs") or 0)
            elif kind == "kept":
                _, rid, snap = msg
                _send(self.out, "kept", rid, self.evicting.kept(snap))
            elif kind == "score":
                _, rid, ids, start = msg
                # the whole sequence runs (vLLM reads no prefix cache for prompt logprobs)
                sp = self.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                         output_kind=self.DELTA, detokenize=False)
                self.engine.add_request(rid, {"prompt_token_ids": ids}, sp)
                self.kinds[rid], self.made[rid], self.prompt[rid] = "score", 0, (len(ids), start)
            elif kind == "values":
                _, rid, ids, _start, labels, need = msg
                self._values(rid, ids, labels, need)
            elif kind == "abort" and rid in self.kinds:
                self.engine.abort_request([rid])
                self._end(rid, "abort", 0)
        except Exception as exc:  # noqa: BLE001 - reported to the client, the worker goes on
            self.kinds.pop(rid, None)
            _send(self.out, "error", rid, f"{type(exc).__name__}: {exc}")
        return True

    def _end(self, rid: str, finish: str, cached: int) -> None:
        ended = self.evicting.end(self.internal.pop(rid)) if rid in self.internal else None
        if ended is not None and ended[0]:
            self.kinds.pop(rid)
            _send(self.out, "error", rid, ended[0])
            return
        kind = self.kinds.pop(rid)
        self.top_k.pop(rid, None)
        n_prompt, _ = self.prompt.pop(rid)
        meta = {"prompt_tokens": n_prompt, "cached_tokens": cached, "completion_tokens": self.made.pop(rid),
                "kv_blocks_peak": self.peak_blocks}
        if ended is not None:  # its "cached" tokens are those its own KV held (a snapshot's), not prefix-cache hits
            meta.update(ended[1], cached_tokens=0, standins_skipped=cached)
        if kind == "generate":
            _send(self.out, "end", rid, _finish(finish), meta)

    def step(self) -> None:
        outputs = self.engine.step()
        self.peak_blocks = max(self.peak_blocks, self.pool.num_gpu_blocks - 1 - self.pool.get_num_free_blocks())
        for out in outputs:
            rid = out.request_id
            if rid not in self.kinds:
                continue  # aborted meanwhile
            try:
                if self.kinds[rid] == "score":
                    self._scored(rid, out)
                    continue
                if self.kinds[rid] in ("values", "value"):
                    if out.finished:
                        self._valued(rid, out)
                    continue
                c = out.outputs[0]
                ids = list(c.token_ids)
                if ids:
                    lps, tops = [], []
                    k = self.top_k[rid]
                    for tok, entry in zip(ids, c.logprobs or []):
                        lps.append(entry[tok].logprob)
                        # vLLM adds the sampled token to the top k (with its own rank) when it is not in them
                        tops.append(sorted(([lp.logprob, t] for t, lp in entry.items() if lp.rank <= k), reverse=True))
                    _send(self.out, "tokens", rid, ids, lps, tops)
                    self.made[rid] += len(ids)
                if out.finished:
                    self._end(rid, c.finish_reason or "stop", out.num_cached_tokens or 0)
            except Exception as exc:  # noqa: BLE001
                self.kinds.pop(rid, None)
                _send(self.out, "error", rid, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")
        for rid, internal in list(self.internal.items()):  # an evicted request vLLM ran in a way kvflow cannot follow
            if self.evicting.error(internal) and rid in self.kinds:
                self.engine.abort_request([rid])
                self._end(rid, "abort", 0)

    def _scored(self, rid: str, out) -> None:
        if not out.finished:
            return
        _, start = self.prompt[rid]
        ids = out.prompt_token_ids
        entries = out.prompt_logprobs or []  # entry j: log p(ids[j] | ids[:j]); entry 0 is None
        lps = [entries[j][ids[j]].logprob for j in range(max(1, start), len(ids))]
        self.kinds.pop(rid)
        self.made.pop(rid)
        n_prompt, _ = self.prompt.pop(rid)
        _send(self.out, "scored", rid, lps, {"prompt_tokens": n_prompt, "cached_tokens": out.num_cached_tokens or 0})

    def _values(self, rid: str, ids: list, labels, need: list) -> None:
        if self.pooling != (labels is None):
            raise RuntimeError("a process reward model's values need a pooling engine (vLLM's runner 'pooling'), "
                               "label log-probabilities a generating one; this engine's runner is "
                               + ("pooling" if self.pooling else "generate"))
        if self.pooling:  # every position's two-class logits, no activation (vLLM's token pooling reads no cache)
            params = self.PoolingParams(task="token_classify", use_activation=False)
            self.engine.add_request(rid, {"prompt_token_ids": ids}, params)
            self.kinds[rid] = "values"
            return
        positions = sorted(set(int(p) for p in need))
        if not positions or positions[0] < 0 or positions[-1] >= len(ids):
            raise ValueError(f"positions {need} outside the {len(ids)} input tokens")
        self.pending[rid] = {"labels": list(labels), "rows": {}, "left": len(positions), "prompt_tokens": 0,
                             "cached_tokens": 0, "error": None}
        for p in positions:  # the next token's distribution after ids[:p + 1]: p's value
            part = f"{rid}@{p}"
            sp = self.SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=list(labels), detokenize=False)
            self.engine.add_request(part, {"prompt_token_ids": ids[: p + 1]}, sp)
            self.kinds[part], self.parts[part] = "value", (rid, p)

    def _valued(self, rid: str, out) -> None:
        if self.kinds.pop(rid) == "values":
            data = out.outputs.data  # [tokens, 2]: the prompt's every position
            _send(self.out, "scored", rid, {"first": 0, "values": data.float().tolist()},
                  {"prompt_tokens": len(out.prompt_token_ids), "cached_tokens": 0})
            return
        parent, p = self.parts.pop(rid)
        pend = self.pending[parent]
        try:
            entry = out.outputs[0].logprobs[0]  # token -> Logprob: the sampled token's and the labels'
            pend["rows"][p] = [entry[label].logprob for label in pend["labels"]]
        except Exception as exc:  # noqa: BLE001 - reported once, for the values request
            pend["error"] = pend["error"] or f"{type(exc).__name__}: {exc}"
        pend["prompt_tokens"] += len(out.prompt_token_ids)
        pend["cached_tokens"] += out.num_cached_tokens or 0
        pend["left"] -= 1
        if pend["left"]:
            return
        del self.pending[parent]
        if pend["error"]:
            _send(self.out, "error", parent, pend["error"])
            return
        first, last = min(pend["rows"]), max(pend["rows"])
        nan = [float("nan")] * len(pend["labels"])
        values = [pend["rows"].get(q, nan) for q in range(first, last + 1)]
        _send(self.out, "scored", parent, {"first": first, "values": values},
              {"prompt_tokens": pend["prompt_tokens"], "cached_tokens": pend["cached_tokens"]})

    def serve(self, inbox: queue.Queue) -> None:
        while True:
            msgs = []
            try:  # wait for a request only while the engine has nothing to run
                msgs.append(inbox.get(block=not self.engine.has_unfinished_requests()))
                while True:
                    msgs.append(inbox.get_nowait())
            except queue.Empty:
                pass
            for msg in msgs:
                if msg is None or not self.handle(msg):
                    return
            if self.engine.has_unfinished_requests():
                self.step()


def main() -> int:
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # vLLM's prints must not reach the pipe
    hello = wire.read_message(sys.stdin)
    if not hello:
        return 2
    kwargs = dict(hello["engine"])
    kwargs.pop("batch_invariant", None)  # kvflow's: VLLM_BATCH_INVARIANT is in this process's environment
    # kvflow's OpenMP settings (served.settings.engine_arguments, not importable before vLLM is):
    # GOMP_SPINCOUNT, OMP_NUM_THREADS in this process's environment
    for own in ("openmp_spin", "openmp_threads"):
        kwargs.pop(own, None)
    try:
        import vllm
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        evicting = None
        if hello.get("paths"):  # appended once vLLM is imported: its own packages win
            sys.path.extend(p for p in hello["paths"] if p not in sys.path)
            from kvflow.backends.vllm.in_worker import evict

            evicting = evict.register()
        engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
        if evicting is not None:
            evicting.install(engine)
    except BaseException as exc:  # noqa: BLE001 - the client shows it, naming the model entry
        _send(out, "error", None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}")
        return 1
    _send(out, "ready", {"version": vllm.__version__, "settings": resolved_settings(engine)})
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_read, args=(sys.stdin, inbox), daemon=True).start()
    serve = _Serve(engine, out)
    serve.evicting = evicting
    serve.serve(inbox)
    return 0


if __name__ == "__main__":
    sys.exit(main())
