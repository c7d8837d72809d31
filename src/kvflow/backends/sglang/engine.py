"""`SGLangEngine`: kvflow's engine protocol over SGLang's offline engine (full-context proposers).

A problem's state is its token ids (prompt + committed steps); each proposal sends one
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
evenly over the rest of the vocabulary (`entropy_estimate`; docs/backends.md gives its error).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from kvflow.backends.sglang.client import EngineError, Worker
from kvflow.components.base import Candidate, StepTrace
from kvflow.components.engine import Proposal, ProposeRequest, StartRequest, SyncRequest, delimiter_scan, row_seed
from kvflow.timing import NULL_CLOCK

TOP_K = 20  # top log-probabilities per token, for the entropy estimate
_POLL_S = 0.02  # longest wait for the engine per step() when rows are decoding


@dataclass
class SGLangState:
    ids: list[int]  # prompt + committed tokens


@dataclass
class EvictedState:
    """An evicted problem state: a snapshot in the SGLang scheduler (`evict.py`) holding the
    first `cached` tokens of `ids` evicted down to `resident` per (layer, KV head); the rest
    of `ids` (at least the pending token) is not cached yet."""

    ids: list[int]  # the logical sequence: prompt + committed tokens, the pending token last
    snap: Optional[str]  # snapshot id (None: nothing cached yet)
    cached: int  # leading tokens of `ids` the snapshot has seen
    resident: int  # tokens it holds per (layer, KV head)
    evictor: Any
    rng_key: int
    n_protected: int


@dataclass
class _Row:
    rid: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    text: str = ""  # the token pieces so far (what pruners and the delimiter see)
    finish: Optional[str] = None
    signals: dict = field(default_factory=dict)
    match: int = 0  # leading characters of the delimiter the text ends with
    snap: Optional[str] = None  # evicted proposals: the snapshot the candidate leaves at its end


class _Running:
    def __init__(self, request: ProposeRequest, rows: list[_Row], cap: int) -> None:
        self.request, self.rows, self.cap = request, rows, cap


def entropy_estimate(top: Sequence[tuple[float, int]], temperature: float, vocab: int) -> float:
    """Entropy (nats) of the sampling distribution from the top-k temperature-1 logprobs.

    The k listed tokens get p_i^(1/T) (T = 1 for greedy, as on `hf`); the missing mass
    r = 1 - sum p_i is taken as spread evenly over the other vocab - k tokens. Exact when k
    covers the whole support; otherwise an estimate (at T = 1 an upper bound)."""
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    logs = [lp * inv_t for lp, _ in top]
    rest = max(0.0, 1.0 - sum(math.exp(lp) for lp, _ in top))
    others = max(0, vocab - len(top))
    if rest > 0 and others:
        tail_log = math.log(rest / others) * inv_t  # log q of one tail token
        logs_all = logs + [tail_log + math.log(others)]  # the tail as one lump, for the partition
    else:
        tail_log, logs_all = None, logs
    m = max(logs_all)
    log_z = m + math.log(sum(math.exp(x - m) for x in logs_all))
    h = -sum(math.exp(x - log_z) * (x - log_z) for x in logs)
    if tail_log is not None:
        h -= others * math.exp(tail_log - log_z) * (tail_log - log_z)
    return h


class SGLangEngine:
    """One model served by an SGLang worker process (see the module docstring)."""

    backend = "sglang"
    exact_entropy = False  # estimated from the top-k logprobs (entropy_estimate)

    def __init__(self, worker: Worker, tokenizer: Any, *, vocab_size: int, kv_shape: tuple[int, int, int, int],
                 eos_ids: set[int], device: str) -> None:
        self.worker, self.tokenizer = worker, tokenizer
        self.vocab_size, self._kv_shape, self.eos_ids, self.device = vocab_size, kv_shape, eos_ids, device
        self.clock = NULL_CLOCK
        self.label = ""
        self.waiting: deque[ProposeRequest] = deque()
        self.running: list[_Running] = []
        self._rows: dict[str, tuple[_Running, _Row]] = {}
        self._scores: dict[str, Any] = {}
        self._pieces: dict[int, str] = {}
        self._used: dict[str, int] = {}  # rid -> tokens kvflow kept, of candidates it stopped
        self.forwards = 0  # step() calls that received tokens (SGLang batches on its own)
        self.rows_decoded = 0  # candidate rows that received tokens in them
        self.counters = {"prompt_tokens": 0, "cached_tokens": 0, "requests": 0, "tokens_used": 0,
                         "tokens_after_stop": 0, "aborted": 0, "ingest_requests": 0, "adopted": 0,
                         "adopted_by_ingest": 0}
        # evicted states: snapshots live in the scheduler until a later request drops them
        self._ended: dict[str, tuple[dict, int]] = {}  # evicted candidate rid -> (finish, tokens made)
        self._drop_on_end: dict[str, str] = {}  # candidate rid -> its snapshot, dropped once it ended
        self._drops: list[str] = []  # snapshots to drop with the next request
        self._owned: set[str] = set()  # snapshots that exist or will
        self._ingests: dict[str, Any] = {}  # ingest request rid -> its end message (None: waiting)
        self._specs: dict[int, dict] = {}
        self._evicted_rids: set[str] = set()  # evicted candidates whose end has not arrived
        self.dump_dir: Optional[str] = None  # set: the scheduler saves every snapshot there (`<snap>.pt`)

    def reset(self) -> None:
        for r in self.running:
            for row in r.rows:
                if row.finish is None:
                    self.worker.send("abort", row.rid)
        self.waiting.clear()
        self.running.clear()
        self._rows.clear()
        self._used.clear()
        self._drops.extend(self._owned)
        self._owned.clear()
        self._drop_on_end.clear()

    # ------------------------------------------------------------------ text and shapes

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def kv_shape(self) -> tuple[int, int, int, int]:
        return self._kv_shape

    def piece(self, token: int) -> str:
        p = self._pieces.get(token)
        if p is None:
            p = self._pieces[token] = self.tokenizer.decode([token])
        return p

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
                out.append(SGLangState(ids))
                continue
            if getattr(r.evictor.params, "quantize", None):
                raise EngineError("backend 'sglang' does not store quantized KV (evictor `quantize`); "
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
                out.append(SGLangState(r.state.ids + list(r.proposal.candidates[r.own_index].token_ids)))
            else:
                out.append(SGLangState(r.state.ids + self.encode(r.text)))
        self._catch_up([s for s in out if isinstance(s, EvictedState)])
        return out

    def release(self, states: Sequence, proposals: Sequence[Proposal] = ()) -> None:
        # a full-context state is a token list (SGLang's radix cache evicts prefixes on its
        # own); an evicted one is a snapshot in the scheduler, dropped with the next request
        for s in states:
            if isinstance(s, EvictedState) and s.snap:
                self._drop(s.snap)
        for p in proposals:
            for row in p.handle or ():
                self._discard(row)

    # ------------------------------------------------------------------ evicted states

    def _sync_evicted(self, r: SyncRequest) -> EvictedState:
        """Adopt a candidate's snapshot where it holds exactly the candidate's tokens (the
        engine ended it where kvflow did); otherwise, and for another proposer's text,
        ingest the tokens into the state's snapshot (`_catch_up`)."""
        state, rows = r.state, (r.proposal.handle if r.proposal else None) or []
        if r.own_index is None:
            for row in rows:
                self._discard(row)
            return EvictedState(state.ids + self.encode(r.text), state.snap, state.cached, state.resident,
                                state.evictor, state.rng_key, state.n_protected)
        cand, own = r.proposal.candidates[r.own_index], rows[r.own_index]
        for row in rows:
            if row is not own:
                self._discard(row)
        ids = state.ids + list(cand.token_ids)
        rng_key = row_seed(state.rng_key, r.own_index)  # the candidate's, as on hf
        finish, made = self._wait_end(own.rid)
        if finish.get("type") != "abort" and made == len(cand.token_ids):
            self.counters["adopted"] += 1
            if state.snap:
                self._drop(state.snap)
            return EvictedState(ids, own.snap, len(ids) - 1, _resident_after(state.resident, len(cand.token_ids),
                                                                              state.evictor),
                                state.evictor, rng_key, state.n_protected)
        self.counters["adopted_by_ingest"] += 1  # stopped by kvflow (a pruner): its snapshot has more
        return EvictedState(ids, state.snap, state.cached, state.resident, state.evictor, rng_key, state.n_protected)

    def _catch_up(self, states: Sequence[EvictedState]) -> None:
        """Cache every state's tokens but the pending one, in requests from each state's
        snapshot that never take a row past `budget + buffer` (a compaction in between, as on
        `hf`); each state's requests run one after another, states side by side."""
        while True:
            todo = [s for s in states if s.cached < len(s.ids) - 1]
            if not todo:
                return
            sent = {}
            for s in todo:
                room = s.evictor.trigger - s.resident
                chunk = s.ids[s.cached : min(len(s.ids) - 1, s.cached + room)]
                rid = self.worker.new_rid("i")
                spec = self._spec(s, rng_key=s.rng_key, save_as="s-" + rid)
                params = {"max_new_tokens": 0, "custom_params": {"kvflow_evict": spec}}
                self._ingests[rid] = None
                self.worker.send("generate", rid, s.ids[s.cached - s.resident : s.cached] + chunk, params, 0)
                self.counters["ingest_requests"] += 1
                sent[rid] = (s, len(chunk))
            self._wait(lambda: all(self._ingests[rid] is not None for rid in sent), "ingesting a step")
            for rid, (s, n) in sent.items():
                msg = self._ingests.pop(rid)
                if msg[0] == "error":
                    raise EngineError(f"{self.worker.where}: SGLang request failed: {msg[2]}")
                self._count_prefix(msg[3])
                if s.snap:
                    self._drop(s.snap)
                s.snap = "s-" + rid
                self._owned.add(s.snap)
                s.resident = _resident_after(s.resident, n, s.evictor)
                s.cached += n

    def _spec(self, s: EvictedState, *, rng_key: int, save_as: str) -> dict:
        """What a request tells kvflow's SGLang plugin (`evict.py`) about its evicted state."""
        ev = self._specs.get(id(s.evictor))
        if ev is None:
            cls = type(s.evictor)
            ev = self._specs[id(s.evictor)] = {"evictor": f"{cls.__module__}:{cls.__qualname__}",
                                               "params": s.evictor.params.model_dump(mode="json")}
        spec = dict(ev, rng_key=rng_key, n_protected=s.n_protected, logical=s.cached, save_as=save_as)
        spec["from"] = s.snap
        if self.dump_dir:
            spec["dump"] = str(self.dump_dir)
        spec["drop"], self._drops = self._drops, []
        return spec

    def _drop(self, snap: str) -> None:
        self._owned.discard(snap)
        self._drops.append(snap)

    def _discard(self, row: _Row) -> None:
        """A candidate's snapshot is not needed: drop it once the engine has ended the
        candidate (a drop that arrived first would leave the snapshot behind)."""
        if row.snap is None:
            return
        if row.rid in self._ended:
            del self._ended[row.rid]
            self._drop(row.snap)
        else:
            self._drop_on_end[row.rid] = row.snap

    def _wait_end(self, rid: str) -> tuple[dict, int]:
        self._wait(lambda: rid in self._ended, "a candidate's end")
        return self._ended.pop(rid)

    def _wait(self, done, what: str) -> None:
        deadline = time.monotonic() + 3600
        while not done():
            if time.monotonic() > deadline:
                raise EngineError(f"{self.worker.where}: SGLang timed out waiting for {what}")
            self._take(self.worker.poll(_POLL_S))  # proposals keep streaming meanwhile

    def kept_kv(self, state: EvictedState):
        """What an evicted state keeps: (keys, values [layers, kv_heads, resident, D],
        compactions), from the snapshot the scheduler saved under `dump_dir` (set it before
        the state is made; inspection and the engine parity tests)."""
        import os

        import torch

        if not self.dump_dir or not state.snap:
            raise EngineError("kept_kv needs `dump_dir` set before the state was made")
        snap = torch.load(os.path.join(self.dump_dir, f"{state.snap}.pt"))
        return snap["keys"], snap["values"], snap["compactions"]

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

    def submit(self, requests: Sequence[ProposeRequest]) -> None:
        self.waiting.extend(requests)

    def busy_rows(self) -> int:
        # every row of a running proposal counts until step() hands the proposal back: rows can
        # end outside step() (scoring polls the same worker), and the scheduler only steps an
        # engine that says it is busy
        return sum(r.spec.n for r in self.waiting) + sum(len(r.rows) for r in self.running)

    def _admit(self, max_rows: Optional[int]) -> None:
        busy = sum(1 for r in self.running for row in r.rows if row.finish is None)
        while self.waiting and (max_rows is None or not self.running or busy + self.waiting[0].spec.n <= max_rows):
            req = self.waiting.popleft()
            spec = req.spec
            cap = min(spec.max_step_tokens, max(1, req.token_room))
            running = _Running(req, [], cap)
            for i in range(spec.n):
                row = _Row(self.worker.new_rid("p"))
                running.rows.append(row)
                self._rows[row.rid] = (running, row)
                params = {"max_new_tokens": cap, "temperature": spec.temperature, "top_p": spec.top_p,
                          "stop": [spec.delimiter] if spec.delimiter else [], "no_stop_trim": True,
                          "skip_special_tokens": False}
                if spec.temperature > 0:
                    params["sampling_seed"] = row_seed(req.seed, i)
                state, ids = req.state, req.state.ids
                if isinstance(state, EvictedState):  # from the state's snapshot: its resident tail + the pending token
                    row.snap = "c-" + row.rid
                    self._owned.add(row.snap)
                    self._evicted_rids.add(row.rid)
                    params["custom_params"] = {"kvflow_evict": self._spec(
                        state, rng_key=row_seed(state.rng_key, i), save_as=row.snap)}
                    ids = ids[state.cached - state.resident :]
                self.worker.send("generate", row.rid, ids, params, TOP_K)
                self.counters["requests"] += 1
            self.running.append(running)
            busy += spec.n

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
        fresh: dict[int, tuple[_Running, list[tuple[_Row, list]]]] = {}
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
            self._evicted_rids.discard(rid)
            self._ended[rid] = (msg[2] or {}, (msg[3] or {}).get("completion_tokens") or 0)
            snap = self._drop_on_end.pop(rid, None)
            if snap is not None:
                del self._ended[rid]
                self._drop(snap)
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

    def _advance(self, running: _Running, arrivals: list) -> None:
        """Apply the newly streamed tokens one position at a time, with the stop rules and the
        pruners after each (as on `hf`), so a candidate ends exactly where `hf` would end it."""
        spec = running.request.spec
        queue: dict[int, tuple[_Row, deque]] = {}
        for row, toks in arrivals:  # a row may have several messages in one poll
            queue.setdefault(id(row), (row, deque()))[1].extend(toks)
        while True:
            live = [(row, q.popleft()) for row, q in queue.values() if q and row.finish is None]
            if not live:
                break
            for row, (tok, lp, top) in live:
                row.tokens.append(tok)
                row.logprobs.append(lp)
                row.entropies.append(entropy_estimate(top, spec.temperature, self.vocab_size))
                piece = self.piece(tok)
                row.text += piece
                if tok in self.eos_ids:
                    row.finish = "eos"
                elif spec.delimiter and _ends_delimiter(row, piece, spec.delimiter):
                    row.finish = "delimiter"
                elif len(row.tokens) >= running.cap:
                    row.finish = "max_step_tokens"
            rows = [row for row, _ in live if row.finish is None]
            if spec.pruners and rows:
                self._prune(spec, rows)
            for row, _ in live:
                if row.finish is not None and row.rid in self._rows:
                    self._stop(row)

    def _prune(self, spec, rows: list[_Row]) -> None:
        import torch

        width = max(len(r.entropies) for r in rows)
        ent = torch.zeros(len(rows), width)
        for i, r in enumerate(rows):
            ent[i, : len(r.entropies)] = torch.tensor(r.entropies)
        trace = StepTrace(ent, torch.tensor([len(r.tokens) for r in rows]), [r.text for r in rows])
        flagged = torch.zeros(len(rows), dtype=torch.bool)
        for name, pruner in spec.pruners:
            if spec.record_signals:
                for r, v in zip(rows, pruner.signal(trace).tolist()):
                    r.signals.setdefault(name, []).append(v)
            hit = pruner.check(trace).cpu() & ~flagged
            for i in hit.nonzero().flatten().tolist():
                rows[i].finish = f"pruned:{name}"
            flagged |= hit

    def _stop(self, row: _Row) -> None:
        """kvflow ended this candidate: stop it in the engine (unless the engine stops it too)."""
        self._rows.pop(row.rid, None)
        self._used[row.rid] = len(row.tokens)
        if row.finish.startswith("pruned:") or row.finish == "delimiter":
            self.worker.send("abort", row.rid)
            self.counters["aborted"] += row.finish.startswith("pruned:")

    def _finish(self, r: _Running) -> Proposal:
        cands = []
        self.counters["tokens_used"] += sum(len(row.tokens) for row in r.rows)
        for i, row in enumerate(r.rows):
            ids = row.tokens
            text_ids = ids[:-1] if row.finish == "eos" else ids
            cands.append(Candidate(problem=0, source=r.request.proposer, index=i, token_ids=list(ids),
                                   text=self.tokenizer.decode(text_ids), logprobs=row.logprobs,
                                   entropies=row.entropies, finish=row.finish, signals=row.signals))
        return Proposal(r.request, cands, handle=r.rows if isinstance(r.request.state, EvictedState) else None)

    # ------------------------------------------------------------------ scoring

    def scoring_session(self):
        return SGLangScoringSession(self)

    def score_ids(self, sequences: Sequence[tuple[list[int], int]]) -> list[list[float]]:
        """log p of ids[start:] given what precedes, for each (ids, start): prompt logprobs."""
        rids = []
        for ids, start in sequences:
            rid = self.worker.new_rid("s")
            self._scores[rid] = None
            self.worker.send("score", rid, ids, start)
            rids.append(rid)
        deadline = time.monotonic() + 3600
        while any(self._scores[r] is None for r in rids):
            if time.monotonic() > deadline:
                raise EngineError(f"{self.worker.where}: SGLang scoring timed out")
            self._take(self.worker.poll(_POLL_S))  # proposals keep streaming meanwhile
        out = []
        for rid in rids:
            msg = self._scores.pop(rid)
            if msg[0] == "error":
                raise EngineError(f"{self.worker.where}: SGLang scoring failed: {msg[2]}")
            self._count_prefix(msg[3])
            out.append([float(x) for x in msg[2]])
        return out


