"""The grading worker: `python -m kvflow.eval._worker [module:function]`.

Runs the symbolic check (math-verify) in the main thread of its own process: math-verify
times itself out with SIGALRM, which only works in a main thread, and some sympy
simplifications hang or exhaust memory, so they stay out of the caller's process.
Protocol (driven by `kvflow.eval.grading.Grader`): the worker writes `"ready"` once
imports are done, then reads one JSON line `[pred, gold]` at a time from stdin and answers
each with one JSON line, `true` or `false`. It exits at end of input (also when the parent
dies). The protocol uses a private copy of fd 1; anything else printed goes to stderr.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
from typing import Callable


def _parse(text: str) -> list:
    from math_verify import parse

    # Answers are bare LaTeX; without math delimiters math-verify's LaTeX extractor does not
    # fire and its plain-expression fallback reads "6 - 5i" as 5. Plain text is the fallback.
    return parse(f"${text}$") or parse(text)


def math_verify_equiv(pred: str, gold: str) -> bool:
    """METHODS.md §11 symbolic step: `verify(parse(gold), parse(pred))`, gold first."""
    from math_verify import verify

    g, p = _parse(gold), _parse(pred)
    return bool(g and p and verify(g, p))


def load_check(spec: str) -> Callable[[str, str], bool]:
    """'package.module:function' -> the function."""
    module, _, name = spec.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def main(argv: list[str]) -> int:
    # Ctrl-C reaches the whole process group; the parent decides when this worker ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # stray prints (sympy, user checks) must not corrupt the protocol
    sys.stdout = sys.stderr
    if argv:
        check = load_check(argv[0])
    else:
        import math_verify  # noqa: F401  (pay the sympy import before the first timed call)

        check = math_verify_equiv
    out.write('"ready"\n')
    out.flush()
    for line in sys.stdin:
        pred, gold = json.loads(line)
        try:
            ok = bool(check(pred, gold))
        except Exception:  # an answer the checker cannot handle is simply not equivalent
            ok = False
        out.write("true\n" if ok else "false\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
