"""`llm_judge`: an instruct model is asked whether the newest step is correct (METHODS.md §10).

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
All requests of a round run in one batched forward (right padding, chunks of at most
`batch_tokens` padded tokens). The judge rates the newest step only (there is no `aggregate`).
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
    batch_tokens: int = Field(16384, ge=1, description="Most padded tokens per judge forward.")


def judge_messages(question: str, previous: list[str], step: str) -> list[dict]:
    """The judge conversation for one candidate (see the module docstring)."""
    user = USER.format(question=question, previous="\n\n".join(previous) or NO_STEPS, step=step or ENDS)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


class LLMJudgeScorer(StepScorer):
    """P(Yes) over {Yes, No} when an instruct model is asked whether the newest step is correct."""

    Params = JudgeParams

    #: the judge reads two label logits through transformers (PositionForward)
    backends = ("hf",)

    @classmethod
    def models_needed(cls, params):
        return [params.model]

    def __init__(self, params, context) -> None:
        super().__init__(params, context)
        import torch

        from kvflow.backends.hf.scoring import PositionForward
        from kvflow.errors import UserError

        runner = context.load_session(params.model).runner
        self.tokenizer = runner.tokenizer
        self.answer_ids = [self.tokenizer(a, add_special_tokens=False)["input_ids"][0] for a in ANSWERS]
        if self.answer_ids[0] == self.answer_ids[1]:
            raise UserError(f"llm_judge: 'Yes' and 'No' start with the same token for models.{params.model}")
        labels = torch.as_tensor(self.answer_ids, device=runner.device)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.forward = PositionForward(runner.body, lambda h: runner.lm_head(h)[:, labels], pad_id=pad,
                                       batch_tokens=params.batch_tokens)

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
        logits = self.forward(ids, [[len(x) - 1] for x in ids])
        return [float(torch.softmax(lg[0], dim=-1)[0]) for lg in logits]
