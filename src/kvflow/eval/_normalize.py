"""Answer normalisation and number reading for grading's in-process checks (METHODS.md §11).

Everything here is conservative: two answers that normalise to the same text, or read as
the same number, are equal; anything else is left to math-verify.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple, Optional

_LONG_UNITS = [
    "square units", "sq units", "square feet", "square inches", "square meters", "square centimeters",
    "square miles", "square yards", "cubic feet", "cubic inches", "cubic meters", "cubic centimeters",
    "cubic units", "dollars", "dollar", "cents", "cent", "units", "unit", "degrees", "degree",
    "radians", "radian", "centimeters", "centimeter", "centimetres", "millimeters", "millimeter",
    "kilometers", "kilometer", "kilometres", "meters", "meter", "metres", "inches", "inch", "feet",
    "foot", "yards", "yard", "miles", "mile", "hours", "hour", "hrs", "minutes", "minute", "mins",
    "min", "seconds", "second", "secs", "sec", "days", "day", "weeks", "week", "months", "month",
    "years", "year", "kilograms", "kilogram", "kg", "grams", "gram", "pounds", "pound", "lbs", "lb",
    "ounces", "ounce", "oz", "liters", "liter", "litres", "ml", "gallons", "gallon", "mph", "km/h",
    "kmh", "m/s", "cm", "mm", "km", "ft",
]
# One-letter units ("m", "s", "g") and "in" look like variables or words; they only go when
# spelt out after a number and a space, or inside \text{}.
_SHORT_UNITS = ["m", "s", "g", "l", "in"]


def _alt(words: list[str]) -> str:
    return "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))


_POWER = r"(?:\^\{?[23]\}?)?"
_TEXT_UNIT = re.compile(
    r"\\(?:text|mbox|mathrm|textrm|textnormal|rm)\s*\{\s*(?:" + _alt(_LONG_UNITS + _SHORT_UNITS) + r")\s*"
    + _POWER + r"\}" + _POWER
)
_BARE_LONG_UNIT = re.compile(r"(?<=[\d}])\s*(?:" + _alt(_LONG_UNITS) + r")" + _POWER + r"\s*$")
_BARE_SHORT_UNIT = re.compile(r"(?<=\d)\s+(?:" + _alt(_SHORT_UNITS) + r")" + _POWER + r"\s*$")
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|textrm|textnormal)\s*\{([^{}]*)\}")
_ASSIGN = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?(?:=|\\in(?![A-Za-z]))")

_REPLACE = [
    ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\displaystyle", ""),
    ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""), ("\\ ", ""), ("~", ""),
    ("\\$", ""), ("$", ""),
]
# A bare \circ is left alone: it is also function composition.
_DEGREES = ["^{\\circ}", "^\\circ", "°", "\\degree"]

_INT = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)")
_DECIMAL = re.compile(r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_FRAC = re.compile(r"([+-]?)\\frac\{([+-]?[\d.]+)\}\{([+-]?[\d.]+)\}")
_SLASH = re.compile(r"([+-]?[\d.]+)/([+-]?[\d.]+)")


class Normalized(NamedTuple):
    text: str
    percent: bool  # a % sign was dropped: the value may also be read as text/100


def _fix_shorthand(s: str) -> str:
    # \frac12 -> \frac{1}{2}, \frac1{2} -> \frac{1}{2}, \frac{1}2 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac(\{[^{}]*\})(\d)", r"\\frac\1{\2}", s)
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def strip_assignment(s: str) -> str:
    """'x=3' -> '3', 'x\\in[1,2]' -> '[1,2]'; kept when the right side has another '='."""
    m = _ASSIGN.match(s)
    return s[m.end():] if m and "=" not in s[m.end():] else s


def normalize(answer: str) -> Normalized:
    s = answer.strip()
    for old, new in _REPLACE:
        s = s.replace(old, new)
    s = re.sub(r"\\left(?![A-Za-z])|\\right(?![A-Za-z])", "", s)
    percent = "%" in s
    s = s.replace("\\%", "").replace("%", "")
    s = _TEXT_UNIT.sub("", s)
    s = _BARE_SHORT_UNIT.sub("", _BARE_LONG_UNIT.sub("", s.strip()))
    s = _TEXT_WRAP.sub(r"\1", s)
    s = re.sub(r"\s+", "", s)
    for deg in _DEGREES:
        s = s.replace(deg, "")
    s = _fix_shorthand(s)
    s = s.rstrip(".")
    return Normalized(strip_assignment(s), percent)


def is_plain_number(s: str) -> bool:
    """An integer or decimal literal (thousands commas allowed), no fractions or symbols."""
    return _DECIMAL.fullmatch(s) is not None


def to_number(s: str) -> Optional[float]:
    """The value of a normalised numeric answer: 1,000 / -2.5 / 1e-3 / 3/4 / \\frac{3}{4}."""
    try:
        if _DECIMAL.fullmatch(s):
            v = float(s.replace(",", ""))
        elif m := _FRAC.fullmatch(s):
            v = float(m.group(2)) / float(m.group(3)) * (-1 if m.group(1) == "-" else 1)
        elif m := _SLASH.fullmatch(s):
            v = float(m.group(1)) / float(m.group(2))
        else:
            return None
    except (ValueError, ZeroDivisionError):  # e.g. "1.2.3/4" matches the loose pattern
        return None
    return v if math.isfinite(v) else None


def numbers_equal(a: Normalized, b: Normalized, rel_tol: float = 1e-4) -> Optional[bool]:
    """None when either side is not a number; otherwise equality within `rel_tol`.

    Two integer literals compare exactly: the tolerance is for rounded decimals and
    fractions, and would otherwise call 100000 and 100001 equal.
    """
    x, y = to_number(a.text), to_number(b.text)
    if x is None or y is None:
        return None
    if not (a.percent or b.percent) and _INT.fullmatch(a.text) and _INT.fullmatch(b.text):
        return int(a.text.replace(",", "")) == int(b.text.replace(",", ""))
    xs = (x, x / 100) if a.percent else (x,)
    ys = (y, y / 100) if b.percent else (y,)
    return any(u == v or math.isclose(u, v, rel_tol=rel_tol) for u in xs for v in ys)
