"""`SGLangEngine`: kvflow's engine protocol over SGLang's offline engine.

A full-context problem state is its token ids (prompt + committed steps); an evicted one is a
snapshot in SGLang's scheduler (`evicted.py` here, `evict.py` there). Each proposal sends one
SGLang request per candidate with the whole sequence as input, and SGLang's radix cache
keeps the shared prefix, so a step costs only its new tokens (`stats()` counts the cached
prompt tokens). Candidates stream back token by token; kvflow applies its own stop rules
(EOS, the delimiter over token pieces, the step cap) and pruners to every token, exactly as
on `hf`, and aborts a stopped candidate in the engine so that early exit saves real tokens
(the few the engine produced before the abort reached it are counted, not used).

Sampling: candidate i of a request sends `sampling_seed = row_seed(request.seed, i)`; kvflow's
SGLang plugin (`plugin.py`) makes SGLang draw each token from a hash of that seed and the
token's position, so the same seed and prefix give the same candidate, alone or in any batch
(not the `hf` backend's tokens: another generator). Greedy decoding equals `hf` token for
token on the same weights in float32.

Logprobs are the model's own (temperature 1; SGLang's `SGLANG_RETURN_ORIGINAL_LOGPROB`);
entropies are estimated from the top-`TOP_K` log-probabilities SGLang returns: the
distribution at the sampling temperature over those tokens, plus the rest of the mass spread
evenly over the rest of the vocabulary (`kvflow.backends.signals.entropy_estimate`; docs/backends.md gives its error).
Token confidences (DeepConf's, `StepTrace.confidences`) are exact: minus the mean of the
top-`CONFIDENCE_TOP_K` of those same log-probabilities (`signals.token_confidence`). Stop rules,
pruners and candidates over the streamed rows are `kvflow.backends.streamed`, shared with vLLM.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from kvflow.backends.sglang.client import EngineError, Worker
from kvflow.backends.sglang.evicted import EvictedStates
from kvflow.backends.snapshots import EvictedState
from kvflow.backends.streamed import TOP_K, Row, Running, StreamedRows
from kvflow.components.base import CONFIDENCE_TOP_K
from kvflow.components.engine import Proposal, ProposeRequest, StartRequest, SyncRequest, row_seed
from kvflow.timing import NULL_CLOCK

assert TOP_K >= CONFIDENCE_TOP_K
_POLL_S = 0.02  # longest wait for the engine per step() when rows are decoding


@dataclass
class SGLangState:
    ids: list[int]  # prompt + committed tokens
    dp_rank: Optional[int] = None  # dp_size > 1: the replica whose radix cache holds its prefix


class SGLangEngine(EvictedStates, StreamedRows):
    """One model served by an SGLang worker process (see the module docstring)."""

    backend = "sglang"
    protocol = "0.2"  # engine protocol (kvflow.components.engine.PROTOCOL_VERSION): fills confidences
    exact_entropy = False  # estimated from the top-k logprobs (entropy_estimate)
    streams = True  # decoding runs in the worker process: step() reads what arrived (the scheduler overlaps it)

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
        self.forwards = 0  # step() calls that received tokens (SGLang batches on its own)
        self.rows_decoded = 0  # candidate rows that received tokens in them
        self.counters = {"prompt_tokens": 0, "cached_tokens": 0, "requests": 0, "tokens_used": 0,
                         "tokens_after_stop": 0, "aborted": 0, "ingest_requests": 0, "adopted": 0,
                         "adopted_by_ingest": 0}
        self._init_snapshots()  # evicted states: snapshots live in the scheduler until a later request drops them
        self._rank_load: dict[int, int] = {}  # dp_size > 1: live states per replica (`_route`)
        self.profile = None  # graph.Profile of its decode hook (None: started without kvflow's hooks)
        self.profile_shape = (kv_shape[0], kv_shape[1])  # (layers, KV heads per tensor-parallel rank)
        self.dump_dir: Optional[str] = None  # set: the scheduler saves every snapshot there (`<snap>.pt`)
        self.resolved: dict = {}  # SGLang's server arguments as it resolved them for the device (settings.py)

    def settings(self) -> dict:
        """What this engine runs under, as resolved on this machine (`manifest.json` `engine_settings`)."""
        from kvflow.backends.sglang.settings import RECORDED

        return {"backend": self.backend, "sglang": self.worker.info.get("version"),
                **{k: self.resolved[k] for k in RECORDED if k in self.resolved}}

    def close(self) -> None:
        """This holder is done with the engine (a Session's end): its worker, shared by every
        holder of the same arguments, is closed once none holds it and another has to start
        (`client.close_idle`), or at exit. A dead worker has nothing to abort: closing after
        the engine died (a run or a server stopping on that fault) does not raise again."""
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
        self._rank_load.clear()

    # ------------------------------------------------------------------ text and shapes

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def kv_shape(self) -> tuple[int, int, int, int]:
        return self._kv_shape

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas of the engine (SGLang's resolved `dp_size`)."""
        return int(self.resolved.get("dp_size") or 1)

    def _route(self) -> Optional[int]:
        """The replica a new problem state lives on: the one with the fewest of this engine's
        live states (lowest first); None with one replica. Every request made from the state
        goes there (its snapshots, or its prefix in the radix cache, are there)."""
        if self.dp_size < 2:
            return None
        rank = min(range(self.dp_size), key=lambda r: (self._rank_load.get(r, 0), r))
        self._rank_load[rank] = self._rank_load.get(rank, 0) + 1
        return rank

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every request sent so far has ended in the engine (candidates kvflow
        stopped report how far they got a little later), so that `stats()` and `counters`
        count them; proposals still running keep streaming meanwhile."""
        deadline = time.monotonic() + timeout
        while (self._used or self._evicted_rids or self._ingests) and time.monotonic() < deadline:
            self._take(self.worker.poll(_POLL_S))

    def stats(self) -> dict:
        """Prefix-cache hits and early-exit savings so far (for the run summary and benchmarks)."""
        c = dict(self.counters)
        c["prefix_cache_hit_rate"] = round(c["cached_tokens"] / c["prompt_tokens"], 4) if c["prompt_tokens"] else None
        return c

    # ------------------------------------------------------------------ states

    def check_evictor(self, evictor) -> None:
        """Refuse, before any request, an evictor this engine's decode hook was not started for
        (`graph.Profile`: kvflow starts each engine for the evictors the pipeline serves on it)."""
        from kvflow.backends.sglang.graph import profile_problem

        if self.profile is None:
            raise EngineError(f"evictor {type(evictor).__name__}: this SGLang engine was started for full-context "
                              "proposers and scorers only (no kvflow hook); load it with the evictors it serves")
        layers, kv_heads = self.profile_shape
        why = profile_problem(self.profile, evictor, layers, kv_heads, graphs=False)
        if why:
            raise EngineError(f"evictor {type(evictor).__name__} cannot run on this SGLang engine: {why}")

    def start(self, requests: Sequence[StartRequest]) -> list:
        out = []
        for r in requests:
            ids = self.encode(r.prompt)
            if not getattr(r.evictor, "bounded", True):
                out.append(SGLangState(ids, self._route()))
                continue
            if getattr(r.evictor.params, "quantize", None):
                raise EngineError("backend 'sglang' does not store quantized KV (evictor `quantize`); "
                                  "put this proposer's model on backend 'hf'")
            self.check_evictor(r.evictor)
            out.append(EvictedState(ids, None, 0, 0, r.evictor, r.rng_key, r.evictor.n_protected(len(ids) - 1),
                                    self._route()))
        self._catch_up([s for s in out if isinstance(s, EvictedState)])
        return out

    def sync(self, requests: Sequence[SyncRequest]) -> list:
        out = []
        for r in requests:
            if isinstance(r.state, EvictedState):
                out.append(self._sync_evicted(r))
            elif r.own_index is not None:
                out.append(SGLangState(r.state.ids + list(r.proposal.candidates[r.own_index].token_ids),
                                       r.state.dp_rank))
            else:
                out.append(SGLangState(r.state.ids + self.encode(r.text), r.state.dp_rank))
        self._catch_up([s for s in out if isinstance(s, EvictedState)])
        return out

    def release(self, states: Sequence, proposals: Sequence[Proposal] = ()) -> None:
        # a full-context state is a token list (SGLang's radix cache evicts prefixes on its
        # own); an evicted one is a snapshot in the scheduler, dropped with the next request
        for s in states:
            if isinstance(s, EvictedState) and s.snap:
                self._drop(s.snap)
            rank = getattr(s, "dp_rank", None)
            if rank is not None and self._rank_load.get(rank):
                self._rank_load[rank] -= 1
        for p in proposals:
            for row in p.handle or ():
                self._discard(row)

    def server_state(self) -> dict:
        """The scheduler's KV slots in use and kvflow's snapshots (`evict.py`)."""
        rid = self.worker.new_rid("q")
        self._scores[rid] = None
        self.worker.send("state", rid)
        self._wait(lambda: self._scores[rid] is not None, "the engine's state")
        msg = self._scores.pop(rid)
        if msg[0] == "error":
            raise EngineError(f"{self.worker.where}: SGLang state query failed: {msg[2]}")
        return msg[2]

    # ------------------------------------------------------------------ proposals

    def _send_row(self, req: ProposeRequest, i: int, row: Row, cap: int) -> None:
        spec = req.spec
        params = {"max_new_tokens": cap, "temperature": spec.temperature, "top_p": spec.top_p,
                  "stop": [spec.delimiter] if spec.delimiter else [], "no_stop_trim": True,
                  "skip_special_tokens": False}
        if spec.temperature > 0:
            params["sampling_seed"] = row_seed(req.seed, i)
        state, ids = req.state, req.state.ids
        if isinstance(state, EvictedState):  # from the state's snapshot: its resident tail + the pending token
            row.snap = "c-" + row.rid
            self._own(row.snap, state)
            self._evicted_rids.add(row.rid)
            params["custom_params"] = {"kvflow_evict": self._spec(
                state, rng_key=row_seed(state.rng_key, i), save_as=row.snap)}
            ids = ids[state.cached - state.resident :]
        self.worker.send("generate", row.rid, ids, params, TOP_K, state.dp_rank)

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
                done.append(self._finish(r))
        return done

    def _take(self, replies) -> int:
        """Apply replies: streamed tokens first (with stop rules and pruners), then the ends
        the engine reported. Returns the number of candidate rows that got tokens."""
        fresh: dict[int, tuple[Running, list[tuple[Row, list]]]] = {}
        ends: list = []
        for msg in replies:
            self._dispatch(msg, fresh, ends)
        rows = sum(len({id(row) for row, _ in v[1]}) for v in fresh.values())
        self.rows_decoded += rows
        with self.clock.phase("prune"):
            for running, arrivals in fresh.values():
                self._advance(running, arrivals)
        for row, reason in ends:
            if row.finish is None:  # the engine stopped it first: the cap (anything else, kvflow saw)
                row.finish = _engine_finish(reason)
        return rows

    def _dispatch(self, msg, fresh, ends) -> None:
        kind, rid = msg[0], msg[1]
        if kind in ("scored", "state") or (kind == "error" and rid in self._scores):
            self._scores[rid] = msg
            return
        if rid in self._ingests:
            if kind in ("end", "error"):
                self._ingests[rid] = msg
            return
        if kind == "end" and rid in self._evicted_rids:
            self._evicted_end(rid, (msg[2] or {}).get("type") == "abort", (msg[3] or {}).get("completion_tokens") or 0)
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
            ends.append((row, msg[2]))
            self._rows.pop(rid, None)
        elif kind == "error":
            raise EngineError(f"{self.worker.where}: SGLang request failed: {msg[2]}")

    def _count_prefix(self, meta: dict) -> None:
        self.counters["prompt_tokens"] += meta.get("prompt_tokens") or 0
        self.counters["cached_tokens"] += meta.get("cached_tokens") or 0

    def _stop(self, row: Row) -> None:
        """kvflow ended this candidate: stop it in the engine (unless the engine stops it too)."""
        self._rows.pop(row.rid, None)
        self._used[row.rid] = len(row.tokens)
        if row.finish.startswith("pruned:") or row.finish == "delimiter":
            self.worker.send("abort", row.rid)
            self.counters["aborted"] += row.finish.startswith("pruned:")

    def _finish(self, r: Running) -> Proposal:
        self.counters["tokens_used"] += sum(len(row.tokens) for row in r.rows)
        return Proposal(r.request, self._candidates(r),
                        handle=r.rows if isinstance(r.request.state, EvictedState) else None)

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
                raise EngineError(f"{self.worker.where}: SGLang scoring failed: {msg[2]}")
            self._count_prefix(msg[3])
            out.append([float(x) for x in msg[2]])
        return out


def _engine_finish(reason: dict) -> str:
    matched = reason.get("matched")
    if isinstance(matched, int):
        return "eos"
    return "delimiter" if matched is not None else "max_step_tokens"
