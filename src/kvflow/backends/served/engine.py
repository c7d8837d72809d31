"""`ServedEngine`: kvflow's engine protocol over an engine in a worker process (SGLang, vLLM).

A full-context problem state is its token ids (prompt + committed steps); an evicted one is a
snapshot inside the engine (`snapshots.py`). Each proposal sends one request per candidate
(`_send_row`, the backend's own: its sampling parameters and how it names the evicted part);
the engine's prefix cache keeps the shared prefix, so a step costs little more than its new
tokens (`stats()` counts the cached prompt tokens). Candidates stream back token by token; kvflow
applies its own stop rules (EOS, the delimiter over token pieces, the step cap) and pruners to
every token, exactly as on `hf` (`streamed.py`), and aborts a candidate it stopped, so that early
exit saves real tokens (the few the engine made before the abort reached it are counted, not used).

Logprobs are the model's own (temperature 1); entropies are estimated from the top-`TOP_K`
log-probabilities and token confidences are exact (`signals.py`). Scoring asks the engine for
prompt log-probabilities (`score_ids`, `scoring_session`) and per-position values
(`position_values`, for the `prm` and `llm_judge` scorers).

A backend subclasses this with what differs: `backend` and `engine_name`, `RECORDED` (the
resolved settings `manifest.json` keeps), `_send_row`, `_send_ingest` and `_spec` (evicted
requests), and optionally `check_evictor`, `_route`/`_unroute` (data-parallel replicas) and
`kept_kv`. Everything here speaks `wire.py`'s messages through `worker.Worker`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from kvflow.backends.served.snapshots import POLL_S, EvictedState, SnapshotStates
from kvflow.backends.served.streamed import TOP_K, Row, Running, StreamedRows
from kvflow.backends.served.wire import ABORT, LENGTH, STOP_STRING, STOP_TOKEN
from kvflow.backends.served.worker import Worker
from kvflow.components.base import CONFIDENCE_TOP_K
from kvflow.components.engine import EngineBase, Proposal, ProposeRequest, StartRequest, SyncRequest
from kvflow.errors import EngineError
from kvflow.timing import NULL_CLOCK

assert TOP_K >= CONFIDENCE_TOP_K

#: kvflow's finish reason for an engine's (wire.FINISHES), where the engine ended a candidate first
_FINISH = {STOP_TOKEN: "eos", STOP_STRING: "delimiter", LENGTH: "max_step_tokens"}

#: counters every served engine keeps (`stats()`); a backend adds its own (`OWN_COUNTERS`). A
#: reply's `meta` adds to the counter of the same name (`*_peak`: the largest)
COUNTERS = ("prompt_tokens", "cached_tokens", "requests", "tokens_used", "tokens_after_stop", "aborted",
            "ingest_requests", "adopted", "adopted_by_ingest")


@dataclass
class FullState:
    ids: list[int]  # prompt + committed tokens
    dp_rank: Optional[int] = None  # the data-parallel replica whose prefix cache holds its prefix (None: one)


class ServedEngine(SnapshotStates, StreamedRows, EngineBase):
    """One model served by an engine in a worker process (see the module docstring)."""

    backend = ""  # the registry name ("sglang")
    engine_name = ""  # in messages ("SGLang")
    protocol = "0.2"  # engine protocol (kvflow.components.engine.PROTOCOL_VERSION): fills confidences
    evicts = True  # evicted proposers through kvflow's hooks inside the engine
    exact_entropy = False  # estimated from the top-k logprobs (signals.entropy_estimate)
    streams = True  # decoding runs in the worker process: step() reads what arrived
    RECORDED: tuple = ()  # resolved settings `settings()` reports
    CONTEXT_SETTING = ""  # the resolved setting that is the model's context in tokens
    OWN_COUNTERS: tuple = ()

    def __init__(self, worker: Worker, tokenizer: Any, *, vocab_size: int, kv_shape: tuple[int, int, int, int],
                 eos_ids: set[int], device: str) -> None:
        self.worker, self.tokenizer = worker, tokenizer
        self.vocab_size, self._kv_shape, self.eos_ids, self.device = vocab_size, kv_shape, eos_ids, device
        self.resolved: dict = dict(worker.info.get("settings") or {})  # the engine's settings as it resolved them
        self.clock = NULL_CLOCK
        self.label = ""
        self.waiting: deque[ProposeRequest] = deque()
        self.running: list[Running] = []
        self._rows: dict[str, tuple[Running, Row]] = {}  # rid -> its proposal and row, until the engine ends it
        self._queries: dict[str, Any] = {}  # one-shot request rid -> its reply (None: waiting)
        self._pieces: dict[int, str] = {}
        self._used: dict[str, int] = {}  # rid -> tokens kvflow kept, of candidates it stopped
        self.forwards = 0  # step() calls that received tokens (the engine batches on its own)
        self.rows_decoded = 0  # candidate rows that received tokens in them
        self.counters = dict.fromkeys(COUNTERS + self.OWN_COUNTERS, 0)
        self._init_snapshots()  # evicted states: snapshots live in the engine until a later request drops them

    def settings(self) -> dict:
        """What this engine runs under, as resolved on this machine (`manifest.json` `engine_settings`)."""
        return {"backend": self.backend, self.backend: self.worker.info.get("version"),
                **{k: self.resolved[k] for k in self.RECORDED if k in self.resolved}}

    def close(self) -> None:
        """This holder is done with the engine (a Session's end): its worker, shared by every
        holder of the same arguments, is closed once none holds it and another has to start
        (`worker.close_idle`), or at exit. A dead worker has nothing to abort: closing after
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

    # ------------------------------------------------------------------ text and shapes

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def kv_shape(self) -> tuple[int, int, int, int]:
        return self._kv_shape

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every request sent so far has ended in the engine (candidates kvflow
        stopped report how far they got a little later), so that `stats()` counts them;
        proposals still running keep streaming meanwhile."""
        deadline = time.monotonic() + timeout
        while (self._used or self._evicted_rids or self._ingests) and time.monotonic() < deadline:
            self._take(self.worker.poll(POLL_S))

    def context_length(self) -> Optional[int]:
        n = self.resolved.get(self.CONTEXT_SETTING)
        return int(n) if n else None

    def stats(self) -> dict:
        """Prefix-cache hits and early-exit savings so far (for the run summary and benchmarks)."""
        c = dict(self.counters)
        c["prefix_cache_hit_rate"] = round(c["cached_tokens"] / c["prompt_tokens"], 4) if c["prompt_tokens"] else None
        return c

    # ------------------------------------------------------------------ states

    def check_evictor(self, evictor) -> None:
        """Refuse, before any request, an evictor this engine cannot serve (raise EngineError)."""

    def _route(self) -> Optional[int]:
        """The data-parallel replica a new problem state lives on (None: one replica)."""
        return None

    def _unroute(self, state) -> None:
        """A state on a replica was released."""

    def start(self, requests: Sequence[StartRequest]) -> list:
        out = []
        for r in requests:
            ids = self.encode(r.prompt)
            if not getattr(r.evictor, "bounded", True):
                out.append(FullState(ids, self._route()))
                continue
            if getattr(r.evictor.params, "quantize", None):
                raise EngineError(f"backend {self.backend!r} does not store quantized KV (evictor `quantize`); "
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
                out.append(FullState(r.state.ids + list(r.proposal.candidates[r.own_index].token_ids), r.state.dp_rank))
            else:
                out.append(FullState(r.state.ids + self.encode(r.text), r.state.dp_rank))
        self._catch_up([s for s in out if isinstance(s, EvictedState)])
        return out

    def release(self, states: Sequence, proposals: Sequence[Proposal] = ()) -> None:
        """A full-context state is a token list (the engine's prefix cache frees blocks on its
        own); an evicted one is a snapshot in the engine, dropped with the next request."""
        for s in states:
            if isinstance(s, EvictedState):
                self._drop(s.snap)
            self._unroute(s)
        for p in proposals:
            for row in p.handle or ():
                self._discard(row)

    # ------------------------------------------------------------------ proposals

    def _send_row(self, req: ProposeRequest, i: int, row: Row, cap: int) -> None:
        """Start candidate i of `req` in the engine (for an evicted state: from its snapshot,
        leaving snapshot `row.snap` at its end)."""
        raise NotImplementedError

    def _send_ingest(self, state: EvictedState, rid: str, end: int, spec: dict) -> None:
        """One request that makes snapshot `s-<rid>` of the state's tokens up to `end`
        (`snapshots.SnapshotStates._catch_up`); `spec` is `_spec`'s."""
        raise NotImplementedError

    def _evicted_row(self, state: EvictedState, row: Row) -> None:
        """Candidate `row` of an evicted state leaves snapshot `c-<rid>` at its end."""
        row.snap = "c-" + row.rid
        self._own(row.snap, state)
        self._evicted_rids.add(row.rid)

    def step(self, max_rows: Optional[int] = None) -> list[Proposal]:
        self._admit(max_rows)
        with self.clock.phase(f"forward:{self.label}"):
            replies = self.worker.poll(POLL_S if self.running else 0.0)
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
        for row, finish, meta in ends:
            if row.finish is None:  # the engine stopped it first (kvflow saw every token it made)
                if finish == ABORT:
                    why = f": {meta['message']}" if meta.get("message") else ""
                    raise EngineError(f"{self.worker.where}: {self.engine_name} aborted request {row.rid} "
                                      f"(kvflow did not){why}")
                row.finish = _FINISH[finish]
            else:  # kvflow stopped it on tokens that came with the engine's own end: nothing left to abort
                self._count_after_stop(row.rid, meta)
        return rows

    def _dispatch(self, msg, fresh, ends) -> None:
        kind, rid = msg[0], msg[1]
        if rid in self._queries:
            self._queries[rid] = msg
            return
        if rid in self._ingests:
            if kind in ("end", "error"):
                self._ingests[rid] = msg
            return
        if kind in ("end", "error") and rid in self._evicted_rids:
            ended = kind == "end"
            self._evicted_end(rid, not ended or msg[2] == ABORT,
                              (msg[3] or {}).get("completion_tokens") or 0 if ended else 0)
        owner = self._rows.get(rid)
        if owner is None:
            if kind == "end":  # a candidate kvflow stopped: what the engine made after the stop
                self._count_after_stop(rid, msg[3])
                self._count_meta(msg[3])
            return
        running, row = owner
        if kind == "tokens":
            entry = fresh.setdefault(id(running), (running, []))
            entry[1].append((row, list(zip(msg[2], msg[3], msg[4]))))
        elif kind == "end":
            self._count_meta(msg[3])
            ends.append((row, msg[2], msg[3] or {}))
            self._rows.pop(rid, None)
        elif kind == "error":
            raise EngineError(f"{self.worker.where}: {self.engine_name} request failed: {msg[2]}")

    def _count_after_stop(self, rid: str, meta: dict) -> None:
        """A candidate kvflow stopped has ended in the engine: the tokens it made past kvflow's stop."""
        made = (meta or {}).get("completion_tokens") or 0
        self.counters["tokens_after_stop"] += max(0, made - self._used.pop(rid, made))

    def _count_meta(self, meta: dict) -> None:
        """Add a reply's counts to the counters of the same name (`*_peak`: keep the largest)."""
        for key, value in (meta or {}).items():
            if key in self.counters and value:
                self.counters[key] = max(self.counters[key], value) if key.endswith("_peak") else self.counters[key] + value

    def _stop(self, row: Row) -> None:
        """kvflow ended this candidate: stop it in the engine (EOS and the cap the engine stops itself)."""
        self._rows.pop(row.rid, None)
        self._used[row.rid] = len(row.tokens)
        if row.finish.startswith("pruned:") or row.finish == "delimiter":
            self.worker.send("abort", row.rid)
            self.counters["aborted"] += row.finish.startswith("pruned:")

    # ------------------------------------------------------------------ one-shot requests and scoring

    def ask(self, requests: Sequence[tuple], what: str) -> list:
        """Send one-shot requests, each (kind, *args) getting a fresh rid after its kind, and
        wait for every reply (proposals keep streaming meanwhile): [(payload, meta)], in order;
        a reply's meta counts toward `stats()`."""
        rids = []
        for kind, *args in requests:
            rid = self.worker.new_rid(kind[0])
            self._queries[rid] = None
            self.worker.send(kind, rid, *args)
            rids.append(rid)
        self._wait(lambda: all(self._queries[r] is not None for r in rids), what)
        out = []
        for rid in rids:
            msg = self._queries.pop(rid)
            if msg[0] == "error":
                raise EngineError(f"{self.worker.where}: {self.engine_name} {what} failed: {msg[2]}")
            meta = msg[3] if len(msg) > 3 else {}
            self._count_meta(meta)
            out.append((msg[2], meta))
        return out

    def scoring_session(self):
        from kvflow.backends.served.prompt_logprobs import ScoringSession

        return ScoringSession(self)

    def score_ids(self, sequences: Sequence[tuple[list[int], int]]) -> list[list[float]]:
        """log p of ids[start:] given what precedes, for each (ids, start): prompt logprobs."""
        replies = self.ask([("score", ids, start) for ids, start in sequences], "scoring")
        return [[float(x) for x in lps] for lps, _ in replies]

    def position_values(self, *, head: bool = False, labels: Optional[Sequence[int]] = None):
        """Per-position values for a scorer (`position_values.PositionValues`): a process reward
        model's head outputs (`head=True`) or label-token log-probabilities."""
        from kvflow.backends.served.position_values import PositionValues

        return PositionValues(self, head=head, labels=labels)
