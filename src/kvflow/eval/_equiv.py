"""The in-process steps of answer equivalence (METHODS.md §11): normalised string match and
numeric match, applied to whole answers and, for tuples, intervals, sets and lists of
answers, element by element. `fast_equiv` settles most pairs without math-verify.
"""

from __future__ import annotations

import re
from typing import Optional

from kvflow.eval._normalize import Normalized, is_plain_number, normalize, numbers_equal, strip_assignment

_WORD = re.compile(r"[A-Za-z][A-Za-z ]+")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def _wrapped(s: str) -> Optional[tuple[str, str, str]]:
    """(open, inner, close) when one bracket pair encloses all of `s`: (..), [..], (..], \\{..\\}."""
    if s.startswith("\\{"):
        open_ = "\\{"
    elif s[:1] in ("(", "["):
        open_ = s[0]
    else:
        return None
    depth = 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                break
    if i != len(s) - 1:
        return None
    close = "\\}" if s.endswith("\\}") else s[-1]
    if (open_ == "\\{") != (close == "\\}"):
        return None
    return open_, s[len(open_) : len(s) - len(close)], close


def _split(s: str) -> list[str]:
    """Split at commas outside any brackets."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    return parts + [s[start:]]


def _match_unordered(xs: list[str], ys: list[str], percent: bool) -> bool:
    left = list(ys)
    for x in xs:
        hit = next((j for j, y in enumerate(left) if _part_same(x, y, percent)), None)
        if hit is None:
            return False
        left.pop(hit)
    return True


def _part_same(x: str, y: str, percent: bool) -> bool:
    return _same(Normalized(strip_assignment(x), percent), Normalized(strip_assignment(y), percent))


def _same_structure(a: str, b: str, percent: bool) -> bool:
    """Tuples/intervals elementwise in order (brackets must agree), sets and bare
    comma lists ("multiple answers") in any order."""
    wa, wb = _wrapped(a), _wrapped(b)
    if wa and wb:
        if wa[0] != wb[0] or wa[2] != wb[2]:
            return False
        xs, ys = _split(wa[1]), _split(wb[1])
        if len(xs) != len(ys):
            return False
        if wa[0] == "\\{":
            return _match_unordered(xs, ys, percent)
        return all(_part_same(x, y, percent) for x, y in zip(xs, ys))
    if wa or wb:
        return False
    xs, ys = _split(a), _split(b)
    # "1,000" is a number, not the two answers 1 and 000.
    if len(xs) < 2 or len(xs) != len(ys) or _THOUSANDS.fullmatch(a) or _THOUSANDS.fullmatch(b):
        return False
    return _match_unordered(xs, ys, percent)


def _same(p: Normalized, g: Normalized) -> bool:
    if p.text == g.text:
        return True
    if _WORD.fullmatch(p.text) and p.text.lower() == g.text.lower():  # "Yes" vs "yes"
        return True
    if numbers_equal(p, g):
        return True
    return _same_structure(p.text, g.text, p.percent or g.percent)


def fast_equiv(pred: Optional[str], gold: Optional[str]) -> Optional[bool]:
    """The in-process steps: True/False when settled here, None when math-verify must decide.

    False is only returned for a missing/empty prediction or two plain numbers that differ,
    where math-verify could not disagree.
    """
    if pred is None or gold is None:
        return False
    p, g = normalize(pred), normalize(gold)
    if not p.text:
        return False
    if _same(p, g):
        return True
    if is_plain_number(p.text) and is_plain_number(g.text):
        return False
    return None
