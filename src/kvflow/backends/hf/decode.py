"""The `hf` engine: step-level continuous decoding of candidate steps (DESIGN.md §6-7).

`HFEngine` implements `kvflow.components.engine.Engine` over one `HFRunner`. A problem's
state is a one-row `BudgetedCache` plus its pending token (the newest token, not yet cached).
A submitted proposal waits in a queue until it fits in the decode batch; it then forks its
state `n` ways into free rows of the engine's row pool for that evictor (one copy of the
row's resident slots each: O(budget + buffer) for an evicted state;
`kvflow.backends.hf.decode_batch.RowPool`) and is decoded every step, together with every
other running proposal of any proposer on this model, in one forward over their live rows
(`HFRunner.decode_step`: one attention call per layer and pool, however many proposals). A
row that ends stops being fed and keeps its cache in place for adoption; nothing else moves;
its rows go back to the pool when the proposal is released. Per-token work (sampling, stop rules, bookkeeping) is batched
tensor ops over the engine's row table, with one host sync per step (which rows ended).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvflow.backends.hf import invariant
from kvflow.backends.hf.cache import BudgetedCache
from kvflow.backends.hf.decode_batch import PoolRows, RowPool
from kvflow.backends.hf.engine import HFRunner
from kvflow.backends.hf.sampling import DelimiterTable, sample, uniforms
from kvflow.components.base import Candidate, Evictor, EvictorParams, StepTrace
from kvflow.components.engine import EngineBase, Proposal, ProposeRequest, StartRequest, SyncRequest, row_seed
from kvflow.timing import NULL_CLOCK

# finish codes in the row table; pruner k of a proposal's spec is _PRUNED + k
_LIVE, _EOS, _DELIMITER, _CAP, _PRUNED = 0, 1, 2, 3, 4
_CANCELLED = -1  # stopped by `cancel` (its problem was cancelled mid-step)
_FINISH = {_EOS: "eos", _DELIMITER: "delimiter", _CAP: "max_step_tokens", _CANCELLED: "cancelled"}


@dataclass
class HFState:
    cache: BudgetedCache  # one row
    pending: int  # the newest token, appended by the next forward


class _FullContext(Evictor):
    """The unbounded cache of a scoring session (no eviction; the cache grows)."""

    bounded = False

    @property
    def trigger(self) -> int:
        return 2**62


class _Running:
    """A proposal being decoded: its rows in a row pool and in the engine's row table."""

    def __init__(self, request: ProposeRequest, held: PoolRows, rows: torch.Tensor) -> None:
        self.request, self.held, self.rows = request, held, rows  # rows: [n] int64 row-table ids
        self.live = torch.arange(len(rows))  # local rows still decoding
        self.texts = [""] * len(rows) if _needs_text(request.spec) else None
        self.signals: list[dict[str, list[float]]] = [{} for _ in rows]

    @property
    def cache(self) -> PoolRows:
        """The proposal's rows (inspection: lengths, bytes; see `PoolRows`)."""
        return self.held


def _needs_text(spec) -> bool:
    return any(getattr(p, "needs_text", True) for _, p in spec.pruners)


