"""The records that flow between components: candidates, committed steps, trajectories, score
requests and the trace pruners read. Re-exported by `kvflow.components.base`, the import path
plugins use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch as _torch


@dataclass
class Candidate:
    """One proposed step. `logprobs` are the model's own log-probabilities (temperature 1) of
    the sampled tokens; `entropies` are measured on the sampling distribution (after
    temperature and before top-p; greedy decoding counts as temperature 1), in nats.

    `confidences` are DeepConf's token confidences (`StepTrace.confidences`: minus the mean of
    the top-`CONFIDENCE_TOP_K` temperature-1 log-probabilities), one per token.

    `finish` is `eos` (the last token is EOS, left out of `text`), `delimiter` (the token that
    completed the delimiter is the last one), `max_step_tokens` (the step's cap: the spec's
    `max_step_tokens` or the request's `token_room`, whichever is smaller) or `pruned:<name>`.
    `signals` holds, when the spec records them, each pruner's `signal()` at every token at
    which the candidate was live (`Pruner`): one value per token for a pruned candidate, one
    fewer for a candidate ended by a stop rule. `problem` is not an identity: engines set 0,
    and kvflow reads a candidate's problem from its request (`ScoreRequest.trajectory`)."""

    problem: int  # unused by kvflow (engines set 0); identify the problem by ScoreRequest.trajectory
    source: str  # proposer name
    index: int  # candidate index within the proposer, 0..n-1
    text: str
    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float]
    finish: str  # delimiter | eos | max_step_tokens | pruned:<pruner>
    score: Optional[float] = None
    signals: dict[str, list[float]] = field(default_factory=dict)  # pruner traces, when recorded
    confidences: list[float] = field(default_factory=list)  # per token: StepTrace.confidences (engines fill it)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def pruned(self) -> bool:
        return self.finish.startswith("pruned:")


@dataclass
class Step:
    """One committed step. `n_tokens` counts it in the base model's tokens. `token_ids` and
    `logprobs` are the committed candidate's own (its `source` proposer's tokenizer and model:
    each token's temperature-1 log-probability when that proposer sampled it, over that
    proposer's cache, evicted or not), without a final EOS token, so that `token_ids` decode to
    `text`; empty in steps built by hand."""

    text: str
    source: str
    score: Optional[float]
    n_tokens: int
    fallback: bool = False  # committed although every candidate had been pruned
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


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
    all_candidates: list[dict] = field(default_factory=list)  # every candidate of every step, when recorded

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.steps)


@dataclass
class ScoreRequest:
    """One candidate to score, with the problem it continues (`Scorer.score()` gets a list).

    Attributes:
        trajectory: The problem's committed trajectory so far (`problem_id`, `question`, the
            chat-templated `prompt`, the committed `steps`): the context the candidate would
            continue. It identifies the problem (`trajectory.problem_id`); `candidate.problem`
            does not (engines leave it 0).
        candidate: The proposed step (`text`, `token_ids`, `source` proposer, per-token
            `logprobs`, `entropies` and `confidences`, `finish`). Its `score` is None until the
            round's scores are set from what `score()` returns.
    """

    trajectory: Trajectory
    candidate: Candidate


#: k of the token confidence every engine computes (DeepConf, Fu et al. 2025, arXiv:2508.15260,
#: uses k = 20): `StepTrace.confidences` and `Candidate.confidences`
CONFIDENCE_TOP_K = 20


@dataclass
class StepTrace:
    """What pruners see after every decoded token: the live candidate rows of one proposer.

    entropies:   [rows, max_step_tokens] float32, valid up to n_tokens[row]: entropy (nats)
                 of the sampling distribution (after temperature, before top-p)
    n_tokens:    [rows] int64, tokens generated so far in this step (including the newest)
    texts:       each row's step so far: its tokens' texts, each decoded on its own, joined (a
                 character split across tokens shows as U+FFFD pieces); engines may pass
                 anything when every pruner has `needs_text = False`
    logprobs:    [rows, max_step_tokens] float32, valid up to n_tokens[row]: the sampled
                 token's log-probability under the model's own distribution (temperature 1,
                 before top-p), as in `Candidate.logprobs`
    confidences: [rows, max_step_tokens] float32, valid up to n_tokens[row]: DeepConf's token
                 confidence C_i = -(1/k) * sum of the k largest temperature-1 log-probabilities
                 at token i, k = `CONFIDENCE_TOP_K` (20; min(k, vocab) on a smaller vocabulary).
                 High: a peaked distribution (a confident model); low: a flat one

    Engines fill every field; `logprobs` and `confidences` are None only in traces built by
    hand (kvflow 0.1 had neither; a pruner that reads them may assume an engine's trace).
    Both are exact on every built-in engine (`hf` computes them in the sampling pass, SGLang
    from the top-k log-probabilities it returns), equal within float tolerance.
    """

    entropies: "_torch.Tensor"
    n_tokens: "_torch.Tensor"
    texts: Sequence[str]
    logprobs: Optional["_torch.Tensor"] = None
    confidences: Optional["_torch.Tensor"] = None
