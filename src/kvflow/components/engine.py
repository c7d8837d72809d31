"""The engine protocol: what the step scheduler asks of an inference engine.

An engine is one loaded model on one backend (`hf`, `sglang`, a plugin's). The scheduler
(`kvflow.runtime.scheduler`) never imports a backend; it drives every engine through the
methods below, and a backend registers a loader through the `register_backends` hook:

    class MyBackend:
        name = "mine"
        @staticmethod
        def check(model_cfg) -> str | None: ...   # loads nothing: None, or why not here
        @staticmethod
        def load(model_cfg) -> Engine: ...

A problem's state on an engine is an opaque handle (`State`) that the engine creates in
`start()` and replaces in `sync()`; the scheduler only passes it back. The life of one
problem on one proposer, one step at a time:

    [state] = engine.start([StartRequest(prompt, evictor, rng_key)])
    engine.submit([ProposeRequest(state, proposer, spec, seed, token_room, tag)])
    while ...: finished = engine.step()           # one decode step over the queued proposals
    # finished: [Proposal(request, candidates)], every candidate ended: by a stop rule
    # (eos, delimiter, max_step_tokens) or by a pruner (pruned:<name>)
    [state] = engine.sync([SyncRequest(state, proposal, own_index_or_None, committed_text)])
    ...
    engine.release([state], [proposal])

Contracts every engine keeps (checked by `kvflow.testing.engine_contract`):

- `start` keeps the prompt's last token pending: a state is "cache + pending token".
- Sampling: candidate `i` of a request samples from a stream seeded by `row_seed(request.seed,
  i)` (and, for stochastic evictors, evicts with a stream keyed by the state's rng key and
  `i`), so a problem's candidates do not depend on which other requests share a decode step;
  the sampling distribution is the model's at `temperature`, restricted to the top-p nucleus
  (the most probable tokens, most probable first, until their mass reaches `top_p`; the
  token that crosses `top_p` is in it) when `top_p < 1`; temperature 0 is greedy (argmax;
  `top_p` then plays no part) and deterministic.
- A candidate's `text` is its tokens decoded, without a final EOS token; `logprobs` are the
  model's own (temperature 1) log-probabilities of the sampled tokens, whatever the spec's
  temperature and top-p; `entropies` the entropy (nats) of the sampling distribution after
  temperature and before top-p, and at temperature 0 of the temperature-1 distribution (not
  the point mass greedy draws from). An engine that estimates entropies (e.g. from top-k
  logprobs) sets `exact_entropy = False`.
- Stop rules, after every token: EOS (finish `eos`), then the delimiter (`delimiter`: the
  token whose text completes `spec.delimiter`, matched across token boundaries, is the last
  one), then the step's cap (`max_step_tokens`: `min(spec.max_step_tokens, token_room)`
  tokens; running out of `token_room` is reported as `max_step_tokens` too, there is no
  other finish). A row ended by one of them is no longer live.
- Pruners (`spec.pruners`) then see every row still live, after every token of it, as one or
  more `StepTrace`s (rows of several proposals may share a trace, or not), and stop flagged
  rows at once (finish `pruned:<name>`, the first flagging pruner in the spec's order). A row
  that a stop rule ends on this token is not shown to them: the stop rule wins. With
  `spec.record_signals`, each pruner's `signal()` on those same traces is kept per candidate
  (`Candidate.signals[name]`: one value per token at which the row was live). A pruner with
  `needs_text = False` reads no `trace.texts`; an engine may then pass anything there.
- `step(max_rows)` starts queued proposals oldest first, whole (all `n` rows of one at once),
  while the rows decoding stay within `max_rows`; a proposal once started is decoded at every
  later step until all its candidates have ended. One exception: when nothing is decoding, the
  oldest queued proposal starts even if its `n` alone exceeds `max_rows` (else it could never
  run). `max_rows=None`: no bound.
- `sync` with `own_index` adopts that candidate's state (no recomputation); with None it
  ingests `text` (tokenized by this engine) into the state, evicting as it goes; either way
  the returned state holds exactly what a plain decode of the same text would.
- A state or proposal passed to `sync` or `release` is not used again by the caller.
- `scoring_session()` returns an object with `token_logprobs(trajectories, texts) ->
  list[list[float]]`: for each pair, the model's log-probability (temperature 1, full
  context, no eviction) of every token of `engine.encode(text)` given the context and the
  text's earlier tokens, where the context is tokenized as the proposers' caches hold it:
  `encode(trajectory.prompt)`, then `encode(step.text)` for each committed step on its own,
  concatenated (not the joined text encoded once); and `release(problem_ids)`. A session may
  cache per problem (by `trajectory.problem_id`): a problem's steps only grow between calls
  until it is released, and after `release` the id may come back with another trajectory.
  Scorers such as `likelihood` call it; an engine that cannot score raises from
  `scoring_session()`, and the contract fails it.

Counters and timing. `forwards` counts decode forwards and `rows_decoded` the candidate rows
fed to them, summed (occupancy = rows_decoded / forwards / the row bound); `start`, `sync`
and scoring do not count. An engine that does not run one batched forward per `step()` (one
that batches on its own, like SGLang, or decodes row by row) counts the `step()` calls in
which any row got a token as `forwards`, and the rows that got tokens in them as
`rows_decoded`: occupancy is then what the engine's own batching leaves to guess. The model's
work (prefill, decoding, ingestion) runs inside `clock.phase("forward:<suffix>")`, the suffix
naming the proposers whose rows the forward runs, `+`-joined in pipeline order (`label` has
them all; an engine that cannot tell which are in a forward uses `label`); kvflow's timing
report files that time under `model:<suffix>`.

Overlap. An engine whose decoding runs on its own (another process, like SGLang's worker)
sets `streams = True` (optional, added in kvflow 0.1): `step()` then only reads what arrived
(waiting briefly for it while rows decode), and the scheduler calls it again and again while
other engines compute. An engine without it computes in `step()` and may be stepped on a
thread of its own, concurrently with other engines (never with itself): it must not share
mutable state with another engine (two engines are two models).

Candidates: `source` is the request's proposer, `index` 0..n-1, `problem` 0 (the caller knows
a proposal's problem from its `tag`).

Versions. An engine says which version of this protocol it was written to in its optional
`protocol` attribute ("0.1" when it has none); `PROTOCOL_VERSION` is the version this kvflow
speaks, and docs/changelog.md lists what each version changed and what an engine author must
do about it. Protocol 0.1 is everything in this module as first documented: every member of
`Engine` with the optional ones named on it (`evicts`, `exact_entropy`, `streams`,
`settings()`, `kept_kv()`, `close()`) and the backend's side (`check`, `load` and its
`evicting` and optional `evictors` keywords, `check_evictor`). Protocol 0.2 (kvflow 0.1.x,
issue 34) adds what engines fill for pruners: `StepTrace.logprobs` and
`StepTrace.confidences`, and `Candidate.confidences`. An engine that speaks an older
protocol keeps working, deprecated (`check_protocol`: a FutureWarning at load), without the
additions: the contract suite checks only what its version promised, and a pruner that reads
a later `StepTrace` field (`Pruner.trace_fields`) is refused on it with the field's name
before anything decodes (`protocol_problem`). See docs/plugins.md, "Versions".
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

from kvflow.components.base import Candidate, Evictor, Pruner

State = Any  # an engine's handle of one problem's model state

#: the engine protocol this kvflow speaks (see "Versions" above and docs/changelog.md)
PROTOCOL_VERSION = "0.2"
#: the protocol version in which each `StepTrace` field that a pruner may need was added
#: (`Pruner.trace_fields`); the fields of 0.1 (entropies, n_tokens, texts) every engine fills
TRACE_FIELDS_ADDED = {"logprobs": "0.2", "confidences": "0.2"}
#: the oldest protocol still served (deprecated until then: a FutureWarning at load)
OLDEST_SUPPORTED = "0.1"


def protocol_of(engine: object) -> str:
    """The protocol version an engine was written to: its `protocol` attribute, "0.1" without one."""
    return str(getattr(engine, "protocol", "0.1"))


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def speaks(engine: object, version: str) -> bool:
    """Whether `engine` was written to protocol `version` or a later one."""
    return _version(protocol_of(engine)) >= _version(version)


_WARNED_PROTOCOL: set[str] = set()


def check_protocol(engine: object, *, once: bool = True) -> None:
    """At load: an engine of an older protocol than this kvflow's runs, with a FutureWarning
    (once per backend and process, unless `once=False`) that says what it lacks and where the changes are listed;
    one of an unknown or newer protocol than this kvflow knows is refused (ValueError). An engine
    that does not subclass `EngineBase` is given the optional members it lacks (`adopt_defaults`)."""
    adopt_defaults(engine)
    version = protocol_of(engine)
    backend = getattr(engine, "backend", type(engine).__name__)
    try:
        parsed = _version(version)
    except ValueError:
        raise ValueError(f"engine of backend {backend!r}: protocol {version!r} is not a version "
                         f"(kvflow speaks engine protocol {PROTOCOL_VERSION})") from None
    if parsed > _version(PROTOCOL_VERSION):
        raise ValueError(f"engine of backend {backend!r} speaks engine protocol {version}, newer than this "
                         f"kvflow's {PROTOCOL_VERSION}: upgrade kvflow")
    if parsed < _version(OLDEST_SUPPORTED):
        raise ValueError(f"engine of backend {backend!r} speaks engine protocol {version}; this kvflow serves "
                         f"{OLDEST_SUPPORTED} to {PROTOCOL_VERSION} (docs/changelog.md says what to change)")
    if parsed < _version(PROTOCOL_VERSION) and (not once or backend not in _WARNED_PROTOCOL):
        _WARNED_PROTOCOL.add(backend)
        import warnings

        missing = sorted(f for f, v in TRACE_FIELDS_ADDED.items() if _version(v) > parsed)
        warnings.warn(
            f"backend {backend!r} speaks engine protocol {version} (deprecated; kvflow speaks {PROTOCOL_VERSION}): "
            f"it runs, but fills no StepTrace {', '.join(missing)} (pruners that read them are refused on it) "
            f"and no Candidate.confidences. Set `protocol = \"{PROTOCOL_VERSION}\"` on the engine once it fills "
            f"them; docs/changelog.md lists each change and what to do", FutureWarning, stacklevel=2)


def protocol_problem(engine: object, pruner_cls: type) -> Optional[str]:
    """Why a pruner cannot run on an engine (None if it can): it reads `StepTrace` fields
    (`Pruner.trace_fields`) added after the protocol the engine speaks."""
    needed = [f for f in getattr(pruner_cls, "trace_fields", ()) if not speaks(engine, TRACE_FIELDS_ADDED.get(f, "0.1"))]
    if not needed:
        return None
    return (f"reads StepTrace.{', StepTrace.'.join(needed)}, which backend {getattr(engine, 'backend', '?')!r} "
            f"does not fill (it speaks engine protocol {protocol_of(engine)}; the fields came with "
            f"{max(TRACE_FIELDS_ADDED[f] for f in needed)})")


def row_seed(*parts: object) -> int:
    """A stable 63-bit seed from any tuple of values (run seed, problem id, proposer, ...)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (engines' prefix reuse)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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
    delimiter: str  # a candidate ends after the token whose text completes it ("" = none)
    pruners: Sequence[tuple[str, Pruner]] = ()
    record_signals: bool = False  # keep each pruner's signal per live token in Candidate.signals

    def __post_init__(self) -> None:
        if self.record_signals:
            for name, pruner in self.pruners:
                if not _has_signal(pruner):
                    _warn_no_signal(name, pruner)

    def recorded(self) -> list[tuple[str, Pruner]]:
        """The pruners whose `signal()` an engine records per live token: every pruner that
        has one (`Pruner.has_signal`) when `record_signals` is set, none otherwise."""
        return [(n, p) for n, p in self.pruners if _has_signal(p)] if self.record_signals else []


def _has_signal(pruner: Pruner) -> bool:
    has = getattr(type(pruner), "has_signal", None)
    return bool(has()) if has is not None else True


_WARNED: set[tuple[str, type]] = set()


def _warn_no_signal(name: str, pruner: Pruner) -> None:
    """Once per (pruner name, class) in a process: a pruner without `signal()` runs, records nothing."""
    cls = type(pruner)
    if (name, cls) in _WARNED:
        return
    _WARNED.add((name, cls))
    import warnings

    warnings.warn(f"pruner {name!r} ({cls.__module__}.{cls.__qualname__}) has no signal(): it runs, and "
                  f"run.record_signals records no {name!r} signal for it (its column stays empty)", stacklevel=4)


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


class EngineBase:
    """The optional members of the engine protocol, with what an engine that does not define
    them means. kvflow's engines subclass it; an engine that does not is given these defaults
    when it loads (`adopt_defaults`, from `check_protocol`), so that kvflow reads every member
    of every engine directly, never probing for it."""

    protocol = "0.1"  # the engine protocol it was written to (see "Versions")
    evicts = True  # False: full-context proposers only
    exact_entropy = True  # False: entropies estimated (from top-k log-probabilities); the contract suite adapts
    streams = False  # True: its decoding runs on its own (another process), `step()` reads what arrived ("Overlap")
    scores_prompts = False  # True: `prompt_logprobs(ids, top)` (`kvflow serve`'s echo + logprobs completions)

    def settings(self) -> dict:
        """What it runs under, as resolved on this machine (`manifest.json` `engine_settings`)."""
        return {}

    def stats(self) -> Optional[dict]:
        """Counters for the run summary and benchmarks (None: it keeps none)."""
        return None

    def close(self) -> None:
        """The holder is done with it (a Session's end; once per model key that loaded it), so
        that a backend sharing engines between holders may free them."""

    def reset(self) -> None:
        """Back to idle: every state, queued and running proposal dropped (`kvflow serve`'s
        recovery after a component's fault). An engine that cannot raises NotImplementedError."""
        raise NotImplementedError(f"engine of backend {getattr(self, 'backend', '?')!r} cannot reset")

    def context_length(self) -> Optional[int]:
        """The model's context in tokens, where the engine knows it (None: ask the tokenizer)."""
        return None

    def cancel(self, requests: Sequence["ProposeRequest"]) -> list:
        """Stop these submitted proposals now, returning them (queued ones with no candidates,
        running ones with their tokens so far, finish `cancelled`) for `release`. The default
        stops none: they decode to their step's end, and the scheduler drops them then."""
        return []

    def prompt_logprobs(self, ids: Sequence[int], top: int):
        """`ids` scored with a full cache: each token's log p given the ones before it and the
        `top` likeliest at each position (where `scores_prompts`)."""
        raise NotImplementedError(f"engine of backend {getattr(self, 'backend', '?')!r} cannot score prompts")

    def kv_pool_tokens(self) -> int:
        """Tokens of the KV pool the engine sized for itself at start (0: none; kvflow's own
        admission bounds the KV: `run.kv_memory: auto` then reads the device's free memory)."""
        return 0


#: the members `adopt_defaults` gives an engine that lacks them: every public one of `EngineBase`
OPTIONAL_MEMBERS = tuple(name for name in vars(EngineBase) if not name.startswith("_"))


def adopt_defaults(engine: object) -> None:
    """Give an engine that does not subclass `EngineBase` the optional members it lacks."""
    if isinstance(engine, EngineBase):
        return
    for name in OPTIONAL_MEMBERS:
        if not hasattr(engine, name):
            default = getattr(EngineBase, name)
            setattr(engine, name, default.__get__(engine) if callable(default) else default)


@runtime_checkable
class Engine(Protocol):
    """One loaded model behind a backend. See the module docstring for the contracts."""

    backend: str  # the registered backend name
    device: str
    tokenizer: Any  # a transformers tokenizer of this model (prompt rendering, chat template)
    label: str  # the proposers on this model ("base+helper"), set by the scheduler, for timing phase names
    clock: object  # a kvflow.timing clock the scheduler sets; forwards run inside `clock.phase("forward:<proposers>")`
    forwards: int  # decode forwards run so far (occupancy = rows_decoded / forwards / bound); see "Counters"
    rows_decoded: int  # candidate rows fed to those forwards, summed
    # optional, with defaults (`EngineBase`): `protocol`, `evicts`, `exact_entropy`, `streams`,
    # `scores_prompts`, `settings()`, `stats()`, `close()`, `reset()`, `context_length()`,
    # `kv_pool_tokens()`, `cancel(requests)`, `prompt_logprobs(ids, top)`;
    # (`cancel` was added in kvflow 0.1.x, issue 40: the scheduler calls it for a cancelled
    # problem, a served request gone, so its rows stop decoding before the step's end);
    # further optional: for an evicting engine, `kept_kv(state)` (docs/plugins.md)

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
        whole proposals, oldest first; a proposal once started is decoded every step; when
        nothing is decoding, the oldest proposal starts even if it alone needs more than
        `max_rows`) and return the proposals whose candidates have all ended."""

    def busy_rows(self) -> int:
        """Candidate rows queued or decoding."""

    def sync(self, requests: Sequence[SyncRequest]) -> list[State]:
        """Bring states up to date with the committed step (batched); the new state per request."""

    def release(self, states: Sequence[State], proposals: Sequence[Proposal] = ()) -> None:
        """Free states and finished proposals that will not be synced."""

    def scoring_session(self):
        """A full-context scoring session on this model: `token_logprobs(trajectories, texts)
        -> list[list[float]]` (one log-probability per token of `encode(text)`, the context
        tokenized as prompt, then each committed step on its own) and `release(problem_ids)`;
        see the module docstring. For scorers such as `likelihood`."""
