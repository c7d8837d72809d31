"""The `hf` backend and the installed transformers: a version below the verified floor is refused
before anything loads (with the versions and how to install a supported one), and a model whose
forward takes its cache as `past_key_values` (transformers before the rename to `cache`, e.g.
5.17 and 5.19) decodes through kvflow's cache exactly as one that takes `cache`."""

from __future__ import annotations

import importlib.metadata
import inspect
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from kvflow.backends.hf import HFBackend
from kvflow.backends.hf.compat import TRANSFORMERS_FLOOR, TRANSFORMERS_RANGE, check_transformers
from kvflow.backends.hf.decode import HFEngine
from kvflow.backends.hf.engine import HFRunner
from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest
from kvflow.config.schema import ModelConfig
from kvflow.errors import UserError
from kvflow.testing import propose_now, tiny_tokenizer
from kvflow.testing.models import tiny_model
from kvflow_builtin.evictors.none import NoEviction
from kvflow_builtin.evictors.random import RandomEvictor


# --------------------------------------------------------------------------- version check


def fake_transformers_version(monkeypatch, version):
    real = importlib.metadata.version

    def fake(name):
        if name == "transformers":
            if version is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return version
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", fake)


@pytest.mark.parametrize("old", ["5.16.2", "5.9.0", "4.57.1"])
def test_check_refuses_transformers_below_the_floor(monkeypatch, old):
    fake_transformers_version(monkeypatch, old)
    why = HFBackend.check(ModelConfig(id="catalog:qwen2.5-coder-0.5b-instruct", dtype="float32", device="cpu"))
    assert isinstance(why, tuple) and why[0] == "backend", why
    assert f"transformers {old} is installed" in why[1]
    assert f"transformers{TRANSFORMERS_RANGE}" in why[1] and TRANSFORMERS_FLOOR in why[1]
    assert f"pip install 'transformers{TRANSFORMERS_RANGE}'" in why[1]
    with pytest.raises(UserError, match=re.escape(f"transformers {old} is installed")):
        HFBackend.load(ModelConfig(id="catalog:qwen2.5-coder-0.5b-instruct", dtype="float32", device="cpu"))


def test_check_accepts_the_floor_and_names_a_missing_transformers(monkeypatch):
    assert check_transformers(TRANSFORMERS_FLOOR) is None
    assert check_transformers("5.17.0.dev0") is None and check_transformers("5.24.0") is None
    assert check_transformers() is None  # the installed one
    fake_transformers_version(monkeypatch, None)
    assert "transformers is not installed" in check_transformers()


def test_pyproject_declares_the_verified_range():
    deps = re.findall(r'"transformers([^"]*)"', (REPO / "pyproject.toml").read_text())
    assert deps == [TRANSFORMERS_RANGE]
    assert TRANSFORMERS_RANGE.startswith(">=" + TRANSFORMERS_FLOOR.removesuffix(".0"))


def test_the_check_imports_neither_torch_nor_transformers():
    code = ("import sys\nfrom kvflow.backends.hf import HFBackend\nfrom kvflow.config.schema import ModelConfig\n"
            "HFBackend.check(ModelConfig(id='catalog:qwen2.5-coder-0.5b-instruct'))\n"
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "sys.exit(f'imported {heavy}' if heavy else 0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------- cache keyword


def old_keyword_model(seed: int = 1):
    """tiny_model("qwen2") whose decoder stack takes its cache as `past_key_values` only, as
    transformers did before the rename: a `cache=` keyword then rides along in **kwargs,
    unused, and the stack builds a throwaway cache of its own."""
    model = tiny_model("qwen2", seed=seed)
    parent = type(model.model)
    current = "cache" if "cache" in inspect.signature(parent.forward).parameters else "past_key_values"

    class OldKeywordQwen2Model(parent):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    inputs_embeds=None, use_cache=None, **kwargs):
            kwargs.pop("cache", None)  # not a parameter here: ignored, like any unknown keyword
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   inputs_embeds=inputs_embeds, use_cache=use_cache,
                                   **{current: past_key_values}, **kwargs)

    body = OldKeywordQwen2Model(model.config)
    body.load_state_dict(model.model.state_dict())
    model.model = body.eval()
    return model


def greedy(engine: HFEngine, prompt: str, evictor, tokens: int = 40) -> list[int]:
    (state,) = engine.start([StartRequest(prompt, evictor, 7)])
    spec = SamplingSpec(1, 0.0, 1.0, tokens, "\x00\x01")  # a delimiter no step completes
    (candidate,) = propose_now(engine, ProposeRequest(state, "base", spec, 0, tokens)).candidates
    return candidate.token_ids


EVICTORS = {
    "none": lambda: NoEviction(NoEviction.Params()),
    "random-large-budget": lambda: RandomEvictor(RandomEvictor.Params(budget=400, buffer=16)),
    "random-small-budget": lambda: RandomEvictor(RandomEvictor.Params(budget=12, buffer=4, window=2)),
}


@pytest.mark.parametrize("evictor", list(EVICTORS))
def test_a_past_key_values_forward_decodes_like_a_cache_forward(evictor):
    tok = tiny_tokenizer()
    old = HFRunner(old_keyword_model(), tok)
    assert old.cache_keyword == "past_key_values"
    new = HFRunner(tiny_model("qwen2", seed=1), tok)
    prompt = tok.apply_chat_template([{"role": "user", "content": "How many clips did Natalia sell?"}],
                                     tokenize=False, add_generation_prompt=True)
    got = greedy(HFEngine(old), prompt, EVICTORS[evictor]())
    want = greedy(HFEngine(new), prompt, EVICTORS[evictor]())
    assert got == want
    if evictor != "random-small-budget":  # budget >= sequence: plain greedy `generate`
        ids = torch.tensor([new.encode(prompt)])
        ref = new.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(want),
                                 do_sample=False, pad_token_id=0, eos_token_id=sorted(new.eos_ids))
        assert ref[0, ids.shape[1]:].tolist() == want


def test_a_forward_that_names_no_cache_is_refused():
    model = tiny_model("qwen2")
    parent = type(model.model)

    class NoCacheModel(parent):
        def forward(self, input_ids=None, **kwargs):  # **kwargs would swallow either name unused
            return super().forward(input_ids=input_ids, **kwargs)

    model.model = NoCacheModel(model.config)
    with pytest.raises(UserError, match="takes its KV cache under neither 'cache' nor 'past_key_values'"):
        HFRunner(model, tiny_tokenizer())


def test_run_and_explain_print_the_versions_in_use(tmp_path, cli):
    """`kvflow run` and `kvflow explain` say which torch, transformers and SGLang they run on,
    and the manifest records the same versions."""
    import json

    from kvflow.testing import tiny_pipeline

    torch_version = importlib.metadata.version("torch")
    transformers_version = importlib.metadata.version("transformers")
    path = tiny_pipeline(tmp_path, problems=1)
    explained = cli("explain", path)
    assert explained.exit_code == 0, explained.output
    assert f"torch {torch_version}, transformers {transformers_version}" in explained.output
    ran = cli("run", path)
    assert ran.exit_code == 0, ran.output
    assert f"versions: torch {torch_version}, transformers {transformers_version}" in ran.output
    (run_dir,) = (tmp_path / "results").iterdir()
    versions = json.loads((run_dir / "manifest.json").read_text())["versions"]
    assert (versions["torch"], versions["transformers"]) == (torch_version, transformers_version)
