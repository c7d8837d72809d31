"""`VLLMEngine`: kvflow's engine protocol over a vLLM worker (proposers, full-context or evicted, and scoring).

A full-context problem state is its token ids (prompt + committed steps); an evicted one is a
snapshot in the worker (`evicted.py` here, `evict.py` there). Each proposal sends one vLLM
request per candidate with the whole sequence as input; vLLM's prefix cache keeps the shared
prefix in whole KV blocks (128 tokens on a CPU), so a step costs little more than its new tokens
(`stats()` counts the cached prompt tokens). Candidates stream back token by token; kvflow applies
its own stop rules (EOS, the delimiter over token pieces, the step cap) and pruners to every token,
exactly as on `hf` (`kvflow.backends.streamed`), and aborts a candidate it stopped in the engine,
so that early exit saves real tokens (the few vLLM made before the abort reached it are counted,
not used).

Sampling: candidate i of a request sends vLLM's per-request `seed = row_seed(request.seed, i)`.
vLLM draws each of that request's tokens from its own generator, so the same seed and prefix
give the same candidate, alone or in any batch (not the `hf` backend's tokens: another
generator). Temperature and top-p are vLLM's (the nucleus keeps the token that crosses top_p).
Greedy decoding equals `hf` token for token on the same weights in float32.

Logprobs are the model's own (temperature 1: vLLM's `logprobs_mode: raw_logprobs`); entropies
are estimated from the top-`TOP_K` log-probabilities and token confidences are exact, as on SGLang
(`kvflow.backends.signals`). Scoring (`likelihood`) uses vLLM's prompt log-probabilities over the
whole sequence (vLLM reads no prefix cache for a request that asks for them).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from kvflow.backends.streamed import TOP_K, Row, Running, StreamedRows
from kvflow.backends.vllm.client import EngineError, Worker
from kvflow.backends.snapshots import EvictedState
from kvflow.backends.vllm.evicted import EvictedStates
from kvflow.components.engine import Proposal, ProposeRequest, StartRequest, SyncRequest, row_seed
from kvflow.timing import NULL_CLOCK

_POLL_S = 0.02  # longest wait for the engine per step() when rows are decoding


@dataclass
class VLLMState:
    ids: list[int]  # prompt + committed tokens


class VLLMEngine(EvictedStates, StreamedRows):
    """One model served by a vLLM worker process (see the module docstring)."""

    backend = "vllm"
    protocol = "0.2"  # engine protocol (kvflow.components.engine.PROTOCOL_VERSION): fills confidences
    evicts = True  # evicted proposers through kvflow's worker hooks (evict.py; docs/backends.md, "vllm")
    exact_entropy = False  # estimated from the top-k logprobs (entropy_estimate)
    streams = True  # decoding runs in the worker process: step() reads what arrived

    def __init__(self, worker: Worker, tokenizer: Any, *, vocab_size: int, kv_shape: tuple[int, int, int, int],
                 eos_ids: set[int], device: str) -> None:
        self.worker, self.tokenizer = worker, tokenizer
        self.vocab_size, self._kv_shape, self.eos_ids, self.device = vocab_size, kv_shape, eos_ids, device
        self.clock = NULL_CLOCK
        self.label = ""
        self.waiting: deque[ProposeRequest] = deque()
        self.running: list[Running] = []
        self._rows: dict[str, tuple[Running, Row]] = {}
        self._scores: dict[str, Any] = {}
        self._pieces: dict[int, str] = {}
        self._used: dict[str, int] = {}  # rid -> tokens kvflow kept, of candidates it stopped
        self.forwards = 0  # step() calls that received tokens (vLLM batches on its own)
        self.rows_decoded = 0  # candidate rows that received tokens in them
        self.counters = {"prompt_tokens": 0, "cached_tokens": 0, "requests": 0, "tokens_used": 0,
                         "tokens_after_stop": 0, "aborted": 0, "ingest_requests": 0, "adopted": 0,
                         "adopted_by_ingest": 0, "evicted_recomputes": 0,
                         "standins_skipped": 0, "kv_blocks_peak": 0}
        self._init_evicted()

    def settings(self) -> dict:
        """What this engine runs under, as vLLM resolved it on this machine (`manifest.json`)."""
        from kvflow.backends.vllm.settings import RECORDED

        resolved = self.worker.info.get("settings") or {}
        return {"backend": self.backend, "vllm": self.worker.info.get("version"),
                **{k: resolved[k] for k in RECORDED if k in resolved}}

    def close(self) -> None:
        """This holder is done with the engine: its worker, shared by every holder of the same
        arguments, is closed once none holds it and another has to start, or at exit."""
        self.worker.holders = max(0, self.worker.holders - 1)
        if self.worker.proc.poll() is None:
            self.reset()

    def reset(self) -> None:
        for r in self.running:
            for row in r.rows:
                if row.finish is None:
                    self.worker.send("abort", row.rid)
        self.waiting.clear()
        self.running.clear()
        self._rows.clear()
        self._used.clear()
        self._reset_snapshots()

    # ------------------------------------------------------------------ text and shapes

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def kv_shape(self) -> tuple[int, int, int, int]:
        return self._kv_shape

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every candidate kvflow stopped has ended in the engine, so that `stats()`
        counts the tokens vLLM made after the stop; running proposals keep streaming meanwhile."""
        deadline = time.monotonic() + timeout
        while (self._used or self._evicted_rids or self._ingests) and time.monotonic() < deadline:
            self._take(self.worker.poll(_POLL_S))

    def stats(self) -> dict:
        """Prefix-cache hits and early-exit savings so far (for the run summary and benchmarks)."""
        c = dict(self.counters)
        c["prefix_cache_hit_rate"] = round(c["cached_tokens"] / c["prompt_tokens"], 4) if c["prompt_tokens"] else None
        return c

    # ------------------------------------------------------------------ states

    def start(self, requests: Sequence[StartRequest]) -> list:
        out = []
        for r in requests:
            ids = self.encode(r.prompt)
            if not getattr(r.evictor, "bounded", True):
                out.append(VLLMState(ids))
                continue
            if getattr(r.evictor.params, "quantize", None):
                raise EngineError("backend 'vllm' does not store quantized KV (evictor `quantize`); "
                                  "put this proposer's model on backend 'hf'")
            out.append(EvictedState(ids, None, 0, 0, r.evictor, r.rng_key, r.evictor.n_protected(len(ids) - 1)))
        self._catch_up([s for s in out if isinstance(s, EvictedState)])
        return out

    def sync(self, requests: Sequence[SyncRequest]) -> list:
        out = []
        for r in requests:
            if isinstance(r.state, EvictedState):
                out.append(self._sync_evicted(r))
            elif r.own_index is not None:
                out.append(VLLMState(r.state.ids + list(r.proposal.candidates[r.own_index].token_ids)))
            else:
                out.append(VLLMState(r.state.ids + self.encode(r.text)))
        self._catch_up([s for s in out if isinstance(s, EvictedState)])
        return out

    def release(self, states: Sequence, proposals: Sequence[Proposal] = ()) -> None:
        """A full-context state is a token list (vLLM's prefix cache frees blocks on its own);
        an evicted one is a snapshot in the worker, dropped with the next evicted request."""
        for s in states:
            if isinstance(s, EvictedState):
                self._drop(s.snap)
        for p in proposals:
            for row in p.handle or ():
                self._discard(row)

    # ------------------------------------------------------------------ proposals

    def _send_row(self, req: ProposeRequest, i: int, row: Row, cap: int) -> None:
        spec = req.spec
        # no stop strings: kvflow ends a step at the delimiter itself (matched on token
        # pieces as on `hf`) and aborts the request; EOS is the engine's stop too
        params = {"max_tokens": cap, "temperature": spec.temperature, "logprobs": TOP_K,
                  "stop_token_ids": sorted(self.eos_ids)}
        if spec.temperature > 0:
            params.update(top_p=spec.top_p, seed=row_seed(req.seed, i))
        state, evict = req.state, None
        if isinstance(state, EvictedState):  # the whole sequence; its evicted part starts at the pending token
            row.snap = "c-" + row.rid
            self._own(row.snap, state)
            self._evicted_rids.add(row.rid)
            evict = self._spec(state, rng_key=row_seed(state.rng_key, i), save_as=row.snap)
        self.worker.send("generate", row.rid, state.ids, params, evict)

    def step(self, max_rows: Optional[int] = None) -> list[Proposal]:
        self._admit(max_rows)
        with self.clock.phase(f"forward:{self.label}"):
            replies = self.worker.poll(_POLL_S if self.running else 0.0)
        if self._take(replies):
            self.forwards += 1
        done = []
        for r in list(self.running):
            if all(row.finish is not None for row in r.rows):
                self.running.remove(r)
                self.counters["tokens_used"] += sum(len(row.tokens) for row in r.rows)
                evicted = isinstance(r.request.state, EvictedState)
                done.append(Proposal(r.request, self._candidates(r), handle=r.rows if evicted else None))
        return done

    def _take(self, replies) -> int:
        """Apply replies: streamed tokens first (with stop rules and pruners), then the ends
        the engine reported. Returns the number of candidate rows that got tokens."""
        fresh: dict[int, tuple[Running, list]] = {}
        ends: list = []
        for msg in replies:
            self._dispatch(msg, fresh, ends)
        rows = sum(len({id(row) for row, _ in v[1]}) for v in fresh.values())
        self.rows_decoded += rows
        with self.clock.phase("prune"):
            for running, arrivals in fresh.values():
                self._advance(running, arrivals)
        for row, reason, made in ends:
            if row.finish is None:  # the engine stopped it first: EOS or the cap (kvflow saw the tokens)
                row.finish = "eos" if row.tokens and row.tokens[-1] in self.eos_ids else "max_step_tokens"
                if reason == "abort":
                    raise EngineError(f"{self.worker.where}: vLLM aborted request {row.rid} (kvflow did not)")
            else:  # kvflow stopped it on tokens that came with the engine's own end: nothing left to abort
                self.counters["tokens_after_stop"] += max(0, made - len(row.tokens))
        return rows

    def _dispatch(self, msg, fresh, ends) -> None:
        kind, rid = msg[0], msg[1]
        if kind == "scored" or (kind == "error" and rid in self._scores):
            self._scores[rid] = msg
            return
        if kind == "kept" or (kind == "error" and rid in self._kept):
            self._kept[rid] = msg
            return
        if rid in self._ingests:
            if kind in ("end", "error"):
                self._ingests[rid] = msg
            return
        if kind in ("end", "error") and rid in self._evicted_rids:
            ended = kind == "end"
            self._evicted_end(rid, not ended or msg[2] == "abort",
                              (msg[3] or {}).get("completion_tokens") or 0 if ended else 0)
        owner = self._rows.get(rid)
        if owner is None:
            if kind == "end":  # a candidate kvflow stopped: what the engine made after the stop
                used = msg[3].get("completion_tokens") or 0
                self.counters["tokens_after_stop"] += max(0, used - self._used.pop(rid, used))
                self._count_prefix(msg[3])
            return
        running, row = owner
        if kind == "tokens":
            entry = fresh.setdefault(id(running), (running, []))
            entry[1].append((row, list(zip(msg[2], msg[3], msg[4]))))
        elif kind == "end":
            self._count_prefix(msg[3])
            ends.append((row, msg[2], msg[3].get("completion_tokens") or 0))
            self._rows.pop(rid, None)
        elif kind == "error":
            raise EngineError(f"{self.worker.where}: vLLM request failed: {msg[2]}")

    def _count_prefix(self, meta: dict) -> None:
        self.counters["prompt_tokens"] += meta.get("prompt_tokens") or 0
        self.counters["cached_tokens"] += meta.get("cached_tokens") or 0
        self.counters["evicted_recomputes"] += meta.get("recomputes") or 0
        self.counters["standins_skipped"] += meta.get("standins_skipped") or 0
        self.counters["kv_blocks_peak"] = max(self.counters["kv_blocks_peak"], meta.get("kv_blocks_peak") or 0)

    def _stop(self, row: Row) -> None:
        """kvflow ended this candidate: stop it in the engine (EOS and the cap vLLM stops itself)."""
        self._rows.pop(row.rid, None)
        self._used[row.rid] = len(row.tokens)
        if row.finish.startswith("pruned:") or row.finish == "delimiter":
            self.worker.send("abort", row.rid)
            self.counters["aborted"] += row.finish.startswith("pruned:")

    # ------------------------------------------------------------------ scoring

    def scoring_session(self):
        from kvflow.backends.prompt_logprobs import ScoringSession

        return ScoringSession(self)

    def score_ids(self, sequences: Sequence[tuple[list[int], int]]) -> list[list[float]]:
        """log p of ids[start:] given what precedes, for each (ids, start): prompt logprobs."""
        rids = []
        for ids, start in sequences:
            rid = self.worker.new_rid("s")
            self._scores[rid] = None
            self.worker.send("score", rid, ids, start)
            rids.append(rid)
        self._wait(lambda: all(self._scores[r] is not None for r in rids), "scores")
        out = []
        for rid in rids:
            msg = self._scores.pop(rid)
            if msg[0] == "error":
                raise EngineError(f"{self.worker.where}: vLLM scoring failed: {msg[2]}")
            self._count_prefix(msg[3])
            out.append([float(x) for x in msg[2]])
        return out
