"""`kvflow schema` (JSON Schema of pipeline files) and `kvflow explain` (the plan in words)."""

from __future__ import annotations

import json
import re

import pytest
from conftest import REPO, run_kvflow
from pydantic import Field

import kvflow
from kvflow.components.base import Evictor, EvictorParams
from kvflow.config import load_pipeline

jsonschema = pytest.importorskip("jsonschema")

PIPELINES = sorted(p for p in (REPO / "pipelines").rglob("*") if p.suffix in (".yaml", ".yml"))


@pytest.fixture(scope="module")
def schema():
    from kvflow.registry import Registry
    from kvflow.tools.json_schema import pipeline_schema

    s = pipeline_schema(Registry.from_entry_points())
    jsonschema.Draft202012Validator.check_schema(s)
    return s


def _errors(schema, data) -> list[str]:
    v = jsonschema.Draft202012Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(data)]


# --------------------------------------------------------------------------- schema


def test_schema_shape(schema):
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    defs = schema["$defs"]
    assert "ComponentRef" not in defs
    kinds = {v["properties"]["kind"]["const"] for v in defs["Evictor"]["oneOf"]}
    assert {"none", "rkv", "random"} <= kinds
    rkv = next(v for v in defs["Evictor"]["oneOf"] if v["properties"]["kind"]["const"] == "rkv")
    assert rkv["additionalProperties"] is False and "kind" in rkv["required"]
    assert {"budget", "buffer", "window"} <= set(rkv["properties"])
    assert schema["properties"]["scorer"]["$ref"] == "#/$defs/Scorer"
    assert schema["properties"]["committer"]["$ref"] == "#/$defs/Committer"
    assert defs["ProposerConfig"]["properties"]["evictor"]["$ref"] == "#/$defs/Evictor"
    assert defs["ProposerConfig"]["properties"]["pruners"]["items"] == {"$ref": "#/$defs/Pruner"}
    assert "include" in schema["properties"]


@pytest.mark.parametrize("path", PIPELINES, ids=[str(p.relative_to(REPO)) for p in PIPELINES])
def test_every_shipped_pipeline_validates(schema, path):
    from kvflow.config.validate import load_pipeline

    loaded = load_pipeline(path)
    assert _errors(schema, loaded.resolved) == []


def test_raw_files_validate(schema):
    import yaml

    raw = yaml.safe_load((REPO / "pipelines" / "kv_rescue.yaml").read_text())
    assert _errors(schema, raw) == []
    # A file that includes another needs no top-level required keys of its own.
    assert _errors(schema, {"include": "kv_rescue.yaml", "name": "x"}) == []
    assert _errors(schema, {"include": ["a.yaml", "b.yaml"]}) == []
    assert _errors(schema, {"name": "x"})  # no include: models, proposers required
    assert _errors(schema, {"include": 3})


def _kv_rescue():
    from kvflow.config.validate import load_pipeline

    return json.loads(json.dumps(load_pipeline(REPO / "pipelines" / "kv_rescue.yaml").resolved))


def test_unknown_evictor_kind_or_param_fails(schema):
    data = _kv_rescue()
    data["proposers"]["base"]["evictor"]["kind"] = "rkvv"
    assert _errors(schema, data)
    data = _kv_rescue()
    data["proposers"]["base"]["evictor"]["budgett"] = 64
    assert _errors(schema, data)
    data = _kv_rescue()
    data["proposers"]["base"]["evictor"]["budget"] = "lots"
    assert _errors(schema, data)
    data = _kv_rescue()
    data["proposers"]["base"]["pruners"][0]["kind"] = "nope"
    assert _errors(schema, data)
    data = _kv_rescue()
    data["scorer"] = {"kind": "prm"}  # prm's `model` is required
    assert _errors(schema, data)
    data = _kv_rescue()
    data["committer"]["extra"] = 1
    assert _errors(schema, data)
    data = _kv_rescue()
    data["proposers"]["base"]["evictor"] = {"kind": "snapkv", "budget": 32}  # another kind, its params
    assert _errors(schema, data) == []


class StrideParams(EvictorParams):
    stride: int = Field(2, ge=1, description="Keep every stride-th token.")


class StrideEvictor(Evictor):
    """Keeps every `stride`-th token."""

    Params = StrideParams


class ThirdParty:
    @kvflow.hookimpl
    def register_evictors(self, register):
        register("stride", StrideEvictor)


