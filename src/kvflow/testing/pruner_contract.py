"""The contract every pruner (online degeneration detector) must pass, as a pytest suite.

Built-ins and third-party pruners run the same tests. In a plugin's test suite:

    import pytest
    from kvflow.testing.pruner_contract import PrunerContract
    from my_plugin import MyPruner

    class TestMyPruner(PrunerContract):
        @pytest.fixture(scope="class")
        @classmethod
        def pruner_factory(cls):
            # params override the pruner's Params defaults (plus anything in contract_params)
            return lambda **params: MyPruner(MyPruner.Params(**params))

The factory is a class-scoped fixture written as a `@classmethod` under `@pytest.fixture`,
the form pytest 9 and 10 accept (pytest 9 deprecates class-scoped fixtures that are instance
methods; pytest 10 removes them); a parametrized factory takes `request` after `cls`.

pytest collects the inherited `test_*` methods; they run on CPU in well under a second.
The runtime calls `check()` after every decoded token with the live candidate rows of a
proposer, and rows leave the batch as they finish, so what is checked is:

- `check()` returns a [rows] bool tensor, `signal()` (when the pruner has one) a [rows]
  floating tensor; neither changes the trace;
- optional methods: `check()` is required; `signal()` is optional (`Pruner.has_signal()`): a
  pruner without it runs with `run.record_signals` on, recording nothing for itself (a
  warning is said once), and the engines still record every other pruner's signal;
- engine axis (`test_same_on_every_engine`, every registered backend besides `hf`): the same
  greedy candidates through the pruner on each engine see the same `StepTrace` log-
  probabilities and confidences as on `hf` (within 1e-4), record the same signal (within
  1e-4; on an engine whose entropies are estimates, the signal of hf's trace with that
  engine's entropies), and, where the signals agree, end the same
  (`kvflow.testing.engine_parity.assert_pruner_same_as_hf`);
- rows are independent: a row's verdict is the same alone, in a batch, and in any order;
- no hidden history: the verdict on a trace is the same for a fresh instance and for one
  that has seen every earlier token of the rows (and calling twice changes nothing);
- nothing is flagged before `min_tokens` (when the Params have it);
- with the default parameters a coherent math step is never flagged, and a degenerate one
  (a repetition loop, or high-entropy gibberish) is flagged at some point while it grows;
  override `degenerate_texts` for a detector of something else;
- the checks of `kvflow.testing.component_contract` (frozen, described Params; docstrings).

Traces are built from real tokenizations (`kvflow.testing.tiny_tokenizer`), token by token,
as the decode loop builds them (`kvflow.testing.pruner_contract.grow`), with per-token
entropies, log-probabilities (-entropy: the expected surprisal) and token confidences
(`confidence_for(entropy)`, unless a scenario gives its own).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Sequence

import pytest

from kvflow.components.base import PrunerParams
from kvflow.testing.component_contract import ComponentContract

HEALTHY = ("Natalia sold 48 clips in April. In May she sold half as many, 48 / 2 = 24 clips. "
           "Altogether she sold 48 + 24 = 72 clips in April and May. To check, 72 - 24 = 48, which "
           "matches April. If each clip cost $3, her revenue was 72 * 3 = 216 dollars; at $5 per clip "
           "it would have been 360. The answer is 72.\n\n")
LOOP = "so the answer is 24 " * 24
GIBBERISH = ("}{ 7 ;? an %( of ] 9= in - $[ the ,. 5 is / )( ! a 3 : to [ * and ; 1 { % "
             "0 ?) =8 , . to 6 ( ] of + 4 $ ! } 2 the ;") * 2
HEALTHY_ENTROPY = 0.4  # nats: a confident, coherent model
LOOP_ENTROPY = 0.05  # loops are very confident
GIBBERISH_ENTROPY = 4.5  # incoherence under a partial cache: a separate high-entropy mode
MAX_STEP_TOKENS = 160
#: (median token entropy, median token confidence) of the texts above (loop, healthy,
#: gibberish) teacher-forced through Qwen2.5-Coder-0.5B-Instruct after a GSM8K prompt
#: (temperature 1; confidence: minus the mean top-20 log-probability, `StepTrace.confidences`)
MEASURED = ((0.01, 11.4), (0.33, 8.3), (2.46, 4.6))


def confidence_for(entropy: float) -> float:
    """A token confidence that goes with `entropy` (nats): piecewise linear through MEASURED,
    constant past its ends. For scenarios that give an entropy only."""
    (h0, c0), *rest = MEASURED
    if entropy <= h0:
        return c0
    for h1, c1 in rest:
        if entropy <= h1:
            return c0 + (c1 - c0) * (entropy - h0) / (h1 - h0)
        h0, c0 = h1, c1
    return c0


@dataclass
class Row:
    """One candidate being generated: its tokens' text pieces, per-token entropies, sampled
    tokens' log-probabilities and token confidences."""

    pieces: list[str]
    entropies: list[float]
    logprobs: list[float] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)

    @classmethod
    def from_text(cls, text: str, entropy: float, confidence: Optional[float] = None) -> "Row":
        from kvflow.testing.models import tiny_tokenizer

        tok = tiny_tokenizer()
        ids = tok(text, add_special_tokens=False)["input_ids"][:MAX_STEP_TOKENS]
        pieces = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
        pieces = [b[len(a):] for a, b in zip([""] + pieces[:-1], pieces)]
        conf = confidence_for(entropy) if confidence is None else confidence
        n = len(ids)
        return cls(pieces, [entropy] * n, [-entropy] * n, [conf] * n)

    def __len__(self) -> int:
        return len(self.pieces)


