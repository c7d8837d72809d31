"""The contract suites of `kvflow.testing` fail on components with the bugs they are meant to
catch (a suite that passes everything would protect nobody)."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ConfigDict, Field

from kvflow.components.base import (
    Committer, CommitterParams, Pruner, PrunerParams, Scorer, ScorerContext, ScorerParams,
)
from kvflow.testing.committer_contract import CommitterContract
from kvflow.testing.pruner_contract import PrunerContract
from kvflow.testing.scorer_contract import ScorerContract


class LengthParams(PrunerParams):
    threshold: float = Field(60, description="Tokens after which a candidate is stopped.")
    min_tokens: int = Field(0, description="No check before this many tokens.")


class LengthPruner(Pruner):
    """Stops every candidate longer than `threshold` tokens."""

    Params = LengthParams

    def check(self, trace):
        return trace.n_tokens > self.params.threshold


class CountingPruner(LengthPruner):
    """Stops a row once it has been checked `threshold` times: state kept across calls."""

    def __init__(self, params):
        super().__init__(params)
        self.calls = 0

    def check(self, trace):
        self.calls += 1
        return torch.full((len(trace.texts),), self.calls > 3)


class BatchSizePruner(LengthPruner):
    """Stops every row of a batch of three or more: verdicts depend on the batch."""

    def check(self, trace):
        return torch.full((len(trace.texts),), len(trace.texts) >= 3)


class ListPruner(LengthPruner):
    """Returns a list instead of a tensor."""

    def check(self, trace):
        return [False] * len(trace.texts)


def pruner_suite():
    return PrunerContract()


@pytest.mark.parametrize("cls,test,message", [
    (CountingPruner, "test_no_hidden_history", "twice|fresh pruner"),
    (BatchSizePruner, "test_rows_are_independent", "depends on the batch"),
    (ListPruner, "test_check_returns_one_bool_per_row", "bool tensor"),
    (LengthPruner, "test_healthy_candidates_are_never_stopped", "stopped a coherent candidate"),
])
def test_pruner_contract_catches(cls, test, message):
    factory = lambda **params: cls(cls.Params(**params))  # noqa: E731
    with pytest.raises(AssertionError, match=message):
        getattr(pruner_suite(), test)(factory)


def test_pruner_contract_catches_flags_before_min_tokens():
    factory = lambda **params: LengthPruner(LengthPruner.Params(threshold=5, min_tokens=20, **params))  # noqa: E731
    with pytest.raises(AssertionError, match="before min_tokens"):
        pruner_suite().test_min_tokens_is_respected(factory)


class MutableParams(PrunerParams):
    model_config = ConfigDict(frozen=False, extra="forbid")
    threshold: float = Field(1.0, description="Unused.")


class MutablePruner(LengthPruner):
    """A pruner whose Params can be changed in place."""

    Params = MutableParams


class UndescribedParams(PrunerParams):
    threshold: float = 60  # no Field(description=...): the contract must say so


class UndescribedPruner(LengthPruner):
    """A pruner one of whose parameters has no description."""

    Params = UndescribedParams


class UndocumentedPruner(LengthPruner):
    pass


def test_component_contract_catches_mutable_params_and_missing_docstrings():
    suite = pruner_suite()
    with pytest.raises(BaseException, match="DID NOT RAISE"):
        suite.test_params_model_is_frozen_and_strict(MutablePruner(MutableParams()))
    with pytest.raises(AssertionError, match="no description"):
        suite.test_every_parameter_is_described(UndescribedPruner(UndescribedParams()))
    suite.test_every_parameter_is_described(LengthPruner(LengthParams()))  # described: passes
    with pytest.raises(AssertionError, match="no docstring of its own"):
        suite.test_documented(UndocumentedPruner(LengthParams()))


# --------------------------------------------------------------------------- committers


class OutOfRangeCommitter(Committer):
    """Returns one past the last candidate."""

    def pick(self, candidates):
        return len(candidates)


class CoinCommitter(Committer):
    """Picks at random (unseeded)."""

    def pick(self, candidates):
        return random.randrange(len(candidates))


class LowestCommitter(Committer):
    """Picks the lowest score (not monotone)."""

    def pick(self, candidates):
        scores = [c.score if c.score is not None and c.score == c.score else 0.0 for c in candidates]
        return min(range(len(candidates)), key=scores.__getitem__)


class NamedBaseCommitter(Committer):
    """Highest score; ties go to the proposer named "base" (not to the first proposer)."""

    def pick(self, candidates):
        def key(i):
            c = candidates[i]
            s = c.score if c.score is not None and c.score == c.score else float("-inf")
            return (-s, c.source != "base", c.index)
        return min(range(len(candidates)), key=key)


class TwoProposerCommitter(NamedBaseCommitter):
    """Assumes a pipeline has exactly a base and one helper."""

    def __init__(self, params, proposers):
        super().__init__(params, proposers)
        self.base, self.helper = proposers


@pytest.mark.parametrize("cls,test,message", [
    (NamedBaseCommitter, "test_proposer_names_do_not_matter", "renaming the proposers"),
    (TwoProposerCommitter, "test_any_number_of_proposers", r"with proposers \['base'\] the committer failed"),
    (OutOfRangeCommitter, "test_pick_returns_an_index", "for .* candidates"),
    (CoinCommitter, "test_deterministic_and_pure", "different winners|picked differently"),
    (LowestCommitter, "test_raising_the_winners_score_keeps_it", "lost after its score was raised"),
])
def test_committer_contract_catches(cls, test, message):
    factory = lambda proposers, **params: cls(CommitterParams(**params), proposers)  # noqa: E731
    with pytest.raises(AssertionError, match=message):
        getattr(CommitterContract(), test)(factory)


# --------------------------------------------------------------------------- scorers


class BatchScorer(Scorer):
    """Scores a candidate by its length, divided by the number of requests in the batch."""

    Params = ScorerParams

    def score(self, requests):
        return [len(r.candidate.text) / len(requests) for r in requests]


class ShortScorer(BatchScorer):
    """Forgets the last request."""

    def score(self, requests):
        return [float(len(r.candidate.text)) for r in requests][:-1]


class MutatingScorer(BatchScorer):
    """Writes its score into the candidate."""

    def score(self, requests):
        for r in requests:
            r.candidate.score = 1.0
        return [1.0] * len(requests)


class ContextByIndexScorer(BatchScorer):
    """Keeps each problem's context by `Candidate.problem` (and depth), as if it were an identity."""

    def __init__(self, params, context):
        super().__init__(params, context)
        self.contexts = {}

    def score(self, requests):
        out = []
        for r in requests:
            key = (r.candidate.problem, len(r.trajectory.steps))
            context = self.contexts.setdefault(key, "".join(s.text for s in r.trajectory.steps))
            out.append(float(len(context)) + len(r.candidate.text) / 1000)
        return out


