"""Step-level decoding on the `hf` backend: sampling, proposing candidate steps, and keeping
a proposer's per-problem state in sync with the committed trajectory (DESIGN.md §6).

A proposer's state for a batch of problems is one `BudgetedCache` with a row per problem
plus each row's pending token (the newest token, not yet in the cache). `propose()` forks
every row `n` ways and decodes all candidate rows together; a row leaves the batch the
moment it ends (delimiter, EOS, step cap) or a pruner stops it, and its state is kept aside
so that `sync()` can adopt it if it is committed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from kvflow.backends.hf.cache import BudgetedCache
from kvflow.backends.hf.engine import HFRunner
from kvflow.components.base import Candidate, Evictor, Pruner, StepTrace
from kvflow.timing import NULL_CLOCK


def row_seed(*parts: object) -> int:
    """A stable 63-bit seed from any tuple of values (run seed, problem id, proposer, ...)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# --------------------------------------------------------------------------- sampling


def sample(logits: torch.Tensor, temperature: float, top_p: float, uniforms: torch.Tensor):
    """Draw one token per row by inverse CDF with the given uniforms.

    logits: [rows, vocab] float32; uniforms: [rows] in [0, 1)
    returns tokens [rows] int64, logprobs [rows] (model's own, temperature 1), and
    entropies [rows] of the sampling distribution (after temperature, before top-p), in nats.

    The inverse CDF runs over the tokens in descending probability, ties in token-id order
    (a stable sort), restricted to the nucleus when top_p < 1. The nucleus is found among the
    `_NUCLEUS_K` most probable tokens (ties at the boundary included) without sorting the
    whole vocabulary, which is what made sampling cost ~10% of a CPU decode step; a row whose
    nucleus does not close among them is sorted in full. Either way the result is the same.
    """
    logp = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
    if temperature <= 0:
        tokens = logits.argmax(-1)
        entropy = -(logp.exp() * logp).nan_to_num().sum(-1)
    else:
        slogp = torch.log_softmax(logits / temperature, dim=-1)
        probs = slogp.exp()
        entropy = -(probs * slogp).nan_to_num().sum(-1)
        tokens = _nucleus_sample(probs, top_p, uniforms.to(probs.device))
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen, entropy


_NUCLEUS_K = 1024  # most probable tokens searched for the nucleus before a full sort