def trace(rows: Sequence[Row], counts: Sequence[int]):
    """The `StepTrace` of `rows` after counts[i] tokens of row i (as the decode loop builds it)."""
    import torch

    from kvflow.components.base import StepTrace

    fields = {name: torch.zeros(len(rows), MAX_STEP_TOKENS) for name in ("entropies", "logprobs", "confidences")}
    for i, (row, n) in enumerate(zip(rows, counts)):
        for name, values in fields.items():  # [rows, MAX_STEP_TOKENS] each, valid up to counts[i]
            mine = getattr(row, name)[:n]
            values[i, : len(mine)] = torch.tensor(mine)
    texts = ["".join(row.pieces[:n]) for row, n in zip(rows, counts)]
    return StepTrace(n_tokens=torch.tensor(list(counts), dtype=torch.long), texts=texts, **fields)


def grow(rows: Sequence[Row]):
    """Traces after 1, 2, ... tokens of every row (rows stop growing at their length)."""
    longest = max(len(r) for r in rows)
    for k in range(1, longest + 1):
        yield trace(rows, [min(k, len(r)) for r in rows])


def _copy(t):
    from kvflow.components.base import StepTrace

    return StepTrace(t.entropies.clone(), t.n_tokens.clone(), list(t.texts), logprobs=t.logprobs.clone(),
                     confidences=t.confidences.clone())


def _other_backends() -> list[str]:
    """Registered backends besides the reference (`hf`) whose engines propose."""
    from kvflow.testing.engine_parity import compared_backends

    return compared_backends()


_NAMES = itertools.count()