class UndeclaredModelScorer(BatchScorer):
    """Scores with a model it does not declare in `models_needed()`."""

    def __init__(self, params, context):
        super().__init__(params, context)
        self.session = None

    def score(self, requests):
        if self.session is None:
            self.session = self.context.load_session("tiny")
        return [float(len(r.candidate.text)) for r in requests]


@pytest.mark.parametrize("cls,test,message", [
    (ContextByIndexScorer, "test_candidate_problem_is_not_an_identity", "Candidate.problem 0 for every candidate"),
    (UndeclaredModelScorer, "test_can_score_and_models_needed", r"loaded models.\['tiny'\] .* but models_needed"),
    (BatchScorer, "test_batch_and_order_do_not_matter", "alone vs in a batch"),
    (ShortScorer, "test_one_float_per_request", "5 scores for 6 requests"),
    (MutatingScorer, "test_requests_are_not_changed", "changed its requests"),
])
def test_scorer_contract_catches(cls, test, message):
    factory = lambda context, **params: cls(ScorerParams(**params), context)  # noqa: E731
    context = lambda: ScorerContext(load_session=lambda key: object(), proposers=["base", "helper"], seed=0)  # noqa: E731
    with pytest.raises(AssertionError, match=message):
        getattr(ScorerContract(), test)(factory, context)