def _resident_after(resident: int, n: int, evictor) -> int:
    """Tokens per (layer, head) after appending n to `resident`, compacting to `budget`
    whenever `budget + buffer` is reached (what the scheduler-side cache does)."""
    for _ in range(n):
        resident += 1
        if resident >= evictor.trigger:
            resident = evictor.params.budget
    return resident


def _ends_delimiter(row: _Row, piece: str, delimiter: str) -> bool:
    """Does this token's text complete the delimiter? (the row keeps its matcher state)"""
    row.match, hit = delimiter_scan(delimiter, row.match, piece)
    return hit


def _engine_finish(reason: dict) -> str:
    matched = reason.get("matched")
    if isinstance(matched, int):
        return "eos"
    return "delimiter" if matched is not None else "max_step_tokens"


class SGLangScoringSession:
    """Full-context token log-probabilities of candidate steps, from SGLang's prompt logprobs
    (the trajectory prefix is served from the radix cache). Same contract as `hf`'s session."""

    def __init__(self, engine: SGLangEngine) -> None:
        self.engine = engine
        self._context: dict[str, tuple[list[int], int]] = {}  # problem -> (ids, steps included)

    def _ids(self, t) -> list[int]:
        ids, n = self._context.get(t.problem_id) or (self.engine.encode(t.prompt), 0)
        if n < len(t.steps):
            ids = ids + [i for s in t.steps[n:] for i in self.engine.encode(s.text)]
        self._context[t.problem_id] = (ids, len(t.steps))
        return ids

    def token_logprobs(self, trajectories, texts) -> list[list[float]]:
        seqs = []
        for t, text in zip(trajectories, texts):
            ctx = self._ids(t)
            seqs.append((ctx + self.engine.encode(text), len(ctx)))
        return self.engine.score_ids(seqs)

    def release(self, problem_ids) -> None:
        for pid in problem_ids:
            self._context.pop(pid, None)
