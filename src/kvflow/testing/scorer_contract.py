"""The contract every scorer must pass, as a pytest suite.

Built-ins and third-party scorers run the same tests. In a plugin's test suite:

    import pytest
    from kvflow.testing.scorer_contract import ScorerContract
    from my_plugin import MyScorer

    class TestMyScorer(ScorerContract):
        contract_params = {"model": "tiny"}  # if it scores with a model: `models.tiny` is provided

        @pytest.fixture(scope="class")
        @classmethod
        def scorer_factory(cls):
            return lambda context, **params: MyScorer(MyScorer.Params(**params), context)

The factory is a class-scoped fixture written as a `@classmethod` under `@pytest.fixture`,
the form pytest 9 and 10 accept (pytest 9 deprecates class-scoped fixtures that are instance
methods; pytest 10 removes them); a parametrized factory takes `request` after `cls`.

The suite builds the `ScorerContext` the runtime would: proposers `base` and `helper`, seed 0,
delimiter "\\n\\n", `load_session("tiny")` giving a full-KV scoring session on a tiny
random-weight Qwen2 (its `.runner` is a `kvflow.backends.hf.engine.HFRunner`), and `models`
with `tiny` pointing at that model saved as a transformers directory. With
`contract_backend = "sglang"` the tiny model is served by SGLang instead (`models.tiny.backend:
sglang`; the session is SGLang's, its `.engine` the `SGLangEngine`): a scorer that declares
`backends = ("hf", "sglang")` runs the suite once per backend. What is checked:

- `score()` returns one float per request (a list), finite for every non-empty candidate,
  and `[]` for no requests;
- deterministic: the same scorer twice and a fresh scorer agree;
- batching and order: every request scored alone, or all in reverse order, gets the same
  score as in the batch (up to float noise of padded batches);
- state: after a step is committed to a trajectory, scoring its next candidates gives what a
  fresh scorer gives; `release()` of finished (or unknown) problems keeps scores the same;
- identity: a candidate's problem is its request's trajectory (`problem_id`), not
  `Candidate.problem`, which engines leave 0: the scores do not change when every candidate
  says problem 0 (two problems at the same depth included);
- requests are not changed; `can_score()` answers a bool for each proposer,
  `models_needed()` names only keys of `models`, and every model the scorer loads through
  `context.load_session` is one it declares there;
- the checks of `kvflow.testing.component_contract` (frozen, described Params; docstrings).
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Callable, ClassVar

import pytest

from kvflow.components.base import ScorerParams
from kvflow.testing.component_contract import ComponentContract
from kvflow.testing.engine_parity import REFERENCE

MODEL_KEY = "tiny"
PROPOSERS = ["base", "helper"]
QUESTION = "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?"
STEPS = ["In May she sold 48 / 2 = 24 clips.\n\n", "Altogether she sold 48 + 24 = 72 clips.\n\n"]
CANDIDATES = [  # (problem, source, index, text, finish)
    ("p0", "base", 0, "The answer is \\boxed{72}.", "eos"),
    ("p0", "base", 1, "She sold 1 clip.\n\n", "delimiter"),
    ("p0", "helper", 0, "So 48 + 24 = 72.\n\n", "delimiter"),
    ("p1", "base", 0, "First, 48 / 2 = 24.\n\n", "delimiter"),
    ("p1", "helper", 0, "In May: 24 clips.\n\n", "delimiter"),
    ("p2", "helper", 1, "\n\n", "delimiter"),  # empty once normalised
]
ABS_TOL = 1e-4


@functools.lru_cache(maxsize=None)
def _runner():
    from kvflow.testing.models import tiny_runner

    return tiny_runner("qwen2", seed=4)


def _trajectories() -> dict:
    from kvflow.components.base import Step, Trajectory
    from kvflow.testing.models import tiny_tokenizer

    prompt = tiny_tokenizer().apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                                  add_generation_prompt=True)
    steps = {"p0": STEPS, "p1": [], "p2": STEPS[:1]}
    return {pid: Trajectory(pid, QUESTION, prompt, steps=[Step(s, "base", None, 8) for s in ss])
            for pid, ss in steps.items()}


def requests(trajectories=None) -> list:
    """The contract's score requests: three problems at different depths, both proposers."""
    from kvflow.components.base import Candidate, ScoreRequest
    from kvflow.testing.models import tiny_tokenizer

    tok = tiny_tokenizer()
    trajectories = trajectories or _trajectories()
    out = []
    for pid, source, index, text, finish in CANDIDATES:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        logprobs = [-0.05 * (1 + (i * 7 + len(text)) % 11) for i in range(len(ids))]
        cand = Candidate(problem=int(pid[1:]), source=source, index=index, text=text, token_ids=ids,
                         logprobs=logprobs, entropies=[0.5] * len(ids), finish=finish)
        out.append(ScoreRequest(trajectories[pid], cand))
    return out


