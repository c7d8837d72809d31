"""Final-answer extraction from a model's output (METHODS.md §11).

Order: the last complete `\\boxed{...}` / `\\fbox{...}` (nested and escaped braces
handled), else the text after the last "the answer is", else the last number.
"""

from __future__ import annotations

import re
from typing import Optional

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_IS = re.compile(r"the\s+(?:final\s+)?answer\s+is\b\s*:?", re.IGNORECASE)
# Thousands groups first so "1,000" stays one number; commas are dropped afterwards.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


def _braced(text: str, start: int) -> Optional[str]:
    """Content of the {...} group opening at text[start], or None if it never closes."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == "\\":  # `\{` and `\}` are literal braces in LaTeX, not grouping
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def last_boxed(text: str) -> Optional[str]:
    """Content of the last complete \\boxed / \\fbox in `text`."""
    for m in reversed(list(_BOX.finditer(text))):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            content = _braced(text, i)
            # An unclosed box (truncated output) or an empty one (the prompt's `\boxed{}`
            # echoed) is skipped in favour of an earlier box.
            if content is not None and content.strip():
                return content
        else:  # `\boxed 5`: TeX takes the next token
            token = re.match(r"[^\s$]+", text[i:])
            if token:
                return token.group(0)
    return None


def _after_answer_is(text: str) -> Optional[str]:
    matches = list(_ANSWER_IS.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :].strip().split("\n", 1)[0]
    rest = re.split(r"\.\s", rest, maxsplit=1)[0]  # end of the sentence, not a decimal point
    return rest.replace("**", "").strip()


def _clean(ans: str) -> str:
    ans = ans.strip()
    while ans.startswith("$") or ans.endswith("$") or ans.endswith("."):
        ans = ans.strip("$").rstrip(".").strip()
    return ans


def extract_answer(text: Optional[str]) -> Optional[str]:
    """The model's final answer in `text`, or None when there is none."""
    if not text:
        return None
    for ans in (last_boxed(text), _after_answer_is(text)):
        if ans is not None and _clean(ans):
            return _clean(ans)
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None
