"""The example plugin distributions (plugins/kvflow-example-tova, plugins/kvflow-example-ngram),
installed by `make test` like any third-party plugin: a pipeline that uses both runs end to
end on tiny models, and without one of them `kvflow validate` and `kvflow run` stop with
exit code 2 and a located message instead of a traceback."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import REPO, run_kvflow
from kvflow.errors import unknown_component_hint
from kvflow.registry import Registry
from kvflow.testing import tiny_pipeline

PIPELINE = REPO / "plugins" / "tova_ngram.yaml"
EXAMPLES = {"tova-example": ("kvflow-example-tova", "evictors"), "ngram": ("kvflow-example-ngram", "pruners")}


def test_example_plugins_are_installed():
    reg = Registry.from_entry_points(disabled=[])
    plugins = {p.name: p for p in reg.plugins()}
    for name, (dist, kind) in EXAMPLES.items():
        assert name in plugins, f"{dist} is not installed: pip install -e plugins/{dist} (make test does)"
        assert plugins[name].distribution == dist and plugins[name].status == "ok"
        assert plugins[name].registered == {kind: [name]} and name in reg.names(kind)


# --8<-- [start:tiny-run]
def test_pipeline_with_both_plugins_runs_on_tiny_models(tmp_path, cli):
    path = tiny_pipeline(tmp_path, include=PIPELINE, name="tova_ngram", max_tokens=64)
    result = cli("run", path)
    assert result.exit_code == 0, result.output
    (run_dir,) = (tmp_path / "results").iterdir()
    base = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())["proposers"]["base"]
    assert base["evictor"] == {"kind": "tova-example", "budget": 64, "buffer": 1}
    assert [p["kind"] for p in base["pruners"]] == ["entropy", "ngram"]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    statuses = {p["name"]: (p["distribution"], p["status"]) for p in manifest["plugins"]}
    assert statuses["tova-example"] == ("kvflow-example-tova", "ok") and statuses["ngram"] == ("kvflow-example-ngram", "ok")
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert set(r["pruned"]) == {"entropy", "ngram"} and r["tokens_generated"]["base"] > 0
# --8<-- [end:tiny-run]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
@pytest.mark.parametrize("command", ["validate", "run"])
def test_without_the_plugin_the_pipeline_is_a_user_error(name, command, tmp_path):
    kind = EXAMPLES[name][1][:-1]
    r = run_kvflow(command, str(PIPELINE), "--set", f"run.output={tmp_path}", env={"KVFLOW_DISABLE_PLUGINS": name},
                   check_no_torch=True)
    assert r.returncode == 2, r.stderr
    line = next(i for i, text in enumerate(PIPELINE.read_text().splitlines(), 1) if f"kind: {name}" in text)
    assert f"tova_ngram.yaml:{line}: " in r.stderr and f"unknown {kind} '{name}'" in r.stderr
    assert "Traceback" not in r.stderr and not any(tmp_path.iterdir())


def test_the_missing_plugin_hint_names_kvflow_plugins():
    hint = unknown_component_hint("evictors", "tova", ["none", "random"])
    assert "installed evictors: none, random" in hint and "`kvflow plugins`" in hint


def test_validate_hints_at_the_missing_plugin():
    r = run_kvflow("validate", str(PIPELINE), env={"KVFLOW_DISABLE_PLUGINS": "tova-example"})
    assert r.returncode == 2 and "is the plugin that provides 'tova-example' installed" in r.stderr
    assert "`kvflow plugins` lists installed plugins" in r.stderr
