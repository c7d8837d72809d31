"""The engine protocol: what the step scheduler asks of an inference engine (DESIGN.md §6-7).

An engine is one loaded model on one backend (`hf`, `sglang`, a plugin's). The scheduler
(`kvflow.runtime.scheduler`) never imports a backend; it drives every engine through the
methods below, and a backend registers a loader through the `register_backends` hook:

    class MyBackend:
        name = "mine"
        @staticmethod
        def load(model_cfg) -> Engine: ...

A problem's state on an engine is an opaque handle (`State`) that the engine creates in
`start()` and replaces in `sync()`; the scheduler only passes it back. The life of one
problem on one proposer, one step at a time:

    [state] = engine.start([StartRequest(prompt, evictor, rng_key)])
    engine.submit([ProposeRequest(state, proposer, spec, seed, token_room, tag)])
    while ...: finished = engine.step()           # one decode forward over every queued proposal
    # finished: [Proposal(request, candidates)], each candidate ended (delimiter, EOS,
    # max_step_tokens, room) or stopped by a pruner mid-step
    [state] = engine.sync([SyncRequest(state, proposal, own_index_or_None, committed_text)])
    ...
    engine.release([state], [proposal])

Contracts every engine keeps (checked by `kvflow.testing.engine_contract`):
- `start` keeps the prompt's last token pending: a state is "cache + pending token".
- candidate `i` of a request samples from a stream seeded by `row_seed(request.seed, i)`
  (and, for stochastic evictors, evicts with a stream keyed by the state's rng key and `i`),
  so a problem's candidates do not depend on which other requests share a decode step;
  greedy (temperature 0) is deterministic;
- a candidate's `text` is its tokens decoded, without a final EOS token; `logprobs` are the
  model's own (temperature 1) log-probabilities of the sampled tokens; `entropies` the
  entropy (nats) of the sampling distribution (after temperature, before top-p);
- pruners (`spec.pruners`) see every live candidate row after every token and stop flagged
  rows at once (finish `pruned:<name>`);
- `sync` with `own_index` adopts that candidate's state (no recomputation); with None it
  ingests `text` (tokenized by this engine) into the state, evicting as it goes; either way
  the returned state holds exactly what a plain decode of the same text would;
- a state or proposal passed to `sync` or `release` is not used again by the caller.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

from kvflow.components.base import Candidate, Evictor, Pruner

State = Any  # an engine's handle of one problem's model state


def row_seed(*parts: object) -> int:
    """A stable 63-bit seed from any tuple of values (run seed, problem id, proposer, ...)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def delimiter_scan(pattern: str, state: int, piece: str) -> tuple[int, bool]:
    """Delimiter matching across token boundaries, shared by engines: feed one token's text
    to a KMP matcher in `state` (characters of `pattern` the text so far ends with). Returns
    (the next state, whether `piece` completes the pattern); after a completion the match
    restarts (state 0)."""
    for ch in piece:
        text = pattern[:state] + ch
        state = next((k for k in range(min(len(text), len(pattern)), 0, -1) if text.endswith(pattern[:k])), 0)
        if state == len(pattern):
            return 0, True
    return state, False


@dataclass(frozen=True)
class SamplingSpec:
    """How a proposer samples one step."""

    n: int  # candidates per request
    temperature: float  # 0 = greedy
    top_p: float
    max_step_tokens: int
    delimiter: str  # a candidate ends after the token that completes it
    pruners: Sequence[tuple[str, Pruner]] = ()
    record_signals: bool = False  # keep each pruner's signal per token in Candidate.signals


@dataclass(frozen=True)
class StartRequest:
    prompt: str  # the exact text fed to the model (chat template applied)
    evictor: Evictor
    rng_key: int  # seeds the state's stochastic evictors (e.g. row_seed(seed, problem, proposer))


@dataclass
class ProposeRequest:
    state: State
    proposer: str  # becomes Candidate.source
    spec: SamplingSpec
    seed: int  # candidate i samples from row_seed(seed, i)
    token_room: int  # most tokens a candidate may generate (the trajectory's remaining room)
    tag: Any = None  # the caller's; handed back untouched in the Proposal


@dataclass
class Proposal:
    """A finished request: every candidate has ended. `handle` is the engine's (kept candidate
    states for adoption); the caller passes the Proposal to `sync` or `release`."""

    request: ProposeRequest
    candidates: list[Candidate]
    handle: Any = field(default=None, repr=False)


@dataclass
class SyncRequest:
    state: State
    proposal: Optional[Proposal]  # this proposer's finished proposal of the step, if it proposed
    own_index: Optional[int]  # index of the committed candidate in `proposal`, or None (ingest text)
    text: str  # the committed step


@runtime_checkable
class Engine(Protocol):
    """One loaded model behind a backend. See the module docstring for the contracts."""

    backend: str  # the registered backend name
    device: str
    tokenizer: Any  # a transformers tokenizer of this model (prompt rendering, chat template)
    label: str  # the proposers on this model ("base+helper"), set by the scheduler, for timing phase names
    clock: object  # a kvflow.timing clock the scheduler sets; forwards run inside `clock.phase("forward:...")`
    forwards: int  # decode forwards run so far (occupancy = rows_decoded / forwards / bound)
    rows_decoded: int  # candidate rows fed to those forwards, summed
    # optional: `evicts = False` for an engine that runs full-context proposers only, and
    # `exact_entropy = False` for one that estimates entropies (the contract suite adapts)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens."""

    def kv_shape(self) -> tuple[int, int, int, int]:
        """(layers, KV heads, head_dim, bytes per element) of this model's cache."""

    def start(self, requests: Sequence[StartRequest]) -> list[State]:
        """Prefill each prompt (batched); a state per request."""

    def submit(self, requests: Sequence[ProposeRequest]) -> None:
        """Queue proposals; they are decoded by later `step()` calls, oldest first."""

    def step(self, max_rows: Optional[int] = None) -> list[Proposal]:
        """Run one decode step over the queued proposals (at most `max_rows` candidate rows,
        whole proposals, oldest first; a proposal once started is decoded every step) and
        return the proposals whose candidates have all ended."""

    def busy_rows(self) -> int:
        """Candidate rows queued or decoding."""

    def sync(self, requests: Sequence[SyncRequest]) -> list[State]:
        """Bring states up to date with the committed step (batched); the new state per request."""

    def release(self, states: Sequence[State], proposals: Sequence[Proposal] = ()) -> None:
        """Free states and finished proposals that will not be synced."""

    def scoring_session(self):
        """A full-context scoring session on this model (`token_logprobs(trajectories, texts)`,
        `release(problem_ids)`), for scorers such as `likelihood`."""
