"""The component protocols (DESIGN.md §2, §6) and the records that flow between them.

A component is a small class with a frozen pydantic `Params` model and one main method:

- `Evictor.score()`   which cached tokens matter (the base class turns scores into a kept set);
- `Pruner.check()`    which live candidates to stop now;
- `Scorer.score()`    how good each surviving candidate is;
- `Committer.pick()`  which candidate of a problem becomes the next step.

Nothing here imports torch at module import time, so `kvflow validate` and `kvflow ls` stay
fast; tensors are only touched inside methods that run during `kvflow run`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field

from kvflow._lazy import torch

if TYPE_CHECKING:  # pragma: no cover
    import torch as _torch


class Params(BaseModel):
    """Base of every component's parameter model: frozen, unknown keys rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


# --------------------------------------------------------------------------- records


@dataclass
class Candidate:
    """One proposed step. `logprobs` are the model's own log-probabilities (temperature 1) of
    the sampled tokens; `entropies` are measured on the sampling distribution (after
    temperature and before top-p), in nats."""

    problem: int  # index of the problem in the current batch
    source: str  # proposer name
    index: int  # candidate index within the proposer, 0..n-1
    text: str
    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float]
    finish: str  # delimiter | eos | max_step_tokens | pruned:<pruner>
    score: Optional[float] = None
    signals: dict[str, list[float]] = field(default_factory=dict)  # pruner traces, when recorded

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def pruned(self) -> bool:
        return self.finish.startswith("pruned:")


@dataclass
class Step:
    text: str
    source: str
    score: Optional[float]
    n_tokens: int
    fallback: bool = False  # committed although every candidate had been pruned


@dataclass
class Trajectory:
    """The shared committed text of one problem. Text is the source of truth; each proposer
    keeps its own tokenization of it in its cache."""

    problem_id: str
    question: str
    prompt: str  # the exact text fed to the base model (chat template applied)
    steps: list[Step] = field(default_factory=list)
    finish: Optional[str] = None  # eos | answer | cap_steps | cap_tokens
    tokens_generated: dict[str, int] = field(default_factory=dict)
    pruned: dict[str, int] = field(default_factory=dict)
    candidates: dict[str, int] = field(default_factory=dict)  # candidates proposed, by proposer
    committed_tokens: int = 0
    signals: list[dict] = field(default_factory=list)  # per-candidate pruner traces, when recorded

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.steps)


@dataclass
class ScoreRequest:
    trajectory: Trajectory
    candidate: Candidate


@dataclass
class StepTrace:
    """What pruners see after every decoded token: the live candidate rows of one proposer.

    entropies: [rows, max_step_tokens] float32, valid up to n_tokens[row]
    n_tokens:  [rows] int64, tokens generated so far in this step (including the newest)
    texts:     decoded text of each row's step so far
    """

    entropies: "_torch.Tensor"
    n_tokens: "_torch.Tensor"
    texts: Sequence[str]


# --------------------------------------------------------------------------- evictors


class EvictorParams(Params):
    budget: int = Field(64, ge=1, description="Tokens kept per (layer, KV head) after a compaction.")
    buffer: int = Field(128, ge=1, description="Tokens appended between compactions; the peak is budget + buffer.")
    window: int = Field(8, ge=0, description="Most recent tokens always kept (inside the budget).")
    protect_prompt: bool = Field(False, description="Keep the prompt (inside the budget, leaving at least one free slot).")