def test_third_party_params_are_in_the_schema():
    import kvflow_builtin

    from kvflow.registry import Registry
    from kvflow.tools.json_schema import pipeline_schema

    reg = Registry.from_plugins([("builtin", kvflow_builtin), ("tp", ThirdParty())])
    s = pipeline_schema(reg)
    data = _kv_rescue()
    data["proposers"]["base"]["evictor"] = {"kind": "stride", "stride": 4, "budget": 64}
    assert _errors(s, data) == []
    data["proposers"]["base"]["evictor"]["stride"] = 0
    assert _errors(s, data)


def test_schema_cli(cli, tmp_path):
    r = cli("schema")
    assert r.exit_code == 0, r.stderr
    printed = json.loads(r.stdout)
    out = tmp_path / "sub" / "pipeline.schema.json"
    r = cli("schema", "--output", out)
    assert r.exit_code == 0 and "wrote" in r.stdout
    assert json.loads(out.read_text()) == printed


# --------------------------------------------------------------------------- explain


def test_explain_quickstart(cli):
    r = cli("explain", REPO / "pipelines" / "quickstart.yaml")
    assert r.exit_code == 0, r.stderr
    out = r.stdout
    assert "pipeline quickstart" in out
    assert "model: base -> catalog:qwen2.5-coder-0.5b-instruct" in out and "PyPI wheel" in out
    assert "evictor: random (budget=64, buffer=64" in out
    assert "evictor: none" in out
    assert re.search(r"- entropy \(.*threshold=2\.5", out) and re.search(r"- gzip \(.*threshold=0\.25", out)
    assert "scorer: likelihood" in out and "uses model: helper -> catalog:" in out
    assert "committer: best" in out
    limits = load_pipeline(REPO / "pipelines" / "quickstart.yaml").pipeline.limits
    assert f"limits: max_steps={limits.max_steps}, max_tokens={limits.max_tokens}" in out and "dataset: gsm8k" in out
    assert "KV memory per sequence" in out
    assert re.search(r"^  base: 128 tokens \(budget 64 \+ buffer 64\)", out, re.M)
    assert re.search(rf"^  helper: {limits.max_tokens + 256} tokens \(full cache", out, re.M)
    assert "resolved config:" in out and "    evictor: {kind: random" in out
    # both roles load the same checkpoint the same way: one engine, one forward per token for both
    assert "models base = helper [hf]: base, helper (up to 8 rows per forward)" in out
    assert "live_problems=4" in out


def test_explain_kv_rescue(cli):
    r = cli("explain", REPO / "pipelines" / "kv_rescue.yaml", "--set", "proposers.base.evictor.budget=128")
    assert r.exit_code == 0, r.stderr
    out = r.stdout
    assert "model: base -> Qwen/Qwen2.5-Math-7B-Instruct" in out and "Hugging Face hub id" in out
    assert "evictor: rkv (budget=128, buffer=128" in out
    assert "- entropy (" in out and "- gzip (" in out
    assert "scorer: prm" in out and "uses model: prm -> Qwen/Qwen2.5-Math-PRM-7B" in out
    assert "committer: best" in out
    # the paper models have cost presets: an estimate even offline
    assert re.search(r"^  base: 256 tokens \(budget 128 \+ buffer 128\) x 56\.0 KiB/token", out, re.M)
    assert re.search(r"^  helper: 4352 tokens", out, re.M)


def test_explain_unknown_hub_model(cli):
    r = cli("explain", REPO / "pipelines" / "kv_rescue.yaml",
            "--set", "models.base.id=kvflow-test-nobody/not-a-model-xyz")
    assert r.exit_code == 0, r.stderr
    assert re.search(r"^  base: 192 tokens .*unknown \(config not available offline\)", r.stdout, re.M)


def test_explain_bad_file(cli, write, tmp_path):
    bad = write("bad.yaml", """
        name: bad
        models: {m: {id: catalog:smollm2-135m-instruct}}
        proposers:
          p: {model: m, evictor: {kind: rkvv}}
    """)
    r = cli("explain", bad)
    assert r.exit_code == 2
    assert "unknown evictor 'rkvv'" in r.stderr and "Traceback" not in r.stderr
    r = cli("explain", tmp_path / "missing.yaml")
    assert r.exit_code == 2
    r = cli("explain", REPO / "pipelines" / "quickstart.yaml", "--set", "proposers.base.evictor.budgett=1")
    assert r.exit_code == 2 and "budgett" in r.stderr


@pytest.mark.parametrize("args", [["schema"], ["explain", "pipelines/quickstart.yaml"],
                                  ["explain", "pipelines/kv_rescue.yaml"]])
def test_no_heavy_imports(args):
    r = run_kvflow(*args, check_no_torch=True)
    assert r.returncode == 0, r.stderr
