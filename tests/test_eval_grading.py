"""kvflow.eval grading: the equivalence table, the in-process fast path, and the worker's
timeout/crash handling (METHODS.md §11)."""

from __future__ import annotations

import threading
import time

import pytest

from kvflow.eval import Grader, extract_answer, fast_equiv, is_equiv

# (pred, gold, equivalent)
CASES = [
    # fractions
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac{3}{4}", "\\frac{3}{4}", True),
    ("3/4", "\\frac{3}{4}", True),
    ("0.75", "\\tfrac34", True),
    ("-\\frac{1}{2}", "-0.5", True),
    ("\\frac{1}{3}", "\\frac{1}{2}", False),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),
    # integers, decimals, signs, thousands
    ("27.0", "27", True),
    ("27", "27.0", True),
    ("25", "025", True),
    ("-5", "-5", True),
    ("-5", "5", False),
    ("1,000", "1000", True),
    ("1,000,000", "1000000", True),
    ("1.00001", "1", True),  # within rel. tolerance 1e-4
    ("100001", "100000", False),  # integers compare exactly
    ("18", "17", False),
    # units, percent, degrees, assignments
    ("10\\text{ cm}", "10", True),
    ("5\\text{ cm}^2", "5", True),
    ("18 dollars", "18", True),
    ("\\$18", "18", True),
    ("50\\%", "50", True),
    ("50%", "0.5", True),
    ("90^\\circ", "90", True),
    ("x=3", "3", True),
    ("3", "x = 3", True),
    ("\\text{Yes}", "yes", True),
    # intervals and tuples (ordered; bracket kind matters)
    ("(0,4]", "(0, 4]", True),
    ("(0,4)", "(0,4]", False),
    ("[\\frac{1}{2}, 8]", "[0.5,8]", True),
    ("(-\\infty,3]\\cup[5,\\infty)", "(-\\infty, 3] \\cup [5, \\infty)", True),
    ("(3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("(1,2)", "(2,1)", False),
    # multiple answers (any order)
    ("60^\\circ, 90^\\circ", "90^{\\circ},60^{\\circ}", True),
    ("15, 5", "5,15", True),
    ("5, 16", "5,15", False),
    ("(3,2),(1,1)", "(1,1), (3,2)", True),
    ("\\{1,2\\}", "\\{2,1\\}", True),
    ("x=1, y=2", "1,2", True),
    # symbolic (math-verify)
    ("p-q", "-q+p", True),
    ("6-5i", "6 - 5i", True),
    ("x^2+2x", "x(x+2)", True),
    ("2\\pi", "\\pi", False),
    ("\\sqrt2/2", "\\frac{\\sqrt{2}}{2}", True),
    # nothing to grade
    (None, "1", False),
    ("", "1", False),
]


@pytest.fixture(scope="module")
def grader():
    with Grader(timeout=20) as g:
        yield g


@pytest.mark.parametrize("pred, gold, expected", CASES)
def test_equivalence_table(grader, pred, gold, expected):
    assert grader.grade(pred, gold) is expected


def test_grade_many(grader):
    assert grader.grade_many([(p, g) for p, g, _ in CASES]) == [e for _, _, e in CASES]


@pytest.mark.parametrize(
    "pred, gold, settled",
    [
        ("\\frac{1}{2}", "0.5", True),
        ("60^\\circ, 90^\\circ", "90^{\\circ},60^{\\circ}", True),
        ("18", "17", False),
        ("", "17", False),
        ("p-q", "-q+p", None),  # left to math-verify
        ("\\frac{1}{3}", "\\frac{1}{2}", None),
    ],
)
def test_fast_path(pred, gold, settled):
    assert fast_equiv(pred, gold) is settled


def test_fast_path_never_starts_a_worker():
    with Grader() as g:
        assert g.grade("1,000", "1000") and not g.grade("7", "8")
        assert g._proc is None and g.stats["fast"] == 2 and g.stats["symbolic"] == 0


@pytest.mark.parametrize(
    "output, gold",
    [
        ("So the total is \\boxed{\\dfrac{3}{4}}.", "0.75"),
        ("... hence the answer is $1,000$ dollars.", "1000"),  # answer-is: "1,000$ dollars"
        ("She makes 9 * 2 = 18 dollars a day.", "18"),  # last number
    ],
)
def test_extract_then_grade(grader, output, gold):
    assert grader.grade(extract_answer(output), gold)


# --- the worker: timeouts, crashes, threads ----------------------------------------------

CHECKS = '''
import os, time

def slow(pred, gold):
    time.sleep(float(pred.split(":")[1]))
    return True

def crash(pred, gold):
    os._exit(3)
'''


@pytest.fixture
def checks(tmp_path, monkeypatch):
    # A module the worker can import (it inherits sys.path), standing in for math-verify.
    (tmp_path / "kvflow_test_checks.py").write_text(CHECKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "kvflow_test_checks"


def test_timeout_kills_and_restarts_worker(checks):
    with Grader(timeout=0.5, check=f"{checks}:slow") as g:
        assert g.grade("sleep:0", "x") is True  # worker up
        first = g._proc.pid
        t0 = time.monotonic()
        assert g.grade("sleep:60", "x") is False
        assert time.monotonic() - t0 < 5
        assert g.stats["timeouts"] == 1 and g._proc is None
        assert g.grade("sleep:0", "y") is True  # a fresh worker
        assert g._proc.pid != first


def test_worker_crash_counts_wrong(checks):
    with Grader(timeout=5, check=f"{checks}:crash") as g:
        assert g.grade("boom", "x") is False
        assert g.stats["crashes"] == 2  # one retry on a fresh worker, then give up


def test_worker_that_cannot_start_raises():
    with Grader(check="kvflow_no_such_module:f", startup_timeout=60) as g:
        with pytest.raises(RuntimeError, match="exited during start-up"):
            g.grade("a", "b")


def test_check_must_be_importable():
    with pytest.raises(ValueError, match="importable"):
        Grader(check=lambda p, g: True)
    with pytest.raises(ValueError):
        Grader(timeout=0)


def test_is_equiv_from_a_thread():
    # math-verify's SIGALRM timeouts fail outside a main thread; is_equiv must still work.
    out = []
    t = threading.Thread(target=lambda: out.append(is_equiv("\\frac{\\pi}{2}", "\\pi/2")))
    t.start()
    t.join(120)
    assert out == [True]