class _RowTable:
    """Per candidate row, what it has generated so far: [rows, width] token ids, logprobs,
    entropies and confidences, and [rows] counters. Row ids are reused once their proposal has ended."""

    FIELDS = ("tokens", "logprobs", "entropies", "confidences", "count", "cap", "state", "seed", "finish", "pending")
    PER_TOKEN = ("tokens", "logprobs", "entropies", "confidences")

    def __init__(self) -> None:
        self.size, self.width = 0, 0
        self.free: list[int] = []
        self.tokens = torch.zeros(0, 0, dtype=torch.long)
        self.logprobs = torch.zeros(0, 0)
        self.entropies = torch.zeros(0, 0)
        self.confidences = torch.zeros(0, 0)
        for name in ("count", "cap", "state", "seed", "finish", "pending"):
            setattr(self, name, torch.zeros(0, dtype=torch.long))

    def alloc(self, n: int, width: int) -> torch.Tensor:
        if width > self.width or len(self.free) < n:
            self._grow(max(self.size * 2, self.size + n - len(self.free), 16), max(width, self.width))
        ids, self.free = self.free[:n], self.free[n:]
        return torch.as_tensor(ids, dtype=torch.long)

    def release(self, rows: torch.Tensor) -> None:
        self.free.extend(rows.tolist())

    def _grow(self, size: int, width: int) -> None:
        size = max(size, self.size)
        for name in self.PER_TOKEN:
            old = getattr(self, name)
            new = old.new_zeros(size, width)
            new[: old.shape[0], : old.shape[1]] = old
            setattr(self, name, new)
        for name in ("count", "cap", "state", "seed", "finish", "pending"):
            old = getattr(self, name)
            setattr(self, name, torch.cat([old, old.new_zeros(size - old.shape[0])]))
        self.free.extend(range(self.size, size))
        self.size, self.width = size, width