class Evictor:
    """Base class of KV eviction methods.

    Subclasses implement `score()`; the base class adds the parts every method shares
    (METHODS.md §0): the recent `window` and the protected prompt are always kept, padding
    slots never are, exactly `budget` tokens survive per (row, KV head), in time order.
    """

    Params: ClassVar[type[EvictorParams]] = EvictorParams
    #: False only for `none`: the cache then grows instead of compacting.
    bounded: ClassVar[bool] = True

    def __init__(self, params: EvictorParams) -> None:
        self.params = params

    @property
    def query_window(self) -> int:
        """How many recent post-RoPE queries per layer the cache must buffer for `score()`."""
        return 0

    @property
    def trigger(self) -> int:
        """Resident length at which a row is compacted."""
        return self.params.budget + self.params.buffer

    def n_protected(self, prompt_len: int) -> int:
        """Leading slots that are never evicted for a prompt of `prompt_len` cached tokens."""
        if not self.params.protect_prompt:
            return 0
        return max(0, min(prompt_len, self.params.budget - self.params.window - 1))

    def score(
        self,
        keys: "_torch.Tensor",
        values: "_torch.Tensor",
        queries: Optional["_torch.Tensor"],
        *,
        layer_idx: int,
        lengths: "_torch.Tensor",
        generators: Sequence["_torch.Generator"],
    ) -> "_torch.Tensor":
        """Importance of every cached token; higher is kept.

        keys, values: [rows, kv_heads, N, head_dim], keys after RoPE; slots >= lengths[row] are padding
        queries:      [rows, q_heads, W, head_dim] last W post-RoPE queries (None if query_window == 0)
        lengths:      [rows] int64 resident tokens per row
        generators:   one seeded torch.Generator per row, for stochastic methods
        returns:      [rows, kv_heads, N] float32
        """
        raise NotImplementedError

    def select(
        self,
        keys: "_torch.Tensor",
        values: "_torch.Tensor",
        queries: Optional["_torch.Tensor"],
        *,
        layer_idx: int,
        lengths: "_torch.Tensor",
        n_protected: "_torch.Tensor",
        generators: Sequence["_torch.Generator"],
    ) -> "_torch.Tensor":
        """Slots to keep: [rows, kv_heads, budget] int64, ascending (time order)."""
        rows, kv_heads, n, _ = keys.shape
        budget = self.params.budget
        scores = self.score(keys, values, queries, layer_idx=layer_idx, lengths=lengths, generators=generators)
        scores = scores.float().clone()
        slot = torch.arange(n, device=keys.device)[None, :]  # [1, N]
        length = lengths.to(keys.device)[:, None]  # [rows, 1]
        valid = slot < length
        always = (slot >= length - self.params.window) | (slot < n_protected.to(keys.device)[:, None])
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        scores = scores.masked_fill((always & valid)[:, None, :], float("inf"))
        keep = scores.topk(budget, dim=-1).indices  # [rows, kv_heads, budget]
        return keep.sort(dim=-1).values


# --------------------------------------------------------------------------- pruners


class PrunerParams(Params):
    window: int = Field(32, ge=1)
    threshold: float
    min_tokens: int = Field(32, ge=0, description="No check before a candidate has this many tokens.")


class Pruner:
    """Base class of online degeneration detectors: `check()` runs after every decoded token
    of every live candidate row of the proposers it is attached to."""

    Params: ClassVar[type[PrunerParams]] = PrunerParams
    #: name of the per-token signal `signal()` returns, recorded for `kvflow calibrate`.
    signal_name: ClassVar[str] = ""

    def __init__(self, params: PrunerParams) -> None:
        self.params = params

    def signal(self, trace: StepTrace) -> "_torch.Tensor":
        """Current value of the detector's signal per row: [rows] float32 (nan before warm-up)."""
        raise NotImplementedError

    def check(self, trace: StepTrace) -> "_torch.Tensor":
        """Rows to stop now: [rows] bool."""
        raise NotImplementedError


# --------------------------------------------------------------------------- scorers


class ScorerParams(Params):
    aggregate: str = Field("last", pattern="^(last|min|prod|mean)$", description="How step scores combine.")


@dataclass
class ScorerContext:
    """What a scorer may use at run time.

    load_session(model_key) returns a backend scoring session for `models.<model_key>`
    (full context); proposers lists the pipeline's proposer names in order; seed is the run seed.
    """

    load_session: Callable[[str], Any]
    proposers: Sequence[str]
    seed: int
    delimiter: str = "\n\n"


class Scorer:
    """Base class of scorers: `score()` gets every surviving candidate of a round, batched."""

    Params: ClassVar[type[ScorerParams]] = ScorerParams

    def __init__(self, params: ScorerParams, context: ScorerContext) -> None:
        self.params = params
        self.context = context

    @classmethod
    def models_needed(cls, params: ScorerParams) -> list[str]:
        """Keys of `models` this scorer loads (checked at compile time)."""
        return []

    def can_score(self, proposer: str) -> bool:
        return True

    def score(self, requests: Sequence[ScoreRequest]) -> list[float]:
        raise NotImplementedError

    def release(self, problem_ids: Sequence[str]) -> None:
        """Problems that finished: drop any per-problem state."""


# --------------------------------------------------------------------------- committers


class CommitterParams(Params):
    pass


class Committer:
    """Base class of committers: picks one candidate per problem from scored candidates."""

    Params: ClassVar[type[CommitterParams]] = CommitterParams

    def __init__(self, params: CommitterParams, proposers: Sequence[str]) -> None:
        self.params = params
        self.proposers = list(proposers)  # pipeline order: the first is the base

    def pick(self, candidates: Sequence[Candidate]) -> int:
        """Index into `candidates` (all of one problem, scored, in proposer order)."""
        raise NotImplementedError