class PrunerContract(ComponentContract):
    """Subclass and override the `pruner_factory` fixture (see the module docstring)."""

    #: parameters every test passes to the factory (on top of the pruner's own defaults)
    contract_params: ClassVar[dict] = {}

    params_base = PrunerParams

    @pytest.fixture(scope="class")
    @classmethod
    def pruner_factory(cls) -> Callable[..., Any]:
        """Return a callable `factory(**params) -> Pruner`; params override `Params` defaults."""
        raise NotImplementedError("override the pruner_factory fixture")

    @pytest.fixture
    def contract_component(self, pruner_factory):
        return self.make(pruner_factory)

    def make(self, factory, **overrides):
        return factory(**{**self.contract_params, **overrides})

    # ------------------------------------------------------------------ scenarios

    def healthy_texts(self) -> list[tuple]:
        """(text, per-token entropy[, per-token confidence]) of candidates a detector must
        never stop (the confidence defaults to `confidence_for(entropy)`)."""
        return [(HEALTHY, HEALTHY_ENTROPY), (HEALTHY.replace("48", "36").replace("24", "18").replace("72", "54"),
                                             HEALTHY_ENTROPY + 0.3)]

    def degenerate_texts(self) -> list[tuple]:
        """(text, per-token entropy[, per-token confidence]) of candidates of which the
        detector must stop at least one while they grow. Return [] for a detector that looks
        for something else."""
        return [(LOOP, LOOP_ENTROPY), (GIBBERISH, GIBBERISH_ENTROPY)]

    def rows(self) -> list[Row]:
        return [Row.from_text(*scenario) for scenario in self.healthy_texts() + self.degenerate_texts()]

    # ------------------------------------------------------------------ output types

    def test_check_returns_one_bool_per_row(self, pruner_factory):
        import torch

        pruner = self.make(pruner_factory)
        rows = self.rows()
        for t in list(grow(rows))[::7]:
            before = _copy(t)
            out = pruner.check(t)
            assert isinstance(out, torch.Tensor) and out.dtype == torch.bool, "check() must return a bool tensor"
            assert out.shape == (len(rows),), f"check() returned shape {tuple(out.shape)} for {len(rows)} rows"
            assert torch.equal(t.entropies, before.entropies) and torch.equal(t.n_tokens, before.n_tokens)
            assert torch.equal(t.logprobs, before.logprobs) and torch.equal(t.confidences, before.confidences)
            assert list(t.texts) == list(before.texts), "check() changed the trace"

    def test_signal_returns_one_float_per_row(self, pruner_factory):
        import torch

        pruner = self.make(pruner_factory)
        if not type(pruner).has_signal():
            pytest.skip("no signal(): the pruner records no signal")
        rows = self.rows()
        for t in list(grow(rows))[::7]:
            out = pruner.signal(t)
            assert isinstance(out, torch.Tensor) and out.dtype.is_floating_point
            assert out.shape == (len(rows),), f"signal() returned shape {tuple(out.shape)} for {len(rows)} rows"

    # ------------------------------------------------------------------ rows and history

    def test_rows_are_independent(self, pruner_factory):
        import torch

        pruner = self.make(pruner_factory)
        rows = self.rows()
        order = list(reversed(range(len(rows))))
        for t in grow(rows):
            together = pruner.check(t)
            counts = t.n_tokens.tolist()
            alone = torch.cat([pruner.check(trace([rows[i]], [counts[i]])) for i in range(len(rows))])
            assert together.tolist() == alone.tolist(), f"a row's verdict depends on the batch (counts {counts})"
            shuffled = pruner.check(trace([rows[i] for i in order], [counts[i] for i in order]))
            assert shuffled.tolist() == [together.tolist()[i] for i in order], "a verdict depends on the row order"

    def test_no_hidden_history(self, pruner_factory):
        seen = self.make(pruner_factory)
        rows = self.rows()
        for t in grow(rows):
            first = seen.check(t).tolist()
            assert seen.check(t).tolist() == first, "calling check() twice on one trace gave different verdicts"
            assert self.make(pruner_factory).check(t).tolist() == first, (
                "a fresh pruner and one that saw the earlier tokens disagree: rows leave the batch as they "
                "finish, so a pruner must decide from the trace alone")

    def test_min_tokens_is_respected(self, pruner_factory):
        pruner = self.make(pruner_factory)
        min_tokens = getattr(pruner.params, "min_tokens", None)
        if not min_tokens:
            pytest.skip("no min_tokens parameter")
        rows = self.rows()
        for t in grow(rows):
            flagged = pruner.check(t)
            early = t.n_tokens < min_tokens
            assert not (flagged & early).any(), f"flagged a row before min_tokens={min_tokens}"

    # ------------------------------------------------------------------ behaviour

    def test_healthy_candidates_are_never_stopped(self, pruner_factory):
        pruner = self.make(pruner_factory)
        rows = [Row.from_text(*scenario) for scenario in self.healthy_texts()]
        for t in grow(rows):
            assert not pruner.check(t).any(), f"stopped a coherent candidate at {t.n_tokens.tolist()} tokens"

    # ------------------------------------------------------------------ on engines

    def test_runs_with_signals_recorded(self, pruner_factory):
        """On a real engine (`hf`, a tiny random model) with `record_signals`: a pruner with
        `signal()` has one value per live token recorded; one without it (signal() is
        optional) runs all the same, records nothing, and a warning says so once."""
        import warnings

        from kvflow.testing.engine_parity import load_engine, pruned_greedy

        name = f"under-test-{next(_NAMES)}"  # the warning is said once per name and class
        pruner = self.make(pruner_factory)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            cands = pruned_greedy(load_engine("hf"), name, pruner)
            again = pruned_greedy(load_engine("hf"), name, self.make(pruner_factory))
        about = [w for w in said if name in str(w.message)]
        for c in itertools.chain(cands, again):
            live = c.n_tokens if c.pruned else c.n_tokens - 1
            assert len(c.signals["probe:confidences"]) == live, "the other pruners' signals were not recorded"
            if pruner.has_signal():
                assert len(c.signals.get(name, [])) == live, f"{name!r}: not one signal value per live token"
            else:
                assert name not in c.signals, "a pruner without signal() had a signal recorded"
        if pruner.has_signal():
            assert not about, f"warned about a pruner that has a signal(): {about[0].message}"
        else:
            assert len(about) == 1, f"a pruner without signal() should be warned about once, not {len(about)} times"

    @pytest.mark.parametrize("backend", _other_backends())
    def test_same_on_every_engine(self, pruner_factory, backend):
        """The pruner sees the same trace and records the same signal on `backend` as on `hf`
        (`kvflow.testing.engine_parity.assert_pruner_same_as_hf`)."""
        from kvflow.testing.engine_parity import assert_pruner_same_as_hf

        assert_pruner_same_as_hf(backend, f"under-test-{next(_NAMES)}", lambda: self.make(pruner_factory))

    def test_a_degenerate_candidate_is_stopped(self, pruner_factory):
        degenerate = self.degenerate_texts()
        if not degenerate:
            pytest.skip("degenerate_texts() is empty: this detector looks for something else")
        pruner = self.make(pruner_factory)
        rows = [Row.from_text(*scenario) for scenario in degenerate]
        assert any(bool(pruner.check(t).any()) for t in grow(rows)), (
            "no degenerate candidate was stopped with the default parameters; override degenerate_texts() "
            "with candidates this detector is meant to stop")