class HFEngine(EngineBase):
    """The `hf` backend's engine over one loaded model (see the module docstring)."""

    backend = "hf"
    protocol = "0.2"  # engine protocol (kvflow.components.engine.PROTOCOL_VERSION): fills confidences
    scores_prompts = True  # prompt_logprobs (kvflow serve's echo + logprobs)

    def __init__(self, runner: HFRunner, clock=NULL_CLOCK) -> None:
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.device = str(runner.device)
        self.clock = clock
        self.label = ""  # proposers on this model, for timing phases (`forward:<label>`); set by the scheduler
        self.table = _RowTable()
        self.waiting: deque[ProposeRequest] = deque()
        self.running: list[_Running] = []
        self.pools: dict[int, tuple[Evictor, RowPool]] = {}  # id(evictor) -> (evictor, its pool)
        self._lay: Optional[_Layout] = None  # the forward's layout while the running rows stay the same
        self._eos = torch.as_tensor(sorted(runner.eos_ids), dtype=torch.long)
        self._delimiters: dict[str, DelimiterTable] = {}
        self.forwards = 0  # decode forwards run
        self.rows_decoded = 0  # live rows summed over those forwards

    def reset(self) -> None:
        """Forget queued and running proposals (a run that was interrupted left them)."""
        self.waiting.clear()
        self.running.clear()
        self.pools = {}
        self._lay = None
        self.table = _RowTable()

    # ------------------------------------------------------------------ text and shapes

    def context_length(self) -> Optional[int]:
        n = getattr(self.runner.model.config, "max_position_embeddings", None)
        return int(n) if n else None

    def settings(self) -> dict:
        """What this engine runs under on this machine (`manifest.json` `engine_settings`)."""
        import transformers

        model = self.runner.model
        return {"backend": self.backend, "device": self.device, "dtype": str(next(model.parameters()).dtype),
                "torch": torch.__version__, "transformers": transformers.__version__,
                "attn_implementation": getattr(model.config, "_attn_implementation", None),
                "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                "batch_invariant": invariant.enabled()}

    def encode(self, text: str) -> list[int]:
        return self.runner.encode(text)

    def kv_shape(self) -> tuple[int, int, int, int]:
        return self.runner.kv_shape()

    # ------------------------------------------------------------------ states

    @torch.inference_mode()
    def start(self, requests: Sequence[StartRequest]) -> list[HFState]:
        out: list[Optional[HFState]] = [None] * len(requests)
        for _, idx in _groups(requests, lambda r: id(r.evictor)):
            cache = self.runner.new_cache(requests[idx[0]].evictor, len(idx), [requests[i].rng_key for i in idx])
            with self.clock.phase(f"forward:{self.label}"):
                pending = self.runner.prefill(cache, [self.runner.encode(requests[i].prompt) for i in idx]).tolist()
            for j, i in enumerate(idx):
                out[i] = HFState(cache.select([j]) if len(idx) > 1 else cache, int(pending[j]))
        return out

    @torch.inference_mode()
    def sync(self, requests: Sequence[SyncRequest]) -> list[HFState]:
        out: list[Optional[HFState]] = [None] * len(requests)
        ingest = []
        for i, req in enumerate(requests):
            if req.own_index is not None:  # adopt: the candidate's row is the new state
                cand = req.proposal.candidates[req.own_index]
                out[i] = HFState(req.proposal.handle.select([req.own_index]), cand.token_ids[-1])
            else:
                ingest.append(i)
        for _, idx in _groups([requests[i] for i in ingest], lambda r: id(r.state.cache.evictor)):
            idx = [ingest[j] for j in idx]
            states = [requests[i].state for i in idx]
            # a state handed to sync is not used again by the caller: one alone is ingested in place
            cache = BudgetedCache.cat([s.cache for s in states]) if len(states) > 1 else states[0].cache
            ids = [self.runner.encode(requests[i].text) for i in idx]
            with self.clock.phase(f"forward:{self.label}"):
                self.runner.ingest(cache, [[s.pending] + x[:-1] if x else [] for s, x in zip(states, ids)])
            for j, (i, s, x) in enumerate(zip(idx, states, ids)):
                out[i] = HFState(cache.select([j]) if len(idx) > 1 else cache, x[-1] if x else s.pending)
        return out

    def kept_kv(self, state: HFState):
        """What an evicted state keeps: (keys, values, compactions) with keys[layer][head] the
        head's resident keys in time order, [n, D] (n may differ by layer and head under a
        varying allocation; inspection and the engine parity tests)."""
        cache = state.cache
        keys, values = [], []
        for i in range(len(cache.layers)):
            k, v, heads = cache.resident(i, torch.tensor([0]))
            keys.append([k[0, h, :n] for h, n in enumerate(heads[0].tolist())])
            values.append([v[0, h, :n] for h, n in enumerate(heads[0].tolist())])
        return keys, values, int(cache.rows.compactions[0])

    def kept_statistic(self, state: HFState) -> list:
        """An observing evictor's statistic (H2O's) of the slots an evicted state keeps, per layer
        [kv_heads, n] float32 in the order of `kept_kv` (uniform budgets; the engine parity tests)."""
        cache = state.cache
        n = int(cache.rows.lengths[0])
        return [layer.stats[0, :, :n].clone() for layer in cache.layers]

    def release(self, states: Sequence[HFState], proposals: Sequence[Proposal] = ()) -> None:
        for p in proposals:  # caches are freed with their last reference
            p.handle = None

    def scoring_session(self):
        from kvflow.backends.hf.scoring import ScoringSession

        return ScoringSession(self.runner, _FullContext(EvictorParams()))

    def prompt_logprobs(self, ids: Sequence[int], top: int):
        """`ids` scored with a full cache: kvflow.backends.hf.scoring.prompt_logprobs (optional
        Engine method; `kvflow serve` answers echo + logprobs completions with it)."""
        from kvflow.backends.hf.scoring import prompt_logprobs

        return prompt_logprobs(self.runner, _FullContext(EvictorParams()), ids, top)

    # ------------------------------------------------------------------ proposals

    def submit(self, requests: Sequence[ProposeRequest]) -> None:
        self.waiting.extend(requests)

    def busy_rows(self) -> int:
        return sum(len(r.live) for r in self.running) + sum(q.spec.n for q in self.waiting)

    @torch.inference_mode()
    def cancel(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        """Stop these proposals now (optional Engine method, kvflow.components.engine): a queued
        one never starts (no candidates), a running one leaves the batch with its candidates'
        tokens so far (finish `cancelled` for the rows still live) and its rows are freed at
        the next step. The proposals are returned, for `release`."""
        ids = {id(r) for r in requests}
        out = [Proposal(q, [], handle=None) for q in self.waiting if id(q) in ids]
        if out:
            self.waiting = deque(q for q in self.waiting if id(q) not in ids)
        for r in [r for r in self.running if id(r.request) in ids]:
            self.table.finish[r.rows[r.live]] = _CANCELLED
            self.running.remove(r)
            out.append(self._finish(r))
            self._lay = None
        return out

    @torch.inference_mode()
    def step(self, max_rows: Optional[int] = None) -> list[Proposal]:
        self._admit(max_rows)
        if not self.running:
            return []
        lay = self._layout()
        parts, rows, bounds = lay.parts, lay.rows, lay.bounds  # rows: [L] row-table ids, forward order
        t = self.table
        running = {r.request.proposer for r in self.running}  # named in pipeline order (the label's)
        names = "+".join([n for n in self.label.split("+") if n in running] or sorted(running))
        with self.clock.phase(f"forward:{names}"):
            logits = self.runner.decode_step(parts, t.pending[rows])  # [L, vocab]
        self.forwards += 1
        self.rows_decoded += len(rows)
        new, logprob, entropy, conf = self._sample(logits, rows)  # [L] each
        pos = t.count[rows]
        t.tokens[rows, pos], t.logprobs[rows, pos], t.entropies[rows, pos] = new, logprob, entropy
        t.confidences[rows, pos] = conf
        t.count[rows] = pos + 1
        t.pending[rows] = new
        # stop rules, batched over every live row: EOS, then the delimiter, then the step cap;
        # then the pruners, over the rows these left live
        hit = torch.zeros_like(new, dtype=torch.bool)
        for delimiter, sel in lay.groups("delimiter", lambda r: r.request.spec.delimiter):
            table = self._delimiter(delimiter)  # sel: positions in the forward of these proposals' rows
            state = t.state[rows[sel]]
            hit[sel] = table.hit[state, new[sel]]
            t.state[rows[sel]] = table.next[state, new[sel]]
        finish = torch.where(torch.isin(new, self._eos), _EOS,
                             torch.where(hit, _DELIMITER, torch.where(pos + 1 >= t.cap[rows], _CAP, _LIVE)))
        if any(r.texts is not None for r in self.running):
            tokens = new.tolist()
            for r, (a, b) in zip(self.running, bounds):
                if r.texts is not None:
                    for j, tok in zip(r.live.tolist(), tokens[a:b]):
                        r.texts[j] += self.runner.piece(tok)
        with self.clock.phase("prune"):  # one trace per proposer: its proposals' rows together
            for (_, idx), (_, sel) in zip(lay.grouped("prune", lambda r: id(r.request.spec)),
                                          lay.groups("prune", lambda r: id(r.request.spec))):
                if self.running[idx[0]].request.spec.pruners:
                    finish[sel] = self._prune([self.running[i] for i in idx], rows[sel], finish[sel])
        t.finish[rows] = finish
        ended = (finish != _LIVE).tolist()  # the step's one host sync
        done: list[Proposal] = []
        if any(ended):
            self._lay = None  # the rows changed: the next step lays them out again
        for r, (a, b) in zip(list(self.running), bounds):
            mine = ended[a:b]
            if any(mine):
                r.live = r.live[~torch.as_tensor(mine)]
                if not len(r.live):
                    self.running.remove(r)
                    done.append(self._finish(r))
        return done

    def _layout(self) -> "_Layout":
        """This step's forward layout, kept while no proposal is admitted and no row ends
        (then a step builds no per-proposal index: its host work does not grow with proposals)."""
        if self._lay is None:
            self._lay = _Layout(self)
        return self._lay

    def _pool(self, evictor: Evictor) -> RowPool:
        entry = self.pools.get(id(evictor))
        if entry is None:  # the evictor is kept with its pool, so its id stays its own
            pool = RowPool(evictor, self.runner.num_layers, self.runner.device, self.runner.kv_shape()[1])
            entry = self.pools[id(evictor)] = (evictor, pool)
        return entry[1]

    def _admit(self, max_rows: Optional[int]) -> None:
        for _, pool in self.pools.values():
            if pool.shrink():  # freed rows leave the attention: the rows in use are renumbered
                self._lay = None
        busy = sum(len(r.live) for r in self.running)
        admitted = []
        while self.waiting and (max_rows is None or not (self.running or admitted)
                                or busy + self.waiting[0].spec.n <= max_rows):
            admitted.append(self.waiting.popleft())
            busy += admitted[-1].spec.n
        if admitted:
            self._lay = None
        room: dict[int, list] = {}  # id(pool) -> [pool, rows, slots]: one growth per pool for the burst
        for req in admitted:
            pool = self._pool(req.state.cache.evictor)
            need = room.setdefault(id(pool), [pool, 0, 0])
            need[1] += req.spec.n
            need[2] = max(need[2], int(req.state.cache.rows.lengths[0]) + _cap(req) + 1)
        for pool, rows, slots in room.values():
            pool.make_room(rows, slots)
        for req in admitted:
            spec, state = req.spec, req.state
            n = spec.n
            cap = _cap(req)
            seed = int(state.cache.rows.rng_keys[0])
            # fork: one copy of the state's row per candidate, into free rows of the pool
            held = self._pool(state.cache.evictor).fork(state.cache, n, [row_seed(seed, i) for i in range(n)], cap)
            rows = self.table.alloc(n, spec.max_step_tokens)
            t = self.table
            t.count[rows] = 0
            t.cap[rows] = cap
            t.state[rows] = 0
            t.seed[rows] = torch.as_tensor([row_seed(req.seed, i) for i in range(n)])
            t.finish[rows] = _LIVE
            t.pending[rows] = state.pending
            self.running.append(_Running(req, held, rows))

    def _sample(self, logits: torch.Tensor, rows: torch.Tensor):
        groups = self._layout().groups("sample", lambda r: (r.request.spec.temperature, r.request.spec.top_p))
        if len(groups) == 1:
            return self._sample_rows(logits, rows, *groups[0][0])
        new = torch.zeros(len(rows), dtype=torch.long)
        logprob, entropy, conf = torch.zeros(len(rows)), torch.zeros(len(rows)), torch.zeros(len(rows))
        for key, sel in groups:
            new[sel], logprob[sel], entropy[sel], conf[sel] = self._sample_rows(logits[sel], rows[sel], *key)
        return new, logprob, entropy, conf

    def _sample_rows(self, logits, rows, temperature: float, top_p: float):
        t = self.table
        u = uniforms(t.seed[rows], t.count[rows]) if temperature > 0 else torch.zeros(len(rows))
        new, logprob, entropy, conf = sample(logits, temperature, top_p, u)
        return new.cpu(), logprob.cpu(), entropy.cpu(), conf.cpu()

    def _prune(self, group: list[_Running], rows: torch.Tensor, finish: torch.Tensor) -> torch.Tensor:
        """Run the pruners of one proposer over the rows of its running proposals that are
        still live after this token's stop rules (a row ending on this token is not shown:
        its stop rule's finish stands; `kvflow.components.base.Pruner`)."""
        t, spec = self.table, group[0].request.spec
        live = (finish == _LIVE).nonzero().flatten()  # positions in `rows` (CPU tensors: no device sync)
        if not len(live):
            return finish
        owners = [(r, j) for r in group for j in r.live.tolist()]  # row i of `rows` -> (proposal, local row)
        owners = [owners[i] for i in live.tolist()]
        rows = rows[live]
        width = int(t.cap[rows].max())
        if all(r.texts is not None for r in group):
            texts = [r.texts[j] for r, j in owners]
        else:
            texts = _LazyTexts(self, rows)
        trace = StepTrace(t.entropies[rows, :width], t.count[rows], texts,
                          logprobs=t.logprobs[rows, :width], confidences=t.confidences[rows, :width])
        verdict = finish[live]
        recorded = {id(p) for _, p in spec.recorded()}
        for k, (name, pruner) in enumerate(spec.pruners):
            if id(pruner) in recorded:
                for (r, j), v in zip(owners, pruner.signal(trace).tolist()):
                    r.signals[j].setdefault(name, []).append(v)
            flagged = pruner.check(trace).to(verdict.device) & (verdict == _LIVE)  # the first pruner to flag names it
            verdict = torch.where(flagged, _PRUNED + k, verdict)
        finish = finish.clone()
        finish[live] = verdict
        return finish

    def _finish(self, r: _Running) -> Proposal:
        t, spec = self.table, r.request.spec
        counts = t.count[r.rows].tolist()
        tokens, logprobs, entropies, confs = (x[r.rows].tolist() for x in (t.tokens, t.logprobs, t.entropies,
                                                                           t.confidences))
        finishes = t.finish[r.rows].tolist()
        cands = []
        for i, (n, code) in enumerate(zip(counts, finishes)):
            ids = tokens[i][:n]
            finish = _FINISH.get(code) or f"pruned:{spec.pruners[code - _PRUNED][0]}"
            cands.append(Candidate(
                problem=0, source=r.request.proposer, index=i, token_ids=ids,
                text=self.runner.decode(ids[:-1] if code == _EOS else ids), logprobs=logprobs[i][:n],
                entropies=entropies[i][:n], finish=finish, signals=r.signals[i], confidences=confs[i][:n]))
        t.release(r.rows)
        return Proposal(r.request, cands, handle=r.held)

    def _delimiter(self, delimiter: str) -> DelimiterTable:
        table = self._delimiters.get(delimiter)
        if table is None:
            table = self._delimiters[delimiter] = DelimiterTable(self.runner.pieces(), delimiter, "cpu")
        return table


class _Layout:
    """Where the running proposals' live rows sit in a decode step's forward: pool by pool
    (one part each), proposals in running order within a pool. Built when the running rows
    change; the per-group positions are built on first use and kept with it."""

    def __init__(self, engine: "HFEngine") -> None:
        running = engine.running
        self.running = running
        by_pool = _groups(running, lambda r: id(r.held.pool))
        order = [i for _, idx in by_pool for i in idx]
        self.bounds: list[tuple[int, int]] = [(0, 0)] * len(running)  # running proposal -> [start, end) in the forward
        start = 0
        for i in order:
            k = len(running[i].live)
            self.bounds[i] = (start, start + k)
            start += k
        self.parts = [(running[idx[0]].held.pool.cache, torch.cat([running[i].held.ids[running[i].live] for i in idx]))
                      for _, idx in by_pool]  # (pool cache, its live rows in forward order)
        self.rows = torch.cat([running[i].rows[running[i].live] for i in order])  # [L] row-table ids
        self._grouped: dict[str, list] = {}
        self._groups: dict[str, list] = {}

    def grouped(self, name: str, key) -> list[tuple[object, list[int]]]:
        """Running proposals grouped by key(proposal): (key, indices into running)."""
        if name not in self._grouped:
            self._grouped[name] = _groups(self.running, key)
        return self._grouped[name]

    def groups(self, name: str, key) -> list[tuple[object, torch.Tensor]]:
        """(key, positions in the forward of the group's live rows [k] int64), per group."""
        if name not in self._groups:
            self._groups[name] = [(k, torch.cat([torch.arange(*self.bounds[i]) for i in idx]))
                                  for k, idx in self.grouped(name, key)]
        return self._groups[name]


class _LazyTexts(Sequence):
    """Candidate texts decoded on access, for pruners that did not declare `needs_text = False`
    but are given no incremental texts (never the case for built-ins)."""

    def __init__(self, engine: HFEngine, rows: torch.Tensor) -> None:
        self.engine, self.rows = engine, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        t = self.engine.table
        r = int(self.rows[i])
        return "".join(self.engine.runner.piece(x) for x in t.tokens[r, : int(t.count[r])].tolist())


def _cap(req: ProposeRequest) -> int:
    """The most tokens a candidate of the request may generate."""
    return min(req.spec.max_step_tokens, max(1, req.token_room))


def _groups(items: Sequence, key) -> list[tuple[object, list[int]]]:
    groups: dict[object, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    return list(groups.items())
