"""Built-in math test sets and a loader for custom JSONL files (METHODS.md §11).

The five built-in sets ship as package data under `kvflow/eval/data/<name>/test.jsonl`
(sources and licenses in `data/README.md`). Ids are stable across versions and
independent of shuffling, so results directories from different runs can be joined on them.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional, Union

from kvflow.eval._names import unknown_name

DATASETS: tuple[str, ...] = ("gsm8k", "math500", "aime24", "amc23", "olympiadbench")


class DatasetError(ValueError):
    """A dataset file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    gold: str
    # Everything else in the record (solutions, urls, the raw answer, ...). Excluded from the
    # hash because a dict is unhashable; still compared by ==.
    meta: dict = field(default_factory=dict, hash=False)


def format_number(x: Union[int, float]) -> str:
    """Write a numeric answer the way a model would: 27.0 -> "27", 0.5 -> "0.5"."""
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return repr(x) if isinstance(x, float) else str(x)


def _gold_text(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{where}: answer must be a string or a number, got {type(value).__name__}")
    return value.strip() if isinstance(value, str) else format_number(value)


def _gsm8k(rec: dict, where: str) -> tuple[str, str, str]:
    sol = rec["answer"]
    if "####" not in sol:
        raise DatasetError(f"{where}: gsm8k answer has no '####' final-answer marker")
    gold = sol.rsplit("####", 1)[1].strip().replace(",", "")  # gsm8k golds are plain numbers
    return f"gsm8k/{rec['idx']}", rec["question"], gold


def _math500(rec: dict, where: str) -> tuple[str, str, str]:
    return rec["unique_id"], rec["problem"], _gold_text(rec["answer"], where)


def _by_id(name: str) -> Callable[[dict, str], tuple[str, str, str]]:
    def read(rec: dict, where: str) -> tuple[str, str, str]:
        return f"{name}/{rec['id']}", rec["question"], _gold_text(rec["answer"], where)

    return read


def _olympiadbench(rec: dict, where: str) -> tuple[str, str, str]:
    # Multi-answer golds are written "$a$,$b$"; removing every `$` (not only the outer
    # ones, as the reference parser does) leaves valid LaTeX "a,b".
    gold = rec["final_answer"][0].replace("$", "").strip()
    return f"olympiadbench/{rec['id']}", rec["question"], gold


# name -> (record -> (id, question, gold)); the question field is popped from meta.
_READERS = {
    "gsm8k": (_gsm8k, "question"),
    "math500": (_math500, "problem"),
    "aime24": (_by_id("aime24"), "question"),
    "amc23": (_by_id("amc23"), "question"),
    "olympiadbench": (_olympiadbench, "question"),
}


def dataset_path(name: str) -> Path:
    """The packaged `test.jsonl` of a built-in dataset."""
    if name not in DATASETS:
        raise unknown_name("dataset", name, DATASETS)
    return Path(str(resources.files("kvflow.eval") / "data" / name / "test.jsonl"))


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) for every non-blank line; a bad line names file and line."""
    out = []
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror or e}") from None
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DatasetError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{lineno}: invalid JSON: {e}") from None
        if not isinstance(rec, dict):
            raise DatasetError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
        out.append((lineno, rec))
    if not out:
        raise DatasetError(f"{path}: no problems (the file is empty)")
    return out


def _select(problems: list[Problem], limit: Optional[int], offset: int, shuffle: bool, seed: int) -> list[Problem]:
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    if shuffle:
        random.Random(seed).shuffle(problems)
    end = None if limit is None else offset + limit
    return problems[offset:end]


def load_problems(
    name: str, *, limit: Optional[int] = None, offset: int = 0, shuffle: bool = False, seed: int = 0
) -> list[Problem]:
    """Problems of a built-in dataset; shuffled with `random.Random(seed)` before offset/limit."""
    path = dataset_path(name)
    read, qfield = _READERS[name]
    problems = []
    for lineno, rec in _read_jsonl(path):
        where = f"{path}:{lineno}"
        try:
            pid, question, gold = read(rec, where)
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise DatasetError(f"{where}: malformed {name} record ({type(e).__name__}: {e})") from None
        meta = {k: v for k, v in rec.items() if k != qfield}
        problems.append(Problem(id=str(pid), question=question, gold=gold, meta=meta))
    return _select(problems, limit, offset, shuffle, seed)


def load_jsonl_problems(
    path: Union[str, Path],
    question_field: str,
    answer_field: str,
    id_field: Optional[str] = None,
    *,
    name: Optional[str] = None,
    limit: Optional[int] = None,
    offset: int = 0,
    shuffle: bool = False,
    seed: int = 0,
) -> list[Problem]:
    """Problems from a custom JSONL file, one object per line.

    Ids are `f"{name}/{record[id_field]}"`, or `f"{name}/{i}"` (i = 0-based record index)
    without `id_field`; `name` defaults to the file's stem. Numeric answers are written like
    `format_number` (27.0 -> "27"); all other fields go to `meta`.
    """
    path = Path(path)
    prefix = name if name is not None else path.stem
    problems = []
    first_line: dict[str, int] = {}
    for i, (lineno, rec) in enumerate(_read_jsonl(path)):
        where = f"{path}:{lineno}"
        for f in (question_field, answer_field) + ((id_field,) if id_field else ()):
            if f not in rec:
                raise DatasetError(f"{where}: missing field {f!r} (fields: {', '.join(rec)})")
        question = rec[question_field]
        if not isinstance(question, str):
            raise DatasetError(f"{where}: {question_field!r} must be a string, got {type(question).__name__}")
        key = rec[id_field] if id_field else i
        pid = f"{prefix}/{key}"
        if pid in first_line:  # results are keyed by id: two problems cannot share one
            raise DatasetError(f"{where}: duplicate id {key!r} (also on line {first_line[pid]})")
        first_line[pid] = lineno
        meta = {k: v for k, v in rec.items() if k != question_field}
        problems.append(Problem(id=pid, question=question, gold=_gold_text(rec[answer_field], where), meta=meta))
    if not any(p.gold.strip() for p in problems):
        raise DatasetError(f"{path}: every {answer_field!r} is empty: nothing to grade against")
    return _select(problems, limit, offset, shuffle, seed)
