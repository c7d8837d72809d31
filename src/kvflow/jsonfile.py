"""Strict JSON for every file kvflow writes, and a tolerant reader for files written before.

Python's `json` writes `NaN`, `Infinity` and `-Infinity` for non-finite floats by default;
that is not JSON (RFC 8259): a browser's `JSON.parse`, `jq` and most JSON tools refuse the
file. kvflow records non-finite numbers in a few places (a pruner's signal before its window
has warmed up is NaN; a scorer may give NaN or -inf), so everything kvflow writes goes
through `dumps()`, which writes each non-finite float as `null`: in kvflow's files `null`
in a number's place means "no value" (not yet defined, not scored, not finite).

Results written by earlier kvflow versions may hold `NaN`; `loads()` reads them and turns
every non-finite constant into `None`, so a reader sees the same value whether the file is
old or new. `loads_strict()` refuses them (what a browser does), for checks.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["dumps", "finite", "loads", "loads_strict", "NonStrictJSON"]


class NonStrictJSON(ValueError):
    """A JSON text holds NaN or an infinity (not JSON; `loads_strict` refuses it)."""


def finite(value: Any) -> Any:
    """`value` with every non-finite float (NaN, ±inf), at any depth, replaced by None.
    Containers are copied only where something changes (a record's long signal lists usually
    do, its strings never)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """`json.dumps` that writes strict JSON: non-finite floats become `null` (`finite()`),
    and anything else that would not be JSON raises instead of being written."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def _to_none(name: str) -> None:  # NaN, Infinity, -Infinity: "no value", as kvflow now writes them
    return None


def loads(text: str | bytes) -> Any:
    """Parse JSON; `NaN`/`Infinity`/`-Infinity` (written by kvflow before strict JSON) read as None."""
    return json.loads(text, parse_constant=_to_none)


def _refuse(name: str) -> None:
    raise NonStrictJSON(f"{name} is not JSON (strict JSON writes null for a missing number)")


def loads_strict(text: str | bytes) -> Any:
    """Parse JSON as a browser does: NaN and infinities are an error (`NonStrictJSON`)."""
    return json.loads(text, parse_constant=_refuse)
