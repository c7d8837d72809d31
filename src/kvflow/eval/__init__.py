"""Evaluation: built-in math test sets, prompt templates, answer extraction and grading
(METHODS.md §11). Importing this package does not import torch, transformers or math-verify.
"""

from kvflow.eval.answer import extract_answer, last_boxed
from kvflow.eval.datasets import DATASETS, DatasetError, Problem, dataset_path, load_jsonl_problems, load_problems
from kvflow.eval.grading import Grader, fast_equiv, is_equiv
from kvflow.eval.prompts import PROMPTS, PromptTemplate, get_prompt, render_prompt

__all__ = [
    "DATASETS", "DatasetError", "Grader", "PROMPTS", "Problem", "PromptTemplate", "dataset_path",
    "extract_answer", "fast_equiv", "get_prompt", "is_equiv", "last_boxed", "load_jsonl_problems",
    "load_problems", "render_prompt",
]
