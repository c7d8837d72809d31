"""Evicted problem states of `SGLangEngine`, on kvflow's side (the scheduler's side: `evict.py`).

An evicted state is a snapshot in the SGLang scheduler holding the state's resident tokens per
(layer, KV head). A candidate is a request from the snapshot whose input is the pending token;
it leaves a snapshot of its own at its end, which adoption takes when the engine ended the
candidate exactly where kvflow did (else its tokens are ingested into the pre-step snapshot).
Ingesting text is a chain of requests from the snapshot, `max_new_tokens = 0`, each at most
`budget + buffer - resident` tokens long, so the scheduler compacts at `hf`'s points.
Snapshots kvflow no longer needs are dropped with the next request it sends (a drop that
reached the scheduler before the snapshot was made would leave it behind, so a candidate's is
dropped only once its end has arrived).

Data parallelism (`dp_size > 1`): each replica has its own scheduler, and a snapshot lives in
the one that made it. A state is given a replica when it starts (`dp_rank`: the replica with
the fewest of this engine's live states, lowest first) and every request made from it (its
ingests, its candidates, and the states they leave) names that replica (SGLang's
`routed_dp_rank`, which every load-balance method of its DP controller honours); drops go with
the next request to the replica that holds the snapshot.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from kvflow.backends.sglang.client import EngineError
from kvflow.components.engine import SyncRequest, row_seed


@dataclass
class EvictedState:
    """An evicted problem state: a snapshot in the SGLang scheduler (`evict.py`) holding the
    first `cached` tokens of `ids` evicted down to `resident` per (layer, KV head); the rest
    of `ids` (at least the pending token) is not cached yet."""

    ids: list[int]  # the logical sequence: prompt + committed tokens, the pending token last
    snap: Optional[str]  # snapshot id (None: nothing cached yet)
    cached: int  # leading tokens of `ids` the snapshot has seen
    resident: int  # tokens it holds per (layer, KV head); varying allocations: the nominal length (budget + since the last compaction)
    evictor: Any
    rng_key: int
    n_protected: int
    dp_rank: Optional[int] = None  # the data-parallel replica holding its snapshots (None: dp_size 1)


class EvictedStates:
    """The evicted-state half of `SGLangEngine` (a mixin: it uses the engine's worker,
    counters and polling)."""

    def _sync_evicted(self, r: SyncRequest) -> EvictedState:
        """Adopt a candidate's snapshot where it holds exactly the candidate's tokens (the
        engine ended it where kvflow did); otherwise, and for another proposer's text,
        ingest the tokens into the state's snapshot (`_catch_up`)."""
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
        if finish.get("type") != "abort" and made == len(cand.token_ids):
            self.counters["adopted"] += 1
            if state.snap:
                self._drop(state.snap)
            return replace(state, ids=ids, snap=own.snap, cached=len(ids) - 1, rng_key=rng_key,
                           resident=_resident_after(state.resident, len(cand.token_ids), state.evictor))
        self.counters["adopted_by_ingest"] += 1  # stopped by kvflow (a pruner): its snapshot has more
        return replace(state, ids=ids, rng_key=rng_key)

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
                self.worker.send("generate", rid, s.ids[s.cached - s.resident : s.cached] + chunk, params, 0,
                                 s.dp_rank)
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
                self._owned[s.snap] = s.dp_rank
                s.resident = _resident_after(s.resident, n, s.evictor)
                s.cached += n

    def _spec(self, s: EvictedState, *, rng_key: int, save_as: str) -> dict:
        """What a request tells kvflow's SGLang plugin (`evict.py`) about its evicted state."""
        ev = self._specs.get(s.evictor)
        if ev is None:
            cls = type(s.evictor)
            ev = self._specs[s.evictor] = {"evictor": f"{cls.__module__}:{cls.__qualname__}",
                                           "params": s.evictor.params.model_dump(mode="json")}
        spec = dict(ev, rng_key=rng_key, n_protected=s.n_protected, logical=s.cached, save_as=save_as)
        spec["from"] = s.snap
        if self.dump_dir:
            spec["dump"] = str(self.dump_dir)
        spec["drop"] = self._drops.pop(s.dp_rank, [])  # only the replica the request goes to holds them
        return spec

    def _drop(self, snap: str) -> None:
        rank = self._owned.pop(snap, None)
        self._drops.setdefault(rank, []).append(snap)

    def _discard(self, row) -> None:
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

    def kept_kv(self, state: EvictedState):
        """What an evicted state keeps: (keys, values, compactions) with keys[layer][head] the
        head's resident keys in time order, [n, D] (as `HFEngine.kept_kv`), from the snapshot
        the scheduler saved under `dump_dir` (set it before the state is made; inspection and
        the engine parity tests)."""
        import torch

        if not self.dump_dir or not state.snap:
            raise EngineError("kept_kv needs `dump_dir` set before the state was made")
        snap = torch.load(os.path.join(self.dump_dir, f"{state.snap}.pt"))
        keys, values, holes = snap["keys"], snap["values"], snap.get("holes")
        end = snap.get("base", 0) + state.evictor.params.budget  # where each head's hole ends

        def head(t, layer, h):  # [layers, kv_heads, n, D] -> the head's tokens, hole skipped
            x = t[layer, h]
            return x if holes is None else torch.cat([x[: int(holes[layer, h])], x[end:]])

        return ([[head(keys, l, h) for h in range(keys.shape[1])] for l in range(keys.shape[0])],
                [[head(values, l, h) for h in range(values.shape[1])] for l in range(values.shape[0])],
                snap["compactions"])


def _resident_after(resident: int, n: int, evictor) -> int:
    """Tokens per (layer, head) after appending n to `resident`, compacting to `budget`
    whenever `budget + buffer` is reached (what the scheduler-side cache does)."""
    for _ in range(n):
        resident += 1
        if resident >= evictor.trigger:
            resident = evictor.params.budget
    return resident
