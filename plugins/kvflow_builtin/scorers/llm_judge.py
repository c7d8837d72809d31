"""`llm_judge`: an instruct model is asked whether the newest step is correct.

A generative verifier for when no trained PRM is available. For each candidate the judge
model (`models.<model>`, loaded like a proposer's model, so a proposer's model can judge
without a second copy) gets this conversation, rendered with its own chat template and a
generation prompt:

    system: "You are a careful math teacher. You check a student's solution one step at a time."
    user:   "Problem:\\n{question}\\n\\n"
            "Solution so far:\\n{previous}\\n\\n"
            "New step:\\n{step}\\n\\n"
            "Is the new step correct? Answer Yes or No."

`previous` is the committed steps (normalised: whitespace and trailing delimiters stripped,
empty steps dropped) joined with a blank line, or "(no steps yet)"; `step` is the normalised
candidate, or "(the solution ends here)" when it is empty (e.g. an EOS step). The score is
P("Yes") / (P("Yes") + P("No")) from the logits at the answer position (the first token the
judge would generate), where "Yes" and "No" are the first tokens of those words encoded alone.
The judge rates the newest step only (there is no `aggregate`).

Runs on `hf`, `sglang` and `vllm`. With `prefix_reuse` (the default) only new tokens run: on `hf`
each problem keeps its prompts' shared prefix cached between rounds (`PrefixForward`), on
`sglang` and `vllm` the engine's prefix cache holds it and the label log-probabilities at the
answer slot come back with the request (`PositionValues`). Without it (`hf` only), every prompt is re-encoded in
batched forwards (right padding, chunks of at most `batch_tokens` padded tokens).
"""

from __future__ import annotations

from pydantic import Field

from kvflow_builtin.scorers._steps import StepScorer, StepScorerParams, normalise_step

SYSTEM = "You are a careful math teacher. You check a student's solution one step at a time."
USER = ("Problem:\n{question}\n\n"
        "Solution so far:\n{previous}\n\n"
        "New step:\n{step}\n\n"
        "Is the new step correct? Answer Yes or No.")
NO_STEPS = "(no steps yet)"
ENDS = "(the solution ends here)"
ANSWERS = ("Yes", "No")


class JudgeParams(StepScorerParams):
    model: str = Field(..., description="Key of `models` holding the judge (an instruct model).")
    batch_tokens: int = Field(16384, ge=1, description="Most tokens per hf forward: candidates' own tokens per "
                              "packed row with prefix_reuse, padded rows x width without.")
    prefix_reuse: bool = Field(
        True, description="Run only the tokens not seen before (each problem's shared prompt prefix is kept "
                          "between rounds). Off: every prompt is re-encoded (hf only).")


def judge_messages(question: str, previous: list[str], step: str) -> list[dict]:
    """The judge conversation for one candidate (see the module docstring)."""
    user = USER.format(question=question, previous="\n\n".join(previous) or NO_STEPS, step=step or ENDS)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


class LLMJudgeScorer(StepScorer):
    """P(Yes) over {Yes, No} when an instruct model is asked whether the newest step is correct."""

    Params = JudgeParams

    #: hf: two label logits through transformers; sglang, vllm: their log-probabilities from the engine
    backends = ("hf", "sglang", "vllm")

    @staticmethod
    def check_backend(params, backend: str):
        from kvflow_builtin.scorers.prm import prefix_reuse_problem

        return prefix_reuse_problem(params, backend)

    @classmethod
    def models_needed(cls, params):
        return [params.model]

    def __init__(self, params, context) -> None:
        super().__init__(params, context)
        from kvflow.errors import UserError

        from kvflow_builtin.scorers.prm import _serving_reuses, serves_values

        session = context.load_session(params.model)
        backend = getattr(getattr(session, "engine", None), "backend", "hf")
        on_engine = serves_values(backend)  # the engine answers label log-probabilities, its cache serves the prefix
        self.tokenizer = session.engine.tokenizer if on_engine else session.runner.tokenizer
        self.answer_ids = [self.tokenizer(a, add_special_tokens=False)["input_ids"][0] for a in ANSWERS]
        if self.answer_ids[0] == self.answer_ids[1]:
            raise UserError(f"llm_judge: 'Yes' and 'No' start with the same token for models.{params.model}")
        if on_engine:
            _serving_reuses(params, backend)
            self.forward = session.engine.position_values(labels=self.answer_ids)
            return
        from kvflow.backends.hf.scoring import head_forward, label_head

        runner = session.runner
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.forward = head_forward(runner.body, label_head(runner.lm_head, self.answer_ids),
                                    reuse=params.prefix_reuse, pad_id=pad, batch_tokens=params.batch_tokens)

    def prompt_ids(self, request) -> list[int]:
        delim = self.context.delimiter
        previous = [s for s in (normalise_step(x.text, delim) for x in request.trajectory.steps) if s]
        messages = judge_messages(request.trajectory.question, previous, normalise_step(request.candidate.text, delim))
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def score(self, requests):
        if not requests:
            return []
        import torch

        ids = [self.prompt_ids(r) for r in requests]
        logits = self.forward([r.trajectory.problem_id for r in requests], ids, [[len(x) - 1] for x in ids])
        return [float(torch.softmax(lg[0], dim=-1)[0]) for lg in logits]

    def release(self, problem_ids):
        release = getattr(self.forward, "release", None)
        if release is not None:
            release(problem_ids)