# --------------------------------------------------------------------------- evictors

from kvflow.components.base import Evictor, EvictorParams  # noqa: E402
from kvflow.testing.evictor_contract import EvictorContract  # noqa: E402


class BatchMeanEvictor(Evictor):
    """Key norms plus the batch's mean norm per slot: a row's kept set depends on the other rows."""

    Params = EvictorParams

    def score(self, keys, values, queries, **kwargs):
        norms = keys.float().norm(dim=-1)
        return norms + norms.mean(dim=0, keepdim=True)


class TopkEvictor(Evictor):
    """Key norms, selected with topk instead of the base class's rule: ties go where topk puts them."""

    Params = EvictorParams

    def score(self, keys, values, queries, **kwargs):
        return -keys.float().norm(dim=-1)

    def select(self, keys, values, queries, *, lengths, n_protected, **kwargs):
        scores = self.score(keys, values, queries).clone()
        slot, end = torch.arange(keys.shape[2])[None, None, :], lengths[:, None, None]
        forced = ((slot >= end - self.params.window) & (slot < end)) | (slot < n_protected[:, None, None])
        scores = scores.masked_fill(slot >= end, float("-inf")).masked_fill(forced, float("inf"))
        return scores.topk(self.params.budget, dim=-1).indices.sort(dim=-1).values


class GlobalRNGEvictor(Evictor):
    """Random scores from torch's global generator, not the rows' own `generators`."""

    Params = EvictorParams

    def score(self, keys, values, queries, **kwargs):
        return torch.rand(keys.shape[:3])


class LayerScoredEvictor(Evictor):
    """Key norms scaled by the layer, yet declared layer invariant: stacked layers score as layer 0."""

    Params = EvictorParams
    layer_invariant = True

    def score(self, keys, values, queries, *, layer_idx, **kwargs):
        return keys.float().norm(dim=-1) * (1.0 + layer_idx * torch.arange(keys.shape[2]) / keys.shape[2])


@pytest.mark.parametrize("cls,test,message,args", [
    (LayerScoredEvictor, "test_select_layers_keeps_what_select_keeps", "must score from its rows' tensors alone", ()),
    (BatchMeanEvictor, "test_select_is_batch_independent", "kept different slots for the row alone and inside a batch",
     ("qwen2",)),
    (TopkEvictor, "test_select_is_tie_stable", "tied scores must keep the earliest slots", ("qwen2",)),
    (GlobalRNGEvictor, "test_batched_equals_alone", "not a function of its inputs and generators", ()),
])
def test_evictor_contract_catches(cls, test, message, args):
    factory = lambda **params: cls(EvictorParams(**params))  # noqa: E731
    with pytest.raises(AssertionError, match=message):
        getattr(EvictorContract(), test)(factory, *args)


# --------------------------------------------------------------------------- engines
# Each variant is the `hf` engine with one thing done wrong, as a plugin author might; the
# engine contract must fail it, saying what is wrong.

import dataclasses  # noqa: E402

from kvflow.backends.hf.decode import _LIVE, HFEngine  # noqa: E402
from kvflow.components.base import Step  # noqa: E402
from kvflow.testing.engine_contract import EngineContract  # noqa: E402
from kvflow.timing import NULL_CLOCK  # noqa: E402


def _respec(requests, **changes):
    for r in requests:  # in place: the Proposal hands back the caller's own request
        r.spec = dataclasses.replace(r.spec, **changes)
    return requests


class IgnoresTopP(HFEngine):
    """Samples from the whole distribution whatever the spec's top_p."""

    def submit(self, requests):
        super().submit(_respec(requests, top_p=1.0))


