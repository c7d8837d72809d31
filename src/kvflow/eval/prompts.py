"""Prompt templates (METHODS.md §11) and rendering through a tokenizer's chat template.

`render_prompt` returns the exact text fed to the model. With a chat template it is
`tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`.
Without one (base models, tokenizer=None) the documented plain format is::

    {system}

    Question: {question}
    Answer:

(the system paragraph is left out when the template has none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from kvflow.eval._names import unknown_name


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    system: Optional[str]
    user: str = "{question}"  # str.format template; `question` is the only field
    description: str = ""

    def messages(self, question: str) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": self.user.format(question=question)}]


_TEMPLATES: dict[str, PromptTemplate] = {
    t.name: t
    for t in (
        PromptTemplate(
            name="qwen25-math-cot",
            system="Please reason step by step, and put your final answer within \\boxed{}.",
            description="Qwen2.5-Math chain-of-thought prompt (the reference evaluation's `qwen25-math-cot`).",
        ),
    )
}
PROMPTS: tuple[str, ...] = tuple(_TEMPLATES)


def get_prompt(name: str) -> PromptTemplate:
    try:
        return _TEMPLATES[name]
    except KeyError:
        raise unknown_name("prompt", name, PROMPTS) from None


def plain_prompt(template: PromptTemplate, question: str) -> str:
    """The fallback format used when no chat template is available (see module docstring)."""
    head = f"{template.system}\n\n" if template.system else ""
    return f"{head}Question: {template.user.format(question=question)}\nAnswer:"


def render_prompt(name: str, question: str, tokenizer: Any = None) -> str:
    """The prompt text for `question` under template `name` for this tokenizer."""
    template = get_prompt(name)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return plain_prompt(template, question)
    msgs = template.messages(question)
    try:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    except Exception as first:
        # Some chat templates (e.g. Gemma's) reject a system role; those models are meant to
        # get the instruction at the top of the user turn. Anything else re-raises.
        if msgs[0]["role"] != "system":
            raise
        merged = [{"role": "user", "content": f"{msgs[0]['content']}\n\n{msgs[1]['content']}"}]
        try:
            return tokenizer.apply_chat_template(merged, tokenize=False, add_generation_prompt=True)
        except Exception:
            raise first from None
