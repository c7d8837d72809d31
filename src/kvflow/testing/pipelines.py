"""Pipeline files that run on tiny models, for tests of the real `kvflow run` path.

    from kvflow.testing import tiny_pipeline

    path = tiny_pipeline(tmp_path, evictor={"kind": "tova-example", "budget": 16}, pruners=[{"kind": "ngram"}])
    # kvflow run <path>  ->  <tmp_path>/results/tiny__<hash>/ in a few seconds on a CPU

`tiny_pipeline` writes, under a directory: the tiny random-weight models of
`kvflow.testing.models` saved as transformers directories (a Qwen2 for the first proposer,
a Llama for the others, both with the tiny tokenizer), a JSONL dataset of a few GSM8K-style
problems, and a pipeline YAML that uses them. Given `include=` an existing pipeline (e.g.
`pipelines/quickstart.yaml`), the written file includes it and only shrinks it: every
entry of its `models` points at a tiny model, the dataset is the tiny one, proposers
sample a few short candidates, and the limits are small; its evictors, pruners, scorer
and committer stay unless given. With `model="catalog:smollm2-135m-instruct"` every model
is that catalog checkpoint instead (downloaded once, see `kvflow models`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import yaml

from kvflow.config.loader import deep_merge

PROBLEMS = [
    ("Natalia sold 48 clips in April and half as many in May. How many clips did she sell?", "72"),
    ("A book costs $12 and a pen costs $3. How much do 2 books and 4 pens cost?", "36"),
    ("Tom has 5 boxes of 8 apples and eats 6 apples. How many apples are left?", "34"),
    ("A train travels 60 miles per hour for 3 hours. How far does it go?", "180"),
]

#: the pipeline used when no `include` is given: an evicted base and a full-KV helper
DEFAULT_PIPELINE: dict[str, Any] = {
    "kvflow": 1,
    "proposers": {
        "base": {"model": "base", "evictor": {"kind": "random", "budget": 16, "buffer": 8, "window": 4}},
        "helper": {"model": "helper"},
    },
    "scorer": {"kind": "likelihood"},
    "committer": {"kind": "best"},
}


def tiny_model_dir(directory: Union[str, Path], arch: str = "qwen2", seed: int = 0, vocab_size: int = 400) -> Path:
    """`kvflow.testing.tiny_model(arch, seed=seed)` and the tiny tokenizer (of `vocab_size`:
    another size tokenizes differently) saved under `directory` (once: an existing copy is
    reused). Returns the model directory."""
    from kvflow.testing.models import tiny_model, tiny_tokenizer

    path = Path(directory) / (f"tiny-{arch}-{seed}" + ("" if vocab_size == 400 else f"-v{vocab_size}"))
    if not (path / "config.json").is_file():
        tokenizer = tiny_tokenizer(vocab_size)
        tiny_model(arch, seed=seed, vocab_size=len(tokenizer)).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def tiny_dataset(directory: Union[str, Path], n: int = 2) -> Path:
    """A JSONL file of `n` (at most 4) GSM8K-style problems with `question` and `answer`."""
    path = Path(directory) / "problems.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PROBLEMS[:n]))
    return path


def _proposers_and_models(include: Optional[Path]) -> tuple[list[str], list[str]]:
    if include is None:
        return list(DEFAULT_PIPELINE["proposers"]), ["base", "helper"]
    from kvflow.config.loader import load_config

    data, _ = load_config(include)
    proposers = data.get("proposers") or {}
    models = list(data.get("models") or {})
    first = proposers[next(iter(proposers))].get("model") if proposers else None
    return list(proposers), sorted(models, key=lambda k: k != first)  # the first proposer's model first


def tiny_pipeline(
    directory: Union[str, Path],
    *,
    include: Union[str, Path, None] = None,
    name: str = "tiny",
    evictor: Optional[dict] = None,
    pruners: Optional[Sequence[dict]] = None,
    scorer: Optional[dict] = None,
    committer: Optional[dict] = None,
    helper: bool = True,
    problems: int = 2,
    n: int = 2,
    max_step_tokens: int = 16,
    max_tokens: int = 48,
    model: Optional[str] = None,
    extra: Optional[dict] = None,
) -> Path:
    """Write `<directory>/<name>.yaml`, a pipeline that runs on tiny models; returns its path.

    evictor, pruners: the first proposer's (the base's) evictor and pruners;
    scorer, committer: replace the pipeline's; helper=False drops every proposer but the first;
    problems: dataset size; n, max_step_tokens, max_tokens: candidates per proposer (the base's;
    other proposers get 1), tokens per candidate step, committed tokens per problem;
    model: a model id for every model instead of the tiny ones (e.g. a catalog checkpoint);
    extra: more top-level keys, deep-merged last (e.g. {"run": {"seed": 3}}).
    """
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    include = Path(include).resolve() if include is not None else None
    proposer_names, model_keys = _proposers_and_models(include)
    base = proposer_names[0]

    models = {}
    for i, key in enumerate(model_keys):
        mid = model or str(tiny_model_dir(directory / "models", "qwen2" if i == 0 else "llama", seed=1 if i == 0 else 2))
        models[key] = {"id": mid, "dtype": "float32", "device": "cpu"}
    proposers: dict[str, Any] = {}
    for i, pname in enumerate(proposer_names):
        if i > 0 and not helper:
            proposers[pname] = None  # a null deletes the included proposer
            continue
        entry: dict[str, Any] = {"n": n if i == 0 else 1,
                                 "sampling": {"temperature": 1.0, "max_step_tokens": max_step_tokens}}
        if i == 0 and evictor is not None:
            entry["evictor"] = dict(evictor)
        if i == 0 and pruners is not None:
            entry["pruners"] = [dict(p) for p in pruners]
        proposers[pname] = entry

    doc: dict[str, Any] = {"include": str(include)} if include else dict(DEFAULT_PIPELINE)
    if include is None:
        doc["proposers"] = deep_merge(DEFAULT_PIPELINE["proposers"], proposers)
    else:
        doc["proposers"] = proposers
    doc.update({
        "name": name,
        "dataset": {"name": "tiny", "path": tiny_dataset(directory, problems).name, "limit": problems},
        "models": models,
        "limits": {"max_steps": 6, "max_tokens": max_tokens},
        "run": {"seed": 0, "output": str(directory / "results"), "batch_problems": 4},
    })
    if base not in doc["proposers"] or doc["proposers"][base] is None:
        raise ValueError(f"the first proposer {base!r} cannot be dropped")
    if scorer is not None:
        doc["scorer"] = dict(scorer)
    if committer is not None:
        doc["committer"] = dict(committer)
    doc = deep_merge(doc, extra or {})
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path