class NoScoringSession(HFEngine):
    """Has no scoring session (the `likelihood` scorer with a model would fail at run time)."""

    def scoring_session(self):
        raise NotImplementedError("no scoring on this engine")


class IgnoresMaxRows(HFEngine):
    """Decodes every queued proposal at once."""

    def step(self, max_rows=None):
        return super().step(None)


class DropsSignals(HFEngine):
    """Never records pruner signals."""

    def submit(self, requests):
        super().submit(_respec(requests, record_signals=False))


class SharedRNG(HFEngine):
    """One random stream for every row, instead of one per candidate."""

    def _sample_rows(self, logits, rows, temperature, top_p):
        from kvflow.backends.hf.sampling import sample

        if not hasattr(self, "_rng"):
            self._rng = torch.Generator().manual_seed(0)
        u = torch.rand(len(rows), generator=self._rng)
        new, logprob, entropy, conf = sample(logits, temperature, top_p, u)
        return new.cpu(), logprob.cpu(), entropy.cpu(), conf.cpu()


class TemperedLogprobs(HFEngine):
    """Reports the log-probabilities of the tempered distribution, not the model's own."""

    def _sample_rows(self, logits, rows, temperature, top_p):
        new, logprob, entropy, conf = super()._sample_rows(logits, rows, temperature, top_p)
        if temperature > 0:
            logprob = torch.log_softmax(logits / temperature, -1).gather(-1, new[:, None]).squeeze(-1)
        return new, logprob, entropy, conf


class UntemperedEntropy(HFEngine):
    """Reports the entropy of the temperature-1 distribution whatever the temperature."""

    def _sample_rows(self, logits, rows, temperature, top_p):
        new, logprob, entropy, conf = super()._sample_rows(logits, rows, temperature, top_p)
        logp = torch.log_softmax(logits, -1)
        return new, logprob, -(logp.exp() * logp).sum(-1), conf


class PrunerOverridesStopRule(HFEngine):
    """Shows the pruners every row that got a token, and lets their verdict replace a stop rule's."""

    def _prune(self, group, rows, finish):
        verdict = super()._prune(group, rows, torch.full_like(finish, _LIVE))
        return torch.where(verdict != _LIVE, verdict, finish)


class PrunersSeeEndedRows(HFEngine):
    """Shows the pruners rows that a stop rule has just ended (their verdict is ignored)."""

    def _prune(self, group, rows, finish):
        verdict = super()._prune(group, rows, torch.full_like(finish, _LIVE))
        return torch.where(finish != _LIVE, finish, verdict)


class LastPrunerWins(HFEngine):
    """Names the finish after the last flagging pruner."""

    def submit(self, requests):
        for r in requests:
            r.spec = dataclasses.replace(r.spec, pruners=tuple(r.spec.pruners)[::-1])
        super().submit(requests)


class DelimiterInOneToken(HFEngine):
    """Looks for the delimiter inside each token's text only (no state across tokens)."""

    def _delimiter(self, delimiter):
        table = super()._delimiter(delimiter)
        one = dataclasses.make_dataclass("Table", ["next", "hit"])(torch.zeros_like(table.next), table.hit)
        return one


class _JoiningSession:
    def __init__(self, session):
        self.session = session

    def token_logprobs(self, trajectories, texts):
        joined = [dataclasses.replace(t, steps=[Step("".join(s.text for s in t.steps), "base", None, 0)])
                  if t.steps else t for t in trajectories]
        return self.session.token_logprobs(joined, texts)

    def release(self, problem_ids):
        self.session.release(problem_ids)


class JoinsTheContext(HFEngine):
    """Its scoring session tokenizes the committed steps joined, not one by one."""

    def scoring_session(self):
        return _JoiningSession(super().scoring_session())


