"""kvflow.eval: datasets, prompts and answer extraction (grading is in test_eval_grading.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kvflow.eval import (
    DATASETS,
    PROMPTS,
    DatasetError,
    Problem,
    dataset_path,
    extract_answer,
    load_jsonl_problems,
    load_problems,
    render_prompt,
)

# --- datasets -----------------------------------------------------------------------

COUNTS = {"gsm8k": 1319, "math500": 500, "aime24": 30, "amc23": 40, "olympiadbench": 675}
# git blob hashes from the data README: the packaged files are the unmodified sources.
BLOBS = {
    "gsm8k": "3e6e62b831b5fcbf0585d0dce75ccc5e4ccb691c",
    "math500": "2376b9a194b46c0790e197c91b7249e5f88ac09b",
    "aime24": "bb72e176e8d30c09cd67037e17cfc41e6ff48f70",
    "amc23": "6894ad7c49a0b3a64210af32954f4d049d934ea0",
    "olympiadbench": "ec36280b1de8f5bbee92da696c2ae84f5f6e6beb",
}


def test_dataset_names():
    assert DATASETS == tuple(COUNTS)


@pytest.mark.parametrize("name", DATASETS)
def test_packaged_files_are_the_sources(name):
    data = dataset_path(name).read_bytes()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == BLOBS[name]
    assert (dataset_path(name).parents[1] / "README.md").is_file()


@pytest.mark.parametrize("name", DATASETS)
def test_load_all(name):
    problems = load_problems(name)
    assert len(problems) == COUNTS[name]
    assert len({p.id for p in problems}) == len(problems)
    assert all(p.question.strip() and p.gold for p in problems)
    assert all("$" not in p.gold for p in problems if name == "olympiadbench")


@pytest.mark.parametrize(
    "pid, gold",
    [
        ("gsm8k/0", "18"),
        ("gsm8k/146", "2125"),  # "#### 2,125"
        ("gsm8k/201", "114200"),
        ("test/precalculus/807.json", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("aime24/60", "204"),
        ("aime24/67", "025"),  # kept as written; grading reads it as 25
        ("amc23/0", "27"),  # 27.0 in the file
        ("amc23/17", "-1"),
        ("olympiadbench/1606", "2"),
        ("olympiadbench/2978", "\\frac{9}{32}"),
        ("olympiadbench/2099", "90^{\\circ},60^{\\circ}"),  # "$90^{\circ}$,$60^{\circ}$"
    ],
)
def test_gold(pid, gold):
    name = "math500" if pid.startswith("test/") else pid.split("/")[0]
    by_id = {p.id: p for p in load_problems(name)}
    assert by_id[pid].gold == gold


def test_meta_keeps_the_record():
    p = load_problems("amc23", limit=1)[0]
    assert p.meta["answer"] == 27.0 and isinstance(p.meta["answer"], float)
    assert "question" not in p.meta and p.meta["url"].startswith("https://")
    g = load_problems("gsm8k", limit=1)[0]
    assert g.meta["idx"] == 0 and "#### 18" in g.meta["answer"]
    o = load_problems("olympiadbench", limit=1)[0]
    assert o.meta["final_answer"] == ["2"] and "is_multiple_answer" in o.meta


def test_problem_is_frozen_and_hashable():
    p = load_problems("aime24", limit=1)[0]
    with pytest.raises(AttributeError):
        p.gold = "1"  # type: ignore[misc]
    assert len({p, p}) == 1
    assert p == Problem(p.id, p.question, p.gold, dict(p.meta))


def test_offset_limit():
    full = load_problems("math500")
    assert load_problems("math500", offset=10, limit=5) == full[10:15]
    assert load_problems("math500", offset=498) == full[498:]
    assert load_problems("math500", limit=0) == []
    with pytest.raises(ValueError):
        load_problems("math500", offset=-1)


def test_shuffle_is_deterministic():
    a = load_problems("gsm8k", shuffle=True, seed=7)
    assert [p.id for p in a] == [p.id for p in load_problems("gsm8k", shuffle=True, seed=7)]
    assert [p.id for p in a] != [p.id for p in load_problems("gsm8k", shuffle=True, seed=8)]
    assert [p.id for p in a] != [p.id for p in load_problems("gsm8k")]
    assert sorted(p.id for p in a) == sorted(p.id for p in load_problems("gsm8k"))
    # shuffle happens before offset/limit
    assert load_problems("gsm8k", shuffle=True, seed=7, offset=3, limit=4) == a[3:7]


def test_unknown_dataset_suggests():
    with pytest.raises(ValueError, match=r"did you mean 'gsm8k'"):
        load_problems("gsm8K")
    with pytest.raises(ValueError, match=r"did you mean 'math500'"):
        load_problems("math_500")
    with pytest.raises(ValueError, match="choices: aime24"):
        load_problems("imagenet")


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_custom_jsonl(tmp_path):
    f = _write(tmp_path / "mine.jsonl", [
        json.dumps({"q": "1+1?", "a": 2.0, "key": "x"}),
        "",  # blank lines are skipped
        json.dumps({"q": "half of 1?", "a": " 1/2 ", "key": "y"}),
    ])
    ps = load_jsonl_problems(f, "q", "a")
    assert [(p.id, p.question, p.gold) for p in ps] == [("mine/0", "1+1?", "2"), ("mine/1", "half of 1?", "1/2")]
    assert ps[0].meta == {"a": 2.0, "key": "x"}
    assert [p.id for p in load_jsonl_problems(f, "q", "a", "key", name="set")] == ["set/x", "set/y"]


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    f = _write(tmp_path / "bad.jsonl", [json.dumps({"q": "a", "a": "1"}), '{"q": "b", "a": '])
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2: invalid JSON"):
        load_jsonl_problems(f, "q", "a")
    g = _write(tmp_path / "missing.jsonl", [json.dumps({"q": "a", "a": "1"}), json.dumps({"q": "b"})])
    with pytest.raises(DatasetError, match=r"missing\.jsonl:2: missing field 'a'"):
        load_jsonl_problems(g, "q", "a")
    h = _write(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(DatasetError, match=r"list\.jsonl:1: expected a JSON object"):
        load_jsonl_problems(h, "q", "a")


# --- prompts --------------------------------------------------------------------------

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


def _tokenizer(chat_template):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    ht = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    ht.chat_template = chat_template
    return ht


def test_prompt_names():
    assert "qwen25-math-cot" in PROMPTS


def test_render_with_chat_template():
    out = render_prompt("qwen25-math-cot", "What is 1+1?", _tokenizer(CHATML))
    assert out == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 1+1?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_render_without_chat_template():
    expected = f"{SYSTEM}\n\nQuestion: What is 1+1?\nAnswer:"
    assert render_prompt("qwen25-math-cot", "What is 1+1?", _tokenizer(None)) == expected
    assert render_prompt("qwen25-math-cot", "What is 1+1?", None) == expected


def test_render_template_without_system_role():
    # Gemma-style templates refuse a system turn; the instruction moves into the user turn.
    template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        + CHATML
    )
    out = render_prompt("qwen25-math-cot", "Q?", _tokenizer(template))
    assert out == f"<|im_start|>user\n{SYSTEM}\n\nQ?<|im_end|>\n<|im_start|>assistant\n"


def test_unknown_prompt_suggests():
    with pytest.raises(ValueError, match=r"did you mean 'qwen25-math-cot'"):
        render_prompt("qwen25-math-cott", "Q", None)


# --- answer extraction ----------------------------------------------------------------

@pytest.mark.parametrize(
    "text, answer",
    [
        ("so the result is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{a^{2}+\\frac{b}{c}}", "a^{2}+\\frac{b}{c}"),  # nested braces
        ("\\boxed{\\left\\{1, 2\\right\\}}", "\\left\\{1, 2\\right\\}"),  # escaped braces
        ("first \\boxed{1}, finally \\boxed{2}", "2"),  # the last box
        ("\\boxed{\\boxed{7}}", "7"),
        ("\\fbox{5}", "5"),
        ("$\\boxed{ 7 }$", "7"),
        ("\\boxed 5$ done", "5"),  # TeX's unbraced argument
        ("\\boxed{3}, then truncated \\boxed{4", "3"),  # an unclosed box is skipped
        ("Put it within \\boxed{}. It is 12", "12"),  # an empty box is skipped
        ("The answer is $\\frac{3}{4}$.", "\\frac{3}{4}"),
        ("blah\nthe answer is: 42. Done.", "42"),
        ("**The final answer is 12**", "12"),
        ("The answer is 3.5", "3.5"),
        ("there are 1,234 apples and -5.5 pears.", "-5.5"),  # last number
        ("in total 1,234 apples", "1234"),
        ("no digits at all", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer
