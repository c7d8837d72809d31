"""Evicted problem states held as snapshots inside another process's engine (SGLang's scheduler,
vLLM's worker), on kvflow's side: one bookkeeping for both engines.

An evicted state is a snapshot in the engine holding the state's first `cached` tokens, evicted
as `hf` evicts them. A candidate is a request from the snapshot that leaves a snapshot of its
own at its end (`c-<rid>`); adoption takes it when the engine ended the candidate exactly where
kvflow did, else the candidate's tokens are ingested into the pre-step snapshot (kvflow stopped
it: a pruner, the delimiter; an aborted request may have saved more). Ingesting text is a
chain of requests from the snapshot (`s-<rid>`), each at most `budget + buffer - resident`
tokens long, so the engine compacts at `hf`'s points. Snapshots kvflow no longer needs are
dropped with the next request it sends to the replica that holds them (a candidate's only
once its end has arrived: a drop that reached the engine first would leave it behind). An
engine whose scheduler cuts a request at the compaction points itself (`_chunks_ingest`:
vLLM, for evictors in its blocks) takes a state's tokens in one request instead of a chain.

`SnapshotStates` is the evicted-state half of `ServedEngine` (`engine.py`), which gives it
`worker`, `engine_name`, `counters`, `encode`, `_take(replies)` and `_count_meta(meta)`; a backend
gives `_send_ingest(state, rid, end, spec)` (one request that makes snapshot `s-<rid>` of the
state's tokens up to `end`: SGLang sends its resident tail and the chunk with `max_new_tokens` 0,
vLLM the whole prefix with `max_tokens` 1, the sampled token unused) and `_spec(state, rng_key=,
save_as=)` (what its in-worker code needs beyond `_common_spec`).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from kvflow.components.engine import SyncRequest, row_seed
from kvflow.errors import EngineError

POLL_S = 0.02  # how long one wait on the worker's replies blocks


@dataclass
class EvictedState:
    """An evicted problem state: snapshot `snap` in the engine holds the first `cached` tokens
    of `ids` evicted down to `resident` per (layer, KV head); the rest of `ids` (at least the
    pending token) is not cached yet."""

    ids: list[int]  # the logical sequence: prompt + committed tokens, the pending token last
    snap: Optional[str]  # snapshot id (None: nothing cached yet)
    cached: int  # leading tokens of `ids` the snapshot has seen
    resident: int  # tokens it holds per (layer, KV head); varying allocations: the nominal length (budget + since the last compaction)
    evictor: Any
    rng_key: int
    n_protected: int
    dp_rank: Optional[int] = None  # the data-parallel replica holding its snapshots (None: one replica)


class SnapshotStates:
    """The evicted-state half of a streamed engine (see the module docstring)."""

    def _init_snapshots(self) -> None:
        self._ended: dict[str, tuple[bool, int]] = {}  # evicted candidate rid -> (aborted, tokens made)
        self._drop_on_end: dict[str, str] = {}  # candidate rid -> its snapshot, dropped once it ended
        self._drops: dict[Optional[int], list[str]] = {}  # replica -> snapshots to drop with its next request
        self._owned: dict[str, Optional[int]] = {}  # snapshots that exist or will -> their replica
        self._ingests: dict[str, Any] = {}  # ingest request rid -> its end message (None: waiting)
        self._evicted_rids: set[str] = set()  # evicted candidates whose end has not arrived
        self._specs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # evictor -> its part of a spec

    def _reset_snapshots(self) -> None:
        """Drop every snapshot (with the next requests) and forget pending ends."""
        for snap, rank in self._owned.items():
            self._drops.setdefault(rank, []).append(snap)
        self._owned.clear()
        self._drop_on_end.clear()

    # ------------------------------------------------------------------ steps

    def _sync_evicted(self, r: SyncRequest) -> EvictedState:
        """Adopt a candidate's snapshot where it holds exactly the candidate's tokens (the
        engine ended it where kvflow did); otherwise, and for another proposer's text, ingest
        the tokens into the state's snapshot (`_catch_up`)."""
        state, rows = r.state, (r.proposal.handle if r.proposal else None) or []
        if r.own_index is None:
            for row in rows:
                self._discard(row)
            return replace(state, ids=state.ids + self.encode(r.text))
        cand, own = r.proposal.candidates[r.own_index], rows[r.own_index]
        for row in rows:
            if row is not own:
                self._discard(row)
        ids = state.ids + list(cand.token_ids)
        rng_key = row_seed(state.rng_key, r.own_index)  # the candidate's, as on hf
        aborted, made = self._wait_end(own.rid)
        if not aborted and made == len(cand.token_ids):
            self.counters["adopted"] += 1
            if state.snap:
                self._drop(state.snap)
            return replace(state, ids=ids, snap=own.snap, cached=len(ids) - 1, rng_key=rng_key,
                           resident=resident_after(state.resident, len(cand.token_ids), state.evictor))
        self.counters["adopted_by_ingest"] += 1  # stopped by kvflow: its snapshot (if any) has more
        self._drop(own.snap)
        return replace(state, ids=ids, rng_key=rng_key)

    def _catch_up(self, states: Sequence[EvictedState]) -> None:
        """Cache every state's tokens but the pending one, in requests that never take a
        snapshot past `budget + buffer` (a compaction in between, as on `hf`); each state's
        requests run one after another, states side by side."""
        while True:
            todo = [s for s in states if s.cached < len(s.ids) - 1]
            if not todo:
                return
            sent = {}
            for s in todo:
                whole = self._chunks_ingest(s.evictor)
                end = len(s.ids) - 1 if whole else min(len(s.ids) - 1, s.cached + s.evictor.trigger - s.resident)
                rid = self.worker.new_rid("i")
                self._ingests[rid] = None
                self._send_ingest(s, rid, end, self._spec(s, rng_key=s.rng_key, save_as=self._own("s-" + rid, s)))
                self.counters["ingest_requests"] += 1
                sent[rid] = (s, end - s.cached)
            self._wait(lambda: all(self._ingests[rid] is not None for rid in sent), "ingesting a step")
            for rid, (s, n) in sent.items():
                msg = self._ingests.pop(rid)
                if msg[0] == "error":
                    raise EngineError(f"{self.worker.where}: {self.engine_name} request failed: {msg[2]}")
                self._count_meta(msg[3])
                if s.snap:
                    self._drop(s.snap)
                s.snap = "s-" + rid
                s.resident = resident_after(s.resident, n, s.evictor)
                s.cached += n

    def _chunks_ingest(self, evictor) -> bool:
        """Whether the engine itself cuts one request's tokens at this evictor's compaction
        points (then a state's tokens are ingested in one request); else kvflow sends a chain
        of requests, each ending at one. A backend that can says so."""
        return False

    def _spec(self, s: EvictedState, *, rng_key: int, save_as: str) -> dict:
        return self._common_spec(s, rng_key=rng_key, save_as=save_as)

    def _common_spec(self, s: EvictedState, *, rng_key: int, save_as: str) -> dict:
        """What a request tells the engine's plugin about its evicted state: the evictor (class
        path and parameters), its row's keys, the snapshot it starts from and saves as, and the
        snapshots its replica may drop now."""
        ev = self._specs.get(s.evictor)
        if ev is None:
            cls = type(s.evictor)
            ev = self._specs[s.evictor] = {"evictor": f"{cls.__module__}:{cls.__qualname__}",
                                           "params": s.evictor.params.model_dump(mode="json")}
        spec = dict(ev, rng_key=rng_key, n_protected=s.n_protected, save_as=save_as)
        spec["from"] = s.snap
        spec["drop"] = self._drops.pop(s.dp_rank, [])  # only the replica the request goes to holds them
        return spec

    # ------------------------------------------------------------------ snapshots

    def _own(self, snap: str, state: EvictedState) -> str:
        """Snapshot `snap` will exist in `state`'s replica."""
        self._owned[snap] = state.dp_rank
        return snap

    def _drop(self, snap: Optional[str]) -> None:
        if snap and snap in self._owned:
            self._drops.setdefault(self._owned.pop(snap), []).append(snap)

    def _discard(self, row) -> None:
        """A candidate's snapshot is not needed: drop it once the engine has ended the candidate."""
        if row.snap is None:
            return
        if row.rid in self._ended:
            del self._ended[row.rid]
            self._drop(row.snap)
        else:
            self._drop_on_end[row.rid] = row.snap

    def _evicted_end(self, rid: str, aborted: bool, made: int) -> None:
        """An evicted candidate ended in the engine (finished, or aborted: by kvflow, or failed)."""
        self._evicted_rids.discard(rid)
        self._ended[rid] = (aborted, made)
        snap = self._drop_on_end.pop(rid, None)
        if snap is not None:
            del self._ended[rid]
            self._drop(snap)

    def _wait_end(self, rid: str) -> tuple[bool, int]:
        self._wait(lambda: rid in self._ended, "a candidate's end")
        return self._ended.pop(rid)

    def _wait(self, done, what: str) -> None:
        """Apply the worker's replies until `done()` (proposals keep streaming meanwhile)."""
        deadline = time.monotonic() + 3600
        while not done():
            if time.monotonic() > deadline:
                raise EngineError(f"{self.worker.where}: {self.engine_name} timed out waiting for {what}")
            self._take(self.worker.poll(POLL_S))


def resident_after(resident: int, n: int, evictor) -> int:
    """Tokens per (layer, head) after appending n to `resident`, compacting to `budget`
    whenever `budget + buffer` is reached (what the engine-side cache does)."""
    for _ in range(n):
        resident += 1
        if resident >= evictor.trigger:
            resident = evictor.params.budget
    return resident