def _nucleus_sample(probs: torch.Tensor, top_p: float, uniforms: torch.Tensor) -> torch.Tensor:
    rows, vocab = probs.shape
    if top_p >= 1.0 or vocab <= _NUCLEUS_K:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        return _inverse_cdf(sorted_p, order, top_p, uniforms)
    # every token at least as probable as the K-th, in token-id order, then stably sorted: the
    # head of the full stable sort (tokens below the K-th come after all of them)
    kth = probs.topk(_NUCLEUS_K, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # [rows, 1]
    head = probs >= kth
    r, c = head.nonzero(as_tuple=True)  # row-major: token ids ascending within a row
    counts = head.sum(-1)
    slot = torch.arange(len(r), device=probs.device) - (counts.cumsum(0) - counts)[r]
    width = int(counts.max())
    order = torch.zeros(rows, width, dtype=torch.long, device=probs.device)
    values = torch.full((rows, width), -1.0, dtype=probs.dtype, device=probs.device)  # padding sorts last
    order[r, slot] = c
    values[r, slot] = probs[r, c]
    values, perm = values.sort(dim=-1, descending=True, stable=True)
    order = order.gather(-1, perm)
    values = values.clamp(min=0.0)
    tokens = _inverse_cdf(values, order, top_p, uniforms)
    # exact when the head's mass reaches top_p: every later token then lies outside the nucleus
    # (the same prefix sums as a full sort; cumsum runs in order)
    open_rows = (values.cumsum(-1)[:, -1] < top_p).nonzero().flatten()
    if len(open_rows):
        sorted_p, full = probs[open_rows].sort(dim=-1, descending=True, stable=True)
        tokens[open_rows] = _inverse_cdf(sorted_p, full, top_p, uniforms[open_rows])
    return tokens


def _inverse_cdf(sorted_p: torch.Tensor, order: torch.Tensor, top_p: float, uniforms: torch.Tensor) -> torch.Tensor:
    cum = sorted_p.cumsum(-1)
    if top_p < 1.0:
        sorted_p = sorted_p.masked_fill(cum - sorted_p >= top_p, 0.0)  # keep the smallest nucleus
        cum = sorted_p.cumsum(-1)
    target = uniforms[:, None] * cum[:, -1:]
    pick = torch.searchsorted(cum, target).clamp(max=cum.shape[-1] - 1)  # [rows, 1]
    return order.gather(-1, pick).squeeze(-1)


# --------------------------------------------------------------------------- state


@dataclass
class ProposerState:
    """One proposer's model state for the problems of a batch (one row each)."""

    cache: BudgetedCache
    pending: torch.Tensor  # [rows] int64
    # candidate states kept for adoption: (problem row, candidate index) -> (1-row cache, pending)
    kept: dict[tuple[int, int], tuple[BudgetedCache, int]] = field(default_factory=dict)


@dataclass
class DecodeSpec:
    name: str  # proposer name
    n: int
    temperature: float
    top_p: float
    max_step_tokens: int
    delimiter: str
    pruners: Sequence[tuple[str, Pruner]] = ()
    record_signals: bool = False


def start(runner: HFRunner, evictor: Evictor, prompts: Sequence[str], rng_keys: Sequence[int], *,
          name: str = "", clock=NULL_CLOCK) -> ProposerState:
    cache = runner.new_cache(evictor, len(prompts), rng_keys)
    ids = [runner.encode(p) for p in prompts]
    with clock.phase(f"forward:{name}"):
        pending = runner.prefill(cache, ids)
    return ProposerState(cache, pending)


class _Round:
    """One proposer's candidates during one round: forked cache, live rows, what each row has
    generated. `step(logits)` consumes one decode step's logits for the live rows."""

    def __init__(self, runner: HFRunner, state: ProposerState, spec: DecodeSpec, token_room: Sequence[int],
                 sample_seeds: Sequence[int], clock=NULL_CLOCK) -> None:
        n = spec.n
        self.clock = clock
        fork = torch.arange(state.cache.n_rows).repeat_interleave(n)  # candidate row -> problem row
        self.runner, self.state, self.spec = runner, state, spec
        self.cache = state.cache.select(fork)
        self.cache.rows.rng_keys = torch.as_tensor(
            [row_seed(int(k), i % n) for i, k in enumerate(self.cache.rows.rng_keys)])
        self.pending = state.pending[fork]
        rows = fork.numel()
        self.cap = [min(spec.max_step_tokens, max(1, token_room[p])) for p in fork.tolist()]
        self.generators = [torch.Generator().manual_seed(row_seed(sample_seeds[p], i % n))
                           for i, p in enumerate(fork.tolist())]
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.logprobs: list[list[float]] = [[] for _ in range(rows)]
        self.texts = [""] * rows
        self.entropies = torch.zeros(rows, max(self.cap, default=1))
        self.signals: list[dict[str, list[float]]] = [{} for _ in range(rows)]
        self.finish: list[Optional[str]] = [None] * rows
        self.live = torch.arange(rows)  # candidate ids still decoding, in cache row order
        state.kept.clear()

    def step(self, logits: torch.Tensor) -> None:
        spec, live = self.spec, self.live
        uniforms = torch.stack([torch.rand((), generator=self.generators[c]) for c in live.tolist()])
        new, lp, ent = sample(logits, spec.temperature, spec.top_p, uniforms)
        new, lp, ent = new.cpu(), lp.cpu(), ent.cpu()
        done = torch.zeros(len(live), dtype=torch.bool)
        tail = len(spec.delimiter) - 1
        for j, c in enumerate(live.tolist()):
            tok = int(new[j])
            self.tokens[c].append(tok)
            self.logprobs[c].append(float(lp[j]))
            self.entropies[c, len(self.tokens[c]) - 1] = ent[j]
            before = self.texts[c][-tail:] if tail else ""
            piece = self.runner.piece(tok)
            self.texts[c] += piece
            if tok in self.runner.eos_ids:
                self.finish[c] = "eos"
            elif spec.delimiter in before + piece:
                self.finish[c] = "delimiter"
            elif len(self.tokens[c]) >= self.cap[c]:
                self.finish[c] = "max_step_tokens"
            done[j] = self.finish[c] is not None
        if spec.pruners:
            with self.clock.phase("prune"):
                self._prune(done)
        if done.any():
            for j in done.nonzero().flatten().tolist():
                c = int(live[j])
                self.state.kept[(c // spec.n, c % spec.n)] = (self.cache.select([j]), self.tokens[c][-1])
            stay = (~done).nonzero().flatten()
            self.live, new = live[stay], new[stay]
            if len(self.live):
                self.cache = self.cache.select(stay)
        self.pending = new

    def _prune(self, done: torch.Tensor) -> None:
        live = self.live.tolist()
        counts = torch.as_tensor([len(self.tokens[c]) for c in live])
        trace = StepTrace(self.entropies[self.live], counts, [self.texts[c] for c in live])
        for pname, pruner in self.spec.pruners:
            if self.spec.record_signals:
                values = pruner.signal(trace).tolist()
                for j, c in enumerate(live):
                    self.signals[c].setdefault(pname, []).append(values[j])
            flagged = pruner.check(trace) & ~done
            for j in flagged.nonzero().flatten().tolist():
                self.finish[live[j]] = f"pruned:{pname}"
                done[j] = True

    def candidates(self) -> list[Candidate]:
        n = self.spec.n
        return [
            Candidate(
                problem=c // n, source=self.spec.name, index=c % n, token_ids=self.tokens[c],
                text=self.runner.decode(self.tokens[c][:-1] if self.finish[c] == "eos" else self.tokens[c]),
                logprobs=self.logprobs[c], entropies=self.entropies[c, : len(self.tokens[c])].tolist(),
                finish=self.finish[c] or "", signals=self.signals[c],
            )
            for c in range(len(self.tokens))
        ]


@torch.inference_mode()
def propose(runner: HFRunner, state: ProposerState, spec: DecodeSpec, token_room: Sequence[int],
            sample_seeds: Sequence[int]) -> list[Candidate]:
    """`spec.n` candidates for every row of `state` (all rows decoded together).

    token_room[p]: most tokens problem p may still add (limits.max_tokens); sample_seeds[p]:
    seed of problem p's candidates this round (candidate i uses row_seed(seed, i)).
    """
    return propose_together(runner, [(state, spec, token_room, sample_seeds)])[0]


@torch.inference_mode()
def propose_together(runner: HFRunner, jobs, clock=NULL_CLOCK) -> list[list[Candidate]]:
    """`propose()` for several proposers that share `runner`'s model, in lockstep: every
    decode step is one forward over all their live rows, so the weights are read once for
    all of them. jobs: [(state, spec, token_room, sample_seeds), ...]; candidates per job.
    `clock` (kvflow.timing) times each forward as `forward:<proposers in it>` and pruning."""
    rounds = [_Round(runner, *job, clock=clock) for job in jobs]
    while True:
        active = [r for r in rounds if len(r.live)]
        if not active:
            break
        with clock.phase("forward:" + "+".join(r.spec.name for r in active)):
            if len(active) == 1:
                logits = [runner.forward(active[0].cache, active[0].pending[:, None])]
            else:
                logits = runner.decode_joint([r.cache for r in active], [r.pending for r in active])
        for r, lg in zip(active, logits):
            r.step(lg)
    return [r.candidates() for r in rounds]


@torch.inference_mode()
def sync(runner: HFRunner, state: ProposerState, commits: Sequence[tuple[Optional[int], str]],
         keep_rows: Sequence[int], *, name: str = "", clock=NULL_CLOCK) -> ProposerState:
    """Bring every row up to date with the step just committed, then keep only `keep_rows`.

    commits[p] = (index of this proposer's candidate that was committed, or None; step text).
    A committed own candidate is adopted (its cache becomes the row's state); otherwise the
    committed text, tokenized with this model's tokenizer, is ingested with eviction.
    """
    parts: list[tuple[BudgetedCache, torch.Tensor]] = []
    ingest_rows = [p for p in keep_rows if commits[p][0] is None]
    order: dict[int, int] = {}
    if ingest_rows:
        sub = state.cache.select(ingest_rows)
        new_ids = [runner.encode(commits[p][1]) for p in ingest_rows]
        pend = state.pending[ingest_rows]
        with clock.phase(f"forward:{name}"):
            runner.ingest(sub, [[int(pend[i])] + ids[:-1] if ids else [] for i, ids in enumerate(new_ids)])
        pending = torch.as_tensor([ids[-1] if ids else int(pend[i]) for i, ids in enumerate(new_ids)])
        parts.append((sub, pending))
        order.update({p: i for i, p in enumerate(ingest_rows)})
    offset = len(ingest_rows)
    for p in keep_rows:
        own = commits[p][0]
        if own is not None:
            kept_cache, last = state.kept[(p, own)]
            parts.append((kept_cache, torch.as_tensor([last])))
            order[p] = offset
            offset += 1
    state.kept.clear()
    if not parts:
        return ProposerState(state.cache.select([]), state.pending[:0])
    cache = BudgetedCache.cat([c for c, _ in parts]) if len(parts) > 1 else parts[0][0]
    pending = torch.cat([pnd for _, pnd in parts])
    perm = [order[p] for p in keep_rows]
    if perm != list(range(len(perm))):
        cache, pending = cache.select(perm), pending[perm]
    return ProposerState(cache, pending)
