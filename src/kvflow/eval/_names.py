"""Shared "unknown name" error for the dataset and prompt registries."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def unknown_name(kind: str, name: str, choices: Iterable[str]) -> ValueError:
    """A ValueError naming the valid choices, with a did-you-mean when one is close."""
    choices = sorted(choices)
    msg = f"unknown {kind} {name!r}"
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    # Case/underscore slips (e.g. "GSM8K", "math_500") are the usual typo; try those too.
    if not close:
        folded = {c.lower().replace("_", "").replace("-", ""): c for c in choices}
        hit = folded.get(name.lower().replace("_", "").replace("-", ""))
        close = [hit] if hit else []
    if close:
        msg += f"; did you mean {close[0]!r}?"
    return ValueError(f"{msg} (choices: {', '.join(choices)})")
