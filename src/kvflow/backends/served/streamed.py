"""Candidates streamed from an engine in another process (SGLang's, vLLM's): kvflow's stop rules
and pruners applied to every token as it arrives, exactly as on `hf`.

An engine that streams sends one request per candidate and gets its tokens back with their
temperature-1 log-probability and top-k log-probabilities. `StreamedRows` (a mixin) turns those
arrivals into candidates: after every token the stop rules (EOS, then the delimiter matched
across token boundaries, then the step's cap), then the pruners on every row still live; a row
ended by kvflow is handed to the engine's `_stop(row)`, which aborts it in the engine. Entropies
are estimated and token confidences computed from the top-k (`kvflow.backends.served.signals`).

The mixin also queues proposals (`submit`, `busy_rows`, `_admit`: whole proposals, oldest first,
within `max_rows`). The engine provides `tokenizer`, `vocab_size`, `eos_ids`, `worker` (with
`new_rid`), `counters`, `waiting` (a deque), `running` (a list), `_rows` (rid -> (running, row)
of the rows the engine has not ended), `_send_row(request, index, row, cap)` (start one
candidate in the engine) and `_stop(row)`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from kvflow.backends.served.signals import entropy_estimate, token_confidence
from kvflow.components.base import Candidate, StepTrace
from kvflow.components.engine import ProposeRequest, delimiter_scan

#: top log-probabilities asked per token, for the entropy estimate and the confidence
TOP_K = 20


@dataclass
class Row:
    rid: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    text: str = ""  # the token pieces so far (what pruners and the delimiter see)
    finish: Optional[str] = None
    signals: dict = field(default_factory=dict)
    match: int = 0  # leading characters of the delimiter the text ends with
    snap: Optional[str] = None  # SGLang's evicted proposals: the snapshot the candidate leaves at its end


class Running:
    """A proposal whose rows are decoding; `cap` is its step's token cap."""

    def __init__(self, request: ProposeRequest, rows: list[Row], cap: int) -> None:
        self.request, self.rows, self.cap = request, rows, cap


class StreamedRows:
    """Stop rules, pruners and candidates for rows streamed from another process (see the module docstring)."""

    _pieces: dict

    # ------------------------------------------------------------------ the queue of proposals

    def submit(self, requests) -> None:
        self.waiting.extend(requests)

    def busy_rows(self) -> int:
        # every row of a running proposal counts until step() hands the proposal back: rows can
        # end outside step() (scoring polls the same worker), and the scheduler only steps an
        # engine that says it is busy
        return sum(r.spec.n for r in self.waiting) + sum(len(r.rows) for r in self.running)

    def _admit(self, max_rows: Optional[int]) -> None:
        """Start queued proposals, oldest first and whole, while the rows decoding stay within
        `max_rows` (the oldest starts alone when nothing runs): one engine request per candidate,
        sent by the engine's `_send_row(request, index, row, cap)`."""
        busy = sum(1 for r in self.running for row in r.rows if row.finish is None)
        while self.waiting and (max_rows is None or not self.running or busy + self.waiting[0].spec.n <= max_rows):
            req = self.waiting.popleft()
            cap = min(req.spec.max_step_tokens, max(1, req.token_room))
            running = Running(req, [], cap)
            for i in range(req.spec.n):
                row = Row(self.worker.new_rid("p"))
                running.rows.append(row)
                self._rows[row.rid] = (running, row)
                self._send_row(req, i, row, cap)
                self.counters["requests"] += 1
            self.running.append(running)
            busy += req.spec.n

    # ------------------------------------------------------------------ tokens as they arrive

    def piece(self, token: int) -> str:
        p = self._pieces.get(token)
        if p is None:
            p = self._pieces[token] = self.tokenizer.decode([token])
        return p

    def _advance(self, running: Running, arrivals: list) -> None:
        """Apply the newly streamed tokens (row, [(token, logprob, top)]) one position at a time,
        with the stop rules and the pruners after each (as on `hf`), so a candidate ends exactly
        where `hf` would end it."""
        spec = running.request.spec
        queue: dict[int, tuple[Row, deque]] = {}
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
                row.confidences.append(token_confidence(top, self.vocab_size))
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

    def _prune(self, spec, rows: list[Row]) -> None:
        import torch

        width = max(len(r.entropies) for r in rows)
        ent, lps, conf = (torch.zeros(len(rows), width) for _ in range(3))  # [rows, width] each
        for i, r in enumerate(rows):
            n = len(r.entropies)
            ent[i, :n], lps[i, :n], conf[i, :n] = (torch.tensor(x) for x in (r.entropies, r.logprobs, r.confidences))
        trace = StepTrace(ent, torch.tensor([len(r.tokens) for r in rows]), [r.text for r in rows],
                          logprobs=lps, confidences=conf)
        flagged = torch.zeros(len(rows), dtype=torch.bool)
        recorded = {id(p) for _, p in spec.recorded()}
        for name, pruner in spec.pruners:
            if id(pruner) in recorded:
                for r, v in zip(rows, pruner.signal(trace).tolist()):
                    r.signals.setdefault(name, []).append(v)
            hit = pruner.check(trace).cpu() & ~flagged
            for i in hit.nonzero().flatten().tolist():
                rows[i].finish = f"pruned:{name}"
            flagged |= hit

    def _candidates(self, running: Running) -> list[Candidate]:
        """The proposal's candidates, every row ended: `text` is the tokens decoded, without a final EOS."""
        out = []
        for i, row in enumerate(running.rows):
            ids = row.tokens
            text_ids = ids[:-1] if row.finish == "eos" else ids
            out.append(Candidate(problem=0, source=running.request.proposer, index=i, token_ids=list(ids),
                                 text=self.tokenizer.decode(text_ids), logprobs=row.logprobs,
                                 entropies=row.entropies, finish=row.finish, signals=row.signals,
                                 confidences=row.confidences))
        return out


def _ends_delimiter(row: Row, piece: str, delimiter: str) -> bool:
    """Does this token's text complete the delimiter? (the row keeps its matcher state)"""
    row.match, hit = delimiter_scan(delimiter, row.match, piece)
    return hit