def _is_empty(request) -> bool:
    return not request.candidate.text.strip()


class ScorerContract(ComponentContract):
    """Subclass and override the `scorer_factory` fixture (see the module docstring)."""

    #: parameters every test passes to the factory (`model: tiny` for a scorer that needs one)
    contract_params: ClassVar[dict] = {}
    #: the backend `models.tiny` is served by: "hf", or another registered backend ("sglang",
    #: "vllm": one engine on the backend's contract model, `engine_parity.backend_model_dir`;
    #: skipped where the backend cannot run here). Run the suite once per backend the scorer
    #: declares (`Scorer.backends`).
    contract_backend: ClassVar[str] = "hf"
    params_base = ScorerParams

    @pytest.fixture(scope="class")
    @classmethod
    def scorer_factory(cls) -> Callable[..., Any]:
        """Return a callable `factory(context, **params) -> Scorer`."""
        raise NotImplementedError("override the scorer_factory fixture")

    @pytest.fixture(scope="class")
    @classmethod
    def scorer_context(cls, tmp_path_factory):
        """A `ScorerContext` factory: each call gives a fresh context (fresh scoring sessions)."""
        from kvflow.backends.hf.scoring import ScoringSession
        from kvflow.components.base import ScorerContext
        from kvflow.config.schema import ModelConfig
        from kvflow.registry import get_registry

        if cls.contract_backend != REFERENCE:
            from kvflow.backends.base import backend_named
            from kvflow.testing.engine_parity import backend_model_dir

            # the tiny model kvflow's engine tests share for that backend (one engine per process)
            backend = cls.contract_backend
            loader = backend_named(backend)
            cfg = ModelConfig(backend=backend, id=str(backend_model_dir(backend)), dtype="float32", device="cpu")
            why = loader.check(cfg)
            if why:
                pytest.skip(f"backend {backend!r} cannot run here: {why[1] if isinstance(why, tuple) else why}")
            models = {MODEL_KEY: cfg}
            def load_session(key: str):
                assert key == MODEL_KEY, f"the contract provides only models.{MODEL_KEY}, not models.{key}"
                return loader.load(cfg, evicting=False).scoring_session()

            return lambda: ScorerContext(load_session=load_session, proposers=list(PROPOSERS), seed=0,
                                         delimiter="\n\n", models=models)
        directory = tmp_path_factory.mktemp("tiny-scorer-model")
        _runner().model.save_pretrained(directory)
        _runner().tokenizer.save_pretrained(directory)
        models = {MODEL_KEY: ModelConfig(id=str(directory), dtype="float32", device="cpu")}
        full_kv = get_registry().get("evictors", "none")

        def load_session(key: str):
            assert key == MODEL_KEY, f"the contract provides only models.{MODEL_KEY}, not models.{key}"
            return ScoringSession(_runner(), full_kv(full_kv.Params()))

        return lambda: ScorerContext(load_session=load_session, proposers=list(PROPOSERS), seed=0,
                                     delimiter="\n\n", models=models)

    @pytest.fixture
    def contract_component(self, scorer_factory, scorer_context):
        return self.make(scorer_factory, scorer_context)

    def make(self, factory, context_factory):
        return factory(context_factory(), **self.contract_params)

    @staticmethod
    def scores(scorer, reqs) -> list[float]:
        out = scorer.score(reqs)
        assert isinstance(out, list), f"score() must return a list, got {type(out).__name__}"
        assert len(out) == len(reqs), f"score() returned {len(out)} scores for {len(reqs)} requests"
        for s in out:
            assert isinstance(s, (int, float)) and not isinstance(s, bool), f"score {s!r} is not a float"
        return [float(s) for s in out]

    @staticmethod
    def assert_close(got, want, what: str) -> None:
        for i, (g, w) in enumerate(zip(got, want)):
            same = (math.isnan(g) and math.isnan(w)) or g == w or abs(g - w) <= ABS_TOL
            assert same, f"{what}: request {i} scored {g} vs {w}"

    # ------------------------------------------------------------------ tests

    def test_one_float_per_request(self, scorer_factory, scorer_context):
        scorer = self.make(scorer_factory, scorer_context)
        assert self.scores(scorer, []) == []
        reqs = requests()
        for r, s in zip(reqs, self.scores(scorer, reqs)):
            if not _is_empty(r):
                assert math.isfinite(s), f"non-finite score {s} for candidate {r.candidate.text!r}"

    def test_deterministic(self, scorer_factory, scorer_context):
        scorer = self.make(scorer_factory, scorer_context)
        first = self.scores(scorer, requests())
        self.assert_close(self.scores(scorer, requests()), first, "the same scorer, twice")
        self.assert_close(self.scores(self.make(scorer_factory, scorer_context), requests()), first, "a fresh scorer")

    def test_batch_and_order_do_not_matter(self, scorer_factory, scorer_context):
        batch = self.scores(self.make(scorer_factory, scorer_context), requests())
        alone = [self.scores(self.make(scorer_factory, scorer_context), [r])[0] for r in requests()]
        self.assert_close(alone, batch, "alone vs in a batch")
        backwards = self.scores(self.make(scorer_factory, scorer_context), requests()[::-1])
        self.assert_close(backwards[::-1], batch, "reversed order")

    def test_requests_are_not_changed(self, scorer_factory, scorer_context):
        reqs = requests()
        before = copy.deepcopy(reqs)
        self.scores(self.make(scorer_factory, scorer_context), reqs)
        assert reqs == before, "score() changed its requests (trajectories or candidates)"

    def test_state_follows_the_trajectory(self, scorer_factory, scorer_context):
        from kvflow.components.base import Step

        scorer = self.make(scorer_factory, scorer_context)
        trajs = _trajectories()
        self.scores(scorer, requests(trajs))
        trajs["p1"].steps.append(Step("First, 48 / 2 = 24.\n\n", "base", None, 8))  # a step is committed
        scorer.release(["p2", "no-such-problem"])  # p2 finished
        grown = {k: v for k, v in trajs.items() if k != "p2"}
        reqs = [r for r in requests(trajs) if r.trajectory.problem_id in grown]
        fresh = self.make(scorer_factory, scorer_context)
        self.assert_close(self.scores(scorer, reqs), self.scores(fresh, reqs), "after a commit and a release")

    def test_candidate_problem_is_not_an_identity(self, scorer_factory, scorer_context):
        """Engines leave `Candidate.problem` 0 (kvflow.components.engine): a scorer must know a
        candidate's problem from `ScoreRequest.trajectory`. Here two problems stand at the same
        depth with different steps."""
        from kvflow.components.base import Step

        trajs = _trajectories()
        trajs["p1"].steps.append(Step(STEPS[1], "base", None, 8))  # p1 and p2: one step each, different ones
        numbered = self.scores(self.make(scorer_factory, scorer_context), requests(trajs))
        zeroed = requests(trajs)
        for r in zeroed:
            r.candidate.problem = 0  # what an engine hands over
        self.assert_close(self.scores(self.make(scorer_factory, scorer_context), zeroed), numbered,
                          "with Candidate.problem 0 for every candidate (as engines leave it) vs numbered: a "
                          "candidate's problem is ScoreRequest.trajectory.problem_id")

    def test_can_score_and_models_needed(self, scorer_factory, scorer_context):
        context, loaded = scorer_context(), []
        load = context.load_session
        context.load_session = lambda key: (loaded.append(key), load(key))[1]
        scorer = scorer_factory(context, **self.contract_params)
        for p in PROPOSERS:
            assert isinstance(scorer.can_score(p), bool), "can_score() must return a bool"
        needed = type(scorer).models_needed(scorer.params)
        assert isinstance(needed, list) and all(isinstance(k, str) for k in needed)
        assert set(needed) <= {MODEL_KEY}, f"models_needed() names {needed}; the pipeline only has {MODEL_KEY}"
        self.scores(scorer, requests())
        assert set(loaded) <= set(needed), (
            f"the scorer loaded models.{sorted(set(loaded) - set(needed))} through context.load_session but "
            f"models_needed() names {needed}: kvflow checks and loads only the models a scorer declares")
