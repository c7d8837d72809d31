"""Evicted problem states of `VLLMEngine`, on kvflow's side (the worker's side: `evict.py`).

An evicted state is a snapshot in the vLLM worker: a one-row `BudgetedCache` holding the
state's first `cached` tokens, evicted as `hf` evicts them. A candidate is a vLLM request whose
input is the whole logical sequence (prompt + committed tokens, the pending token last) and
whose evicted part starts at `cached` (the tokens before it are stand-ins whose outputs are not
used: `evict.py`); it leaves a snapshot of its own at its end, which adoption takes when vLLM
ended the candidate exactly where kvflow did (else its tokens are ingested into the pre-step
snapshot). Ingesting text is a chain of requests from the snapshot (`max_tokens = 1`, the
sampled token unused), each at most `budget + buffer - resident` evicted tokens long, so the
worker compacts at `hf`'s points. Snapshots kvflow no longer needs are dropped with the next
request it sends (a candidate's only once its end has arrived).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from kvflow.backends.vllm.client import EngineError
from kvflow.components.engine import SyncRequest, row_seed

_POLL_S = 0.02


@dataclass
class EvictedState:
    """An evicted problem state: snapshot `snap` in the worker holds the first `cached` tokens
    of `ids` evicted down to `resident` per (layer, KV head); the rest of `ids` (at least the
    pending token) is not cached yet."""

    ids: list[int]  # the logical sequence: prompt + committed tokens, the pending token last
    snap: Optional[str]  # snapshot id (None: nothing cached yet)
    cached: int  # leading tokens of `ids` the snapshot has seen
    resident: int  # tokens it holds per (layer, KV head) (varying allocations: the nominal length)
    evictor: Any
    rng_key: int
    n_protected: int


class EvictedStates:
    """The evicted-state half of `VLLMEngine` (a mixin: it uses the engine's worker, counters
    and reply handling)."""

    def _init_evicted(self) -> None:
        self._ended: dict[str, tuple[str, int]] = {}  # evicted candidate rid -> (finish, tokens made)
        self._drop_on_end: dict[str, str] = {}  # candidate rid -> its snapshot, dropped once it ended
        self._drops: list[str] = []  # snapshots to drop with the next evicted request
        self._owned: set[str] = set()  # snapshots that exist or will
        self._ingests: dict[str, Any] = {}  # ingest request rid -> its end message (None: waiting)
        self._evicted_rids: set[str] = set()  # evicted candidates whose end has not arrived
        self._specs: dict[int, dict] = {}  # id(evictor) -> its part of a spec
        self._kept: dict[str, Any] = {}  # "kept" query rid -> its reply (None: waiting)

    def _reset_evicted(self) -> None:
        self._drops.extend(self._owned)
        self._owned.clear()
        self._drop_on_end.clear()

    def _sync_evicted(self, r: SyncRequest) -> EvictedState:
        """Adopt a candidate's snapshot where it holds exactly the candidate's tokens (vLLM
        ended it where kvflow did); otherwise, and for another proposer's text, ingest the
        tokens into the state's snapshot (`_catch_up`)."""
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
        finish, made = self._wait_end(own.rid)
        if finish != "abort" and made == len(cand.token_ids):
            self.counters["adopted"] += 1
            if state.snap:
                self._drop(state.snap)
            return replace(state, ids=ids, snap=own.snap, cached=len(ids) - 1, rng_key=rng_key,
                           resident=_resident_after(state.resident, len(cand.token_ids), state.evictor))
        self.counters["adopted_by_ingest"] += 1  # stopped by kvflow (a pruner, the delimiter): its snapshot has more
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
                room = s.evictor.trigger - s.resident
                end = min(len(s.ids) - 1, s.cached + room)
                rid = self.worker.new_rid("i")
                self._ingests[rid] = None
                self.worker.send("generate", rid, s.ids[:end], {"max_tokens": 1, "temperature": 0.0},
                                 self._spec(s, rng_key=s.rng_key, save_as="s-" + rid))
                self._owned.add("s-" + rid)
                self.counters["ingest_requests"] += 1
                sent[rid] = (s, end - s.cached)
            self._wait(lambda: all(self._ingests[rid] is not None for rid in sent), "ingesting a step")
            for rid, (s, n) in sent.items():
                msg = self._ingests.pop(rid)
                if msg[0] == "error":
                    raise EngineError(f"{self.worker.where}: vLLM request failed: {msg[2]}")
                self._count_prefix(msg[3])
                if s.snap:
                    self._drop(s.snap)
                s.snap = "s-" + rid
                s.resident = _resident_after(s.resident, n, s.evictor)
                s.cached += n

    def _spec(self, s: EvictedState, *, rng_key: int, save_as: str) -> dict:
        """What a request tells the worker (`evict.py`) about its evicted state."""
        ev = self._specs.get(id(s.evictor))
        if ev is None:
            cls = type(s.evictor)
            ev = self._specs[id(s.evictor)] = {
                "evictor": f"{cls.__module__}:{cls.__qualname__}",
                "params": s.evictor.params.model_dump(mode="json"), "_evictor": s.evictor}
        spec = {k: v for k, v in ev.items() if k != "_evictor"}
        spec.update(rng_key=rng_key, n_protected=s.n_protected, first=s.cached, save_as=save_as, drop=self._drops)
        spec["from"] = s.snap
        self._drops = []
        return spec

    def _drop(self, snap: Optional[str]) -> None:
        if snap and snap in self._owned:
            self._owned.discard(snap)
            self._drops.append(snap)

    def _discard(self, row) -> None:
        """A candidate's snapshot is not needed: drop it once vLLM has ended the candidate."""
        if row.snap is None:
            return
        if row.rid in self._ended:
            del self._ended[row.rid]
            self._drop(row.snap)
        else:
            self._drop_on_end[row.rid] = row.snap

    def _evicted_end(self, rid: str, msg) -> None:
        """The end (or error) of an evicted candidate arrived."""
        self._evicted_rids.discard(rid)
        finish = msg[2] if msg[0] == "end" else "abort"
        made = (msg[3] or {}).get("completion_tokens") or 0 if msg[0] == "end" else 0
        self._ended[rid] = (finish, made)
        snap = self._drop_on_end.pop(rid, None)
        if snap is not None:
            del self._ended[rid]
            self._drop(snap)

    def _wait_end(self, rid: str) -> tuple[str, int]:
        self._wait(lambda: rid in self._ended, "a candidate's end")
        return self._ended.pop(rid)

    def _wait(self, done, what: str) -> None:
        deadline = time.monotonic() + 3600
        while not done():
            if time.monotonic() > deadline:
                raise EngineError(f"{self.worker.where}: vLLM timed out waiting for {what}")
            self._take(self.worker.poll(_POLL_S))  # proposals keep streaming meanwhile

    def kept_kv(self, state: EvictedState):
        """What an evicted state keeps: (keys, values, compactions) with keys[layer][head] the
        head's resident keys in time order, [n, D] (as `HFEngine.kept_kv`; inspection and the
        engine parity tests)."""
        import torch

        if not state.snap:
            raise EngineError("kept_kv: the state holds nothing yet")
        rid = self.worker.new_rid("k")
        self._kept[rid] = None
        self.worker.send("kept", rid, state.snap)
        self._wait(lambda: self._kept[rid] is not None, "a snapshot's keys")
        msg = self._kept.pop(rid)
        if msg[0] == "error":
            raise EngineError(f"{self.worker.where}: vLLM worker could not read snapshot {state.snap}: {msg[2]}")
        data = msg[2]

        def tensors(x):
            return [[torch.tensor(h, dtype=torch.float32).reshape(len(h), -1) for h in layer] for layer in x]

        return tensors(data["keys"]), tensors(data["values"]), data["compactions"]


def _resident_after(resident: int, n: int, evictor) -> int:
    """Tokens per (layer, head) after appending n to `resident`, compacting to `budget`
    whenever `budget + buffer` is reached (what the worker's cache does)."""
    for _ in range(n):
        resident += 1
        if resident >= evictor.trigger:
            resident = evictor.params.budget
    return resident