class _ForgetfulSession(_JoiningSession):
    def token_logprobs(self, trajectories, texts):
        return self.session.token_logprobs(trajectories, texts)

    def release(self, problem_ids):
        pass


class KeepsReleasedProblems(HFEngine):
    """Its scoring session ignores `release()` (a reused problem id gets a stale context)."""

    def scoring_session(self):
        return _ForgetfulSession(super().scoring_session())


class Untimed(HFEngine):
    """Runs its forwards outside the clock the scheduler sets."""

    def step(self, max_rows=None):
        clock, self.clock = self.clock, NULL_CLOCK
        try:
            return super().step(max_rows)
        finally:
            self.clock = clock


@pytest.fixture(scope="module")
def engine_parts(tmp_path_factory):
    """(a loaded `HFRunner` on the engine contract's tiny model, the contract's `reference`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvflow.backends.hf import HFBackend
    from kvflow.config.schema import ModelConfig
    from kvflow.testing.pipelines import tiny_model_dir

    model_dir = tiny_model_dir(tmp_path_factory.mktemp("broken-engines"), "qwen2", seed=3)
    runner = HFBackend.load(ModelConfig(id=str(model_dir), dtype="float32", device="cpu")).runner
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    return runner, (model, AutoTokenizer.from_pretrained(model_dir))


@pytest.mark.parametrize("cls,test,message", [
    (IgnoresTopP, "test_sampling_follows_the_spec", "outside the top-p nucleus"),
    (TemperedLogprobs, "test_sampling_follows_the_spec", "not the model's own temperature-1 log-probability"),
    (UntemperedEntropy, "test_sampling_follows_the_spec", "not that of the sampling distribution after temperature"),
    (NoScoringSession, "test_scoring_session_matches_the_model", "scoring_session.. raised NotImplementedError"),
    (JoinsTheContext, "test_scoring_session_matches_the_model", r"after encode\(prompt\) \+ encode\(step\)"),
    (KeepsReleasedProblems, "test_scoring_session_matches_the_model", "after p0 was released"),
    (IgnoresMaxRows, "test_step_respects_max_rows", r"step\(max_rows=2\) decoded 6 rows"),
    (DropsSignals, "test_recorded_signals_are_the_pruners_own", "record_signals: candidate .* carries 0 values"),
    (SharedRNG, "test_sampling_is_seeded_and_independent_of_the_batch",
     "seeded per request|changed when other requests were decoded"),
    (PrunerOverridesStopRule, "test_stop_rules_win_over_pruners", "a stop rule on the same token wins"),
    (PrunersSeeEndedRows, "test_stop_rules_win_over_pruners", "only rows still live after the stop rules"),
    (LastPrunerWins, "test_the_first_flagging_pruner_names_the_finish", "the first in the spec's order"),
    (DelimiterInOneToken, "test_delimiter_spanning_two_tokens_ends_the_step", "across the boundary of tokens"),
    (Untimed, "test_forwards_are_timed_and_counted", r"no decode time under clock.phase\('forward:base'\)"),
])
def test_engine_contract_catches(cls, test, message, engine_parts):
    runner, reference = engine_parts
    engine = cls(runner)
    with pytest.raises(AssertionError, match=message):
        getattr(EngineContract(), test)(engine, reference)


def test_the_hf_engine_passes_the_cases_its_variants_fail(engine_parts):
    """The cases above fail the variants, not the engine they are made from."""
    runner, reference = engine_parts
    suite = EngineContract()
    for test in sorted({"test_sampling_follows_the_spec", "test_scoring_session_matches_the_model",
                        "test_step_respects_max_rows", "test_recorded_signals_are_the_pruners_own",
                        "test_sampling_is_seeded_and_independent_of_the_batch", "test_stop_rules_win_over_pruners",
                        "test_the_first_flagging_pruner_names_the_finish",
                        "test_delimiter_spanning_two_tokens_ends_the_step", "test_forwards_are_timed_and_counted"}):
        getattr(suite, test)(HFEngine(runner), reference)
