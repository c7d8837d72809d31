"""`prm`: a process reward model scores each candidate step in context.

Every request is rendered as the whole trajectory (committed steps + the candidate, each
normalised by `_steps.steps_for`: whitespace and trailing delimiters stripped, empty steps
dropped) and read at each step's tag. Only tokens not seen before run (`prefix_reuse`, the
default): on `hf` each problem keeps the shared prefix of its last round's inputs (KV and the
head's outputs at every position) and a round runs the newly committed step once and each
candidate's own tokens (`kvflow.backends.hf.scoring.PrefixForward`); on `sglang` and `vllm` the
engine's prefix cache holds that prefix and the values at cached tags are kept per problem
(`kvflow.backends.served.position_values.PositionValues`). `prefix_reuse: false` (hf only) re-encodes
every input in batched forwards (right padding, chunks of at most `batch_tokens` padded tokens). The candidate's score is
`aggregate` (last | min | prod | mean) over its trajectory's step scores; a candidate that is
empty after normalisation adds no step, so it gets the trajectory's score without it (nan,
i.e. unscored, when there are no steps at all).

protocol `qwen25-math-prm` (Qwen/Qwen2.5-Math-PRM-7B, -72B):
    chat messages system "Please reason step by step, and put your final answer within
    \\boxed{}.", user = question, assistant = steps joined with `<extra_0>` plus a trailing
    `<extra_0>`; chat template applied without a generation prompt; the model is a Qwen2 body
    with a two-class token head; step score = softmax(head logits)[1] at each `<extra_0>`.
    On `hf` loaded by `kvflow.backends.hf.prm` (remote code only with `trust_remote_code:
    true`, otherwise kvflow's own rebuild); on `sglang` served by kvflow's
    `Qwen2ForProcessRewardModel` in SGLang's model registry (`kvflow.backends.sglang.in_worker.prm_model`),
    whose head's logits come back for every position the engine runs; on `vllm` by vLLM's own
    `Qwen2ForProcessRewardModel` on its pooling runner (every token's logits, no activation; the
    whole trajectory runs per request: vLLM's token pooling reads no prefix cache). A checkpoint
    without a PRM head is refused on all three. Literal
    `<extra_0>` inside the question or a step is removed so that tags match steps.

protocol `math-shepherd` (peiyi9979/math-shepherd-mistral-7b-prm and causal-LM PRMs like it):
    text = question + " " + the steps, each followed by the tag " ки", joined with "\\n";
    tokenized with the tokenizer's special tokens (BOS); step score = softmax over the LM
    logits of "+" and "-" at each tag position, P("+"). The label ids are the two tokens of
    "+ -" (the reference recipe), or else the last token of each label encoded alone. The
    tag position is the last token holding the tag's last character (character offsets of
    the encoding): with the Math-Shepherd tokenizer that is the single "ки" token; a tokenizer
    without that token (e.g. byte-level BPE) splits the tag into several tokens, and its last
    one is read — such a model has never seen the tag, so only use it for tests. On `sglang`
    the label log-probabilities come from the engine (`token_ids_logprob`), on `vllm` from a
    one-token request per tag reading the prefix cache (`logprob_token_ids`); the model may be
    a proposer's, sharing its engine.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from kvflow_builtin.scorers._steps import StepScorer, StepScorerParams, aggregate, steps_for

QWEN_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
QWEN_TAG = "<extra_0>"
SHEPHERD_TAG = " ки"
SHEPHERD_LABELS = ("+", "-")


class PRMParams(StepScorerParams):
    model: str = Field(..., description="Key of `models` holding the PRM checkpoint.")
    aggregate: Literal["last", "min", "prod", "mean"] = Field(
        "last", description="How the trajectory's step scores combine into the candidate's score.")
    protocol: Literal["qwen25-math-prm", "math-shepherd"] = Field(
        "qwen25-math-prm", description="How steps are tagged and read (see the module docstring).")
    batch_tokens: int = Field(16384, ge=1, description="Most tokens per hf forward: candidates' own tokens per "
                              "packed row with prefix_reuse, padded rows x width without.")
    prefix_reuse: bool = Field(
        True, description="Run only the tokens not seen before: each problem's shared prefix (its KV and the "
                          "head's outputs) is kept between rounds. Off: every trajectory is re-encoded (hf only).")


class QwenPRMFormat:
    """Qwen2.5-Math-PRM input: chat template, `<extra_0>` after every step."""

    def __init__(self, tokenizer) -> None:
        from kvflow.errors import UserError

        self.tokenizer = tokenizer
        self.tag_id = tokenizer.convert_tokens_to_ids(QWEN_TAG)
        if tokenizer(QWEN_TAG, add_special_tokens=False)["input_ids"] != [self.tag_id]:
            raise UserError(f"the PRM tokenizer has no single {QWEN_TAG} token",
                            hint="protocol qwen25-math-prm needs the Qwen2.5-Math-PRM tokenizer")

    def build(self, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        clean = lambda s: s.replace(QWEN_TAG, "")  # noqa: E731
        messages = [
            {"role": "system", "content": QWEN_SYSTEM},
            {"role": "user", "content": clean(question)},
            {"role": "assistant", "content": QWEN_TAG.join(clean(s) for s in steps) + QWEN_TAG},
        ]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        positions = [i for i, t in enumerate(ids) if t == self.tag_id]
        if len(positions) != len(steps):
            raise RuntimeError(f"found {len(positions)} {QWEN_TAG} tags for {len(steps)} steps")
        return ids, positions


class ShepherdFormat:
    """Math-Shepherd input: question, then every step followed by " ки", one per line."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        both = tokenizer(" ".join(SHEPHERD_LABELS), add_special_tokens=False)["input_ids"]
        if len(both) == 2:
            self.label_ids = list(both)
        else:
            self.label_ids = [tokenizer(x, add_special_tokens=False)["input_ids"][-1] for x in SHEPHERD_LABELS]

    def build(self, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        text, ends = question + " ", []
        for i, s in enumerate(steps):
            text += ("\n" if i else "") + s + SHEPHERD_TAG
            ends.append(len(text) - 1)  # the tag's last character
        enc = self.tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        positions = [max(j for j, (a, b) in enumerate(offsets) if a <= end < b) for end in ends]
        return ids, positions


class PRMScorer(StepScorer):
    """Process reward model score of the newest step (or an aggregate over the trajectory)."""

    Params = PRMParams
    #: hf: transformers (kvflow's PRM rebuild, or the causal LM's label logits); sglang: kvflow's
    #: PRM model class in SGLang (`kvflow.backends.sglang.in_worker.prm_model`), or label logprobs; vllm:
    #: vLLM's PRM class on its pooling runner, or label logprobs
    backends = ("hf", "sglang", "vllm")

    @classmethod
    def models_needed(cls, params):
        return [params.model]

    @staticmethod
    def check_backend(params, backend: str):
        """None, or (field under `scorer`, why, hint): what these params cannot do on `backend`."""
        return prefix_reuse_problem(params, backend)

    @classmethod
    def engine_settings(cls, params, backend: str) -> dict:
        """Engine settings the scorer's model needs on `backend` (merged under the entry's own):
        what the backend says per-position values of a PRM head, or of label tokens, need."""
        if not serves_values(backend):
            return {}
        return _backend(backend).position_value_settings(head=params.protocol == "qwen25-math-prm")

    def __init__(self, params, context) -> None:
        super().__init__(params, context)
        import torch

        model_cfg = (context.models or {}).get(params.model)
        backend = getattr(model_cfg, "backend", "hf")
        if serves_values(backend):
            _serving_reuses(params, backend)

            if params.protocol == "qwen25-math-prm":
                from kvflow.backends.hf.prm import check_prm_checkpoint

                check_prm_checkpoint(model_cfg)  # before the engine would serve a causal LM as one
            engine = context.load_session(params.model).engine
            if params.protocol == "qwen25-math-prm":
                self.format = QwenPRMFormat(engine.tokenizer)
                self.forward = engine.position_values(head=True)
                self._prob = lambda logits: torch.softmax(logits, dim=-1)[:, 1]
            else:
                self.format = ShepherdFormat(engine.tokenizer)
                self.forward = engine.position_values(labels=self.format.label_ids)
                self._prob = lambda logits: torch.softmax(logits, dim=-1)[:, 0]
            return
        from kvflow.backends.hf.scoring import head_forward, label_head

        if params.protocol == "qwen25-math-prm":
            from kvflow.backends.hf.prm import load_qwen_prm

            self.prm_model, tokenizer = load_qwen_prm(context.models[params.model])
            body, head = self.prm_model.model, self.prm_model.score
            self.format = QwenPRMFormat(tokenizer)
            self._prob = lambda logits: torch.softmax(logits, dim=-1)[:, 1]
        else:
            runner = context.load_session(params.model).runner
            tokenizer = runner.tokenizer
            self.format = ShepherdFormat(tokenizer)
            body, head = runner.body, label_head(runner.lm_head, self.format.label_ids)
            self._prob = lambda logits: torch.softmax(logits, dim=-1)[:, 0]
        self.forward = head_forward(body, head, reuse=params.prefix_reuse, pad_id=_pad_id(tokenizer),
                                    batch_tokens=params.batch_tokens)

    def step_scores(self, questions: list[str], steps: list[list[str]],
                    keys: list[str] | None = None) -> list[list[float]]:
        """P(correct) of every step of every trajectory, one batched pass (keys: each
        trajectory's problem, whose cached prefix it may reuse)."""
        keys = keys or [f"#{i}" for i in range(len(steps))]
        todo = [i for i, s in enumerate(steps) if s]
        built = [self.format.build(questions[i], steps[i]) for i in todo]
        logits = self.forward([keys[i] for i in todo], [b[0] for b in built], [b[1] for b in built]) if built else []
        out: list[list[float]] = [[] for _ in steps]
        for i, lg in zip(todo, logits):
            out[i] = self._prob(lg).tolist()
        return out

    def score(self, requests):
        if not requests:
            return []
        delim = self.context.delimiter
        steps = [steps_for(r.trajectory, r.candidate, delim)[0] for r in requests]
        scores = self.step_scores([r.trajectory.question for r in requests], steps,
                                  [r.trajectory.problem_id for r in requests])
        return [aggregate(s, self.params.aggregate) if s else math.nan for s in scores]

    def release(self, problem_ids):
        release = getattr(self.forward, "release", None)
        if release is not None:
            release(problem_ids)


def _backend(name: str):
    from kvflow.backends.base import backend_named

    return backend_named(name)


def serves_values(backend: str) -> bool:
    """Does `backend`'s engine serve the scorers' per-position values (`engine.position_values`),
    its prefix cache holding each problem's committed prefix? (else: kvflow's transformers path)"""
    return _backend(backend).serves_position_values


def prefix_reuse_problem(params, backend: str):
    """None, or (field under `scorer`, why, hint) when these params cannot run on `backend`:
    `prefix_reuse: false` is hf's re-encoding; a serving engine's prefix cache always serves the prefix."""
    if serves_values(backend) and not params.prefix_reuse:
        return ("prefix_reuse", f"prefix_reuse: false re-encodes every input on backend 'hf' only; on {backend!r} "
                                f"(models.{params.model}.backend) the engine's prefix cache always serves the "
                                "committed prefix",
                f"drop scorer.prefix_reuse, or put models.{params.model} on backend 'hf'")
    return None


def _serving_reuses(params, backend: str) -> None:
    """The same refusal at run time (a scorer built outside `kvflow run`)."""
    from kvflow.errors import UserError

    why = prefix_reuse_problem(params, backend)
    if why:
        raise UserError(f"scorer.{why[0]}: {why[1]}", hint=why[2])


def _pad_id(tokenizer) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0
