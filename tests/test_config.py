"""Config layer: YAML loading with locations, include + deep merge, --set/--unset, validation."""

from __future__ import annotations

import re

import pytest
from conftest import DATA, REPO, VALID

from kvflow.components.base import Committer, Evictor, Pruner, Scorer
from kvflow.config import config_hash, load_config, load_pipeline
from kvflow.config.loader import format_path, parse_path
from kvflow.config.overrides import apply_overrides
from kvflow.errors import ConfigProblem, UserError

SHIPPED = sorted((REPO / "pipelines").rglob("*.yaml"))


def problems_of(excinfo) -> list[ConfigProblem]:
    return excinfo.value.problems


# --------------------------------------------------------------------------- shipped pipelines


def test_the_shipped_pipelines_are_found():
    """The glob below must find the shipped files: an empty list would make the validation
    test that follows check nothing, silently."""
    names = {p.relative_to(REPO).as_posix() for p in SHIPPED}
    assert {"pipelines/kv_rescue.yaml", "pipelines/quickstart.yaml", "pipelines/cpu/kv_rescue.yaml"} <= names
    assert len(SHIPPED) >= 15


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_pipeline_validates(path):
    loaded = load_pipeline(path)
    assert loaded.pipeline.name


# --------------------------------------------------------------------------- errors


def test_problem_format():
    p = ConfigProblem("a.yaml", 3, "proposers.base.n", "bad", "fix it")
    assert p.format() == "a.yaml:3: proposers.base.n: bad\n  hint: fix it"
    assert ConfigProblem("<--set>", 0, "run.seed", "bad").format() == "--set run.seed: bad"
    assert ConfigProblem("a.yaml", 0, "", "file not found").format() == "a.yaml: file not found"
    assert UserError("plain", hint="h").format() == "error: plain\n  hint: h"
    e = UserError([ConfigProblem("a", 1, "x", "m1"), ConfigProblem("a", 2, "y", "m2")])
    assert str(e) == "a:1: x: m1\na:2: y: m2"


def test_path_round_trip():
    for parts in [("a",), ("proposers", "base", "pruners", 0, "window"), ("models", "qwen2.5", "id")]:
        assert parse_path(format_path(parts)) == parts
    assert format_path(("models", "qwen2.5")) == 'models."qwen2.5"'
    assert parse_path("a.0.b") == ("a", 0, "b")
    assert parse_path("a[1][2].b") == ("a", 1, 2, "b")
    with pytest.raises(ValueError):
        parse_path("a..b")


# --------------------------------------------------------------------------- loading


def test_locations_of_keys_and_items(write):
    p = write("p.yaml", """
        a: 1
        b:
          c: x
          d:
            - 1
            - {e: 2}
        """)
    data, locs = load_config(p)
    assert data == {"a": 1, "b": {"c": "x", "d": [1, {"e": 2}]}}
    assert locs.at("a").line == 1
    assert locs.at("b.c").line == 3
    assert locs.at("b.d[0]").line == 5
    assert locs.at("b.d[1].e").line == 6
    assert locs.at("b.d[1].missing").line == 6  # nearest ancestor
    assert locs.at("a").file.endswith("p.yaml")


def test_duplicate_key_names_both_lines(write):
    p = write("p.yaml", """
        a: 1
        b: {x: 1}
        a: 2
        c: {x: 1, x: 2}
        """)
    with pytest.raises(UserError) as ei:
        load_config(p)
    msgs = [pr.format() for pr in problems_of(ei)]
    assert any(":3: a: duplicate key 'a' (first defined on line 1)" in m for m in msgs)
    assert any(":4: c.x: duplicate key 'x' (first defined on line 4)" in m for m in msgs)


@pytest.mark.parametrize("text", [
    "a: !!python/object/apply:os.system ['true']\n",
    "a: !custom 3\n",
    "a: !!set {x: null}\n",
    "a: !!binary aGVsbG8=\n",
])
def test_non_standard_tags_rejected(write, text):
    with pytest.raises(UserError) as ei:
        load_config(write("p.yaml", text))
    (pr,) = problems_of(ei)
    assert pr.line == 1 and pr.path == "a" and "unsupported YAML tag" in pr.message


def test_standard_tags_and_merge_keys(write):
    p = write("p.yaml", """
        defaults: &d {temperature: 0.7, top_p: 0.9}
        s: !!str 5
        sampling:
          <<: *d
          top_p: 0.5
        """)
    data, locs = load_config(p)
    assert data["s"] == "5"
    assert data["sampling"] == {"temperature": 0.7, "top_p": 0.5}
    assert locs.at("sampling.top_p").line == 5
    assert locs.at("sampling.temperature").line == 1  # where the merged value is written


def test_yaml_syntax_error_is_located(write):
    with pytest.raises(UserError) as ei:
        load_config(write("p.yaml", "a: 1\nb: [1, 2\nc: 3\n"))
    (pr,) = problems_of(ei)
    assert pr.line >= 2 and "invalid YAML" in pr.message


def test_top_level_must_be_mapping(write):
    with pytest.raises(UserError, match="must be a mapping"):
        load_config(write("p.yaml", "- a\n- b\n"))


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="file not found"):
        load_pipeline(tmp_path / "nope.yaml")


# --------------------------------------------------------------------------- include


def test_include_deep_merge_replaces_lists_and_keeps_locations(write):
    base = write("base/base.yaml", """
        name: base
        run: {seed: 1, batch_problems: 4}
        proposers:
          base:
            model: m
            pruners: [{kind: entropy}, {kind: gzip}]
        """)
    child = write("child.yaml", """
        include: base/base.yaml
        name: child
        run: {seed: 2}
        proposers:
          base:
            pruners: [{kind: gzip}]
        """)
    data, locs = load_config(child)
    assert "include" not in data
    assert data["name"] == "child"
    assert data["run"] == {"seed": 2, "batch_problems": 4}  # mappings merge
    assert data["proposers"]["base"] == {"model": "m", "pruners": [{"kind": "gzip"}]}  # lists replace
    assert locs.at("run.seed").file.endswith("child.yaml") and locs.at("run.seed").line == 3
    assert locs.at("run.batch_problems").file.endswith("base.yaml") and locs.at("run.batch_problems").line == 2
    assert locs.at("proposers.base.model").file.endswith("base.yaml")
    assert locs.at("proposers.base.pruners[0].kind").file.endswith("child.yaml")
    assert ("proposers", "base", "pruners", 1) not in locs
    assert base.exists()


def test_include_absolute_list_and_nested(write, tmp_path):
    a = write("x/a.yaml", "name: a\nrun: {seed: 1}\nlimits: {max_steps: 3}\n")
    b = write("y/b.yaml", "include: ../x/a.yaml\nrun: {seed: 2}\n")  # relative, nested
    c = write("z/c.yaml", f"include: [{b}, {a}]\nname: c\n")  # absolute, list: later wins
    data, locs = load_config(c)
    assert data == {"name": "c", "run": {"seed": 1}, "limits": {"max_steps": 3}}
    assert locs.at("run.seed").file.endswith("a.yaml")
    assert locs.at("name").file.endswith("c.yaml")


def test_include_cycle_lists_chain():
    with pytest.raises(UserError) as ei:
        load_config(DATA / "bad" / "cycle_a.yaml")
    (pr,) = problems_of(ei)
    assert re.search(r"include cycle: \S*cycle_a.yaml -> \S*cycle_b.yaml -> \S*cycle_a.yaml", pr.message)
    assert pr.file.endswith("cycle_b.yaml") and pr.line == 1 and pr.path == "include"


def test_self_include_and_missing_include(write):
    p = write("self.yaml", "include: [self.yaml, nope.yaml]\n")
    with pytest.raises(UserError) as ei:
        load_config(p)
    msgs = [pr.message for pr in problems_of(ei)]
    assert any(m.startswith("include cycle:") for m in msgs)
    assert any("included file not found" in m for m in msgs)
    assert [pr.path for pr in problems_of(ei)] == ["include[0]", "include[1]"]


def test_include_must_be_strings(write):
    with pytest.raises(UserError, match="must be a file name or a list of file names"):
        load_config(write("p.yaml", "include: {a: 1}\n"))


# --------------------------------------------------------------------------- overrides


def test_set_parses_yaml_values_and_creates_mappings():
    data = {"run": {"seed": 0}, "proposers": {"base": {"pruners": [{"kind": "gzip", "threshold": 0.2}]}}}
    from kvflow.config.loader import Locations

    locs = Locations()
    apply_overrides(data, locs, sets=[
        "run.seed=3", "proposers.base.pruners[0].threshold=0.5", "a.b={x: 1, y: [1, 2]}",
        "run.output=out dir", "dataset.limit=null",
    ])
    assert data["run"] == {"seed": 3, "output": "out dir"}
    assert data["proposers"]["base"]["pruners"][0]["threshold"] == 0.5
    assert data["a"] == {"b": {"x": 1, "y": [1, 2]}}
    assert data["dataset"] == {"limit": None}
    assert locs.at("a.b.y[1]") == ("<--set>", 0)
    assert locs.at("a") == ("<--set>", 0)


def test_set_empty_pruners_and_unset():
    loaded = load_pipeline(VALID, sets=["proposers.base.pruners=[]"], unsets=["proposers.helper"])
    assert loaded.resolved["proposers"]["base"]["pruners"] == []
    assert list(loaded.components.proposers) == ["base"]
    assert loaded.components.proposers["base"].pruners == []
    assert loaded.pipeline.proposers["base"].pruners == []


def test_unset_then_set_replaces_entry():
    loaded = load_pipeline(VALID, unsets=["proposers.base.evictor"], sets=["proposers.base.evictor.kind=none"])
    assert loaded.resolved["proposers"]["base"]["evictor"] == {"kind": "none"}


def test_unset_missing_key_did_you_mean():
    with pytest.raises(UserError) as ei:
        load_pipeline(VALID, unsets=["proposers.helpr", "run.nope.deeper"])
    a, b = problems_of(ei)
    assert a.format().startswith("--unset proposers.helpr: 'helpr' does not exist in proposers")
    assert "did you mean 'helper'?" in a.hint
    assert b.path == "run.nope.deeper"


def test_set_errors_are_located_on_the_command_line():
    with pytest.raises(UserError) as ei:
        load_pipeline(VALID, sets=["proposers.base.n=abc", "run.seed=[1"])
    msgs = [pr.format() for pr in problems_of(ei)]
    assert any(m.startswith("--set run.seed: value is not valid YAML") for m in msgs)
    with pytest.raises(UserError) as ei:
        load_pipeline(VALID, sets=["proposers.base.n=abc"])
    (pr,) = problems_of(ei)
    assert pr.format().startswith("--set proposers.base.n: input should be a valid integer")
    with pytest.raises(UserError, match="expected PATH=VALUE"):
        load_pipeline(VALID, sets=["run.seed"])
    with pytest.raises(UserError, match=r"name is a str, not a mapping"):
        load_pipeline(VALID, sets=["name.x=1"])


# --------------------------------------------------------------------------- validation


def test_valid_pipeline_resolves_components():
    loaded = load_pipeline(VALID)
    assert loaded.pipeline.name == "test_valid"
    comps = loaded.components
    assert list(comps.proposers) == ["base", "helper"]
    ev_cls, ev_params = comps.proposers["base"].evictor
    assert issubclass(ev_cls, Evictor) and ev_params.budget == 16
    assert [p.name for p in comps.proposers["base"].pruners] == ["entropy", "gzip"]
    name, cls, params = comps.proposers["base"].pruners[1]
    assert issubclass(cls, Pruner) and params.window == 64
    assert issubclass(comps.scorer.cls, Scorer) and comps.scorer.params.model == "helper"
    assert issubclass(comps.committer[0], Committer)
    assert "include" not in loaded.resolved
    assert re.fullmatch(r"[0-9a-f]{8}", loaded.hash)


def test_defaults_and_include_ablation():
    loaded = load_pipeline(DATA / "pipelines" / "best_of_n.yaml")
    assert loaded.pipeline.name == "test_best_of_n"
    assert loaded.components.proposers["base"].pruners == []
    assert loaded.resolved["proposers"]["base"]["evictor"]["kind"] == "random"
    assert loaded.resolved["scorer"] == {"kind": "random"}  # a new kind replaces the entry: no stale `model`
    loaded = load_pipeline(VALID, unsets=["proposers.helper.evictor", "scorer", "committer"])
    assert loaded.components.proposers["helper"].evictor.params.budget == 0  # default `none`
    assert loaded.pipeline.scorer.kind == "likelihood"


def test_duplicate_pruner_kinds_get_distinct_names():
    loaded = load_pipeline(VALID, sets=["proposers.base.pruners=[{kind: gzip, threshold: 0.2}, {kind: gzip, threshold: 0.3}]"])
    assert [p.name for p in loaded.components.proposers["base"].pruners] == ["gzip", "gzip_2"]


def test_config_hash():
    a = load_pipeline(VALID)
    assert a.hash == config_hash(dict(reversed(list(a.resolved.items()))))  # key order is irrelevant
    assert load_pipeline(VALID, sets=["run.seed=1"]).hash != a.hash


def test_unknown_field_did_you_mean_and_allowed():
    with pytest.raises(UserError) as ei:
        load_pipeline(DATA / "bad" / "unknown_field.yaml")
    (pr,) = problems_of(ei)
    assert (pr.line, pr.path, pr.message) == (4, "proposers.base.evcitor", "unknown field 'evcitor'")
    assert pr.hint.startswith("did you mean 'evictor'? allowed: model, n, sampling, evictor, pruners")


def test_unknown_kind_did_you_mean_and_installed():
    with pytest.raises(UserError) as ei:
        load_pipeline(DATA / "bad" / "unknown_kind.yaml")
    (pr,) = problems_of(ei)
    assert (pr.line, pr.path, pr.message) == (4, "proposers.base.evictor.kind", "unknown evictor 'randon'")
    assert pr.hint.startswith("did you mean 'random'? installed evictors:") and "none" in pr.hint


def test_all_problems_at_once_with_lines():
    with pytest.raises(UserError) as ei:
        load_pipeline(DATA / "bad" / "many_problems.yaml")
    got = {(pr.line, pr.path): pr for pr in problems_of(ei)}
    assert set(got) == {
        (3, "models.base.backend"), (3, "models.base.dtyp"), (6, "proposers.base.n"),
        (7, "proposers.base.pruners[0].windw"), (7, "proposers.base.pruners[1].window"), (8, "scorer.model"),
    }
    assert got[3, "models.base.backend"].message == "unknown backend 'tensorrt'"
    assert got[3, "models.base.backend"].hint.startswith("installed backends: hf")
    assert "did you mean 'dtype'?" in got[3, "models.base.dtyp"].hint
    assert got[6, "proposers.base.n"].message.startswith("input should be greater than or equal to 1")
    assert got[7, "proposers.base.pruners[1].window"].message.startswith("input should be a valid integer")
    assert got[8, "scorer.model"].message == "unknown model 'prm'"
    assert all(pr.file.endswith("many_problems.yaml") for pr in got.values())


def test_literal_hint_and_component_shape(write):
    p = write("p.yaml", f"""
        include: {VALID}
        models: {{base: {{dtype: bf16}}}}
        proposers: {{helper: {{evictor: none}}}}
        """)
    with pytest.raises(UserError) as ei:
        load_pipeline(p)
    a, b = problems_of(ei)
    assert a.message.startswith("must be one of 'bfloat16', 'float16', 'float32', 'auto'")
    assert b.path == "proposers.helper.evictor" and "{kind: NAME" in b.hint


def test_errors_in_included_file_point_there(write):
    write("base.yaml", VALID.read_text().replace("n: 2\n", "n: -1\n", 1))
    p = write("child.yaml", "include: base.yaml\nname: child\n")
    with pytest.raises(UserError) as ei:
        load_pipeline(p)
    (pr,) = problems_of(ei)
    assert pr.file.endswith("base.yaml") and pr.line == 12 and pr.path == "proposers.base.n"


def test_unknown_model_reference():
    with pytest.raises(UserError) as ei:
        load_pipeline(DATA / "bad" / "unknown_model.yaml")
    (pr,) = problems_of(ei)
    assert (pr.line, pr.path, pr.message) == (4, "proposers.helper.model", "unknown model 'helpr'")
    assert "did you mean 'helper'?" in pr.hint


def test_missing_required_and_empty_proposers(write):
    p = write("p.yaml", "kvflow: 1\nname: x\nmodels: {base: {backend: hf}}\nproposers: {}\n")
    with pytest.raises(UserError) as ei:
        load_pipeline(p)
    got = {pr.path: pr for pr in problems_of(ei)}
    assert got["models.base.id"].message == "missing required field 'id'" and got["models.base.id"].line == 3
    assert got["proposers"].message == "a pipeline needs at least one proposer"


def test_loaded_problem_helper():
    loaded = load_pipeline(VALID)
    pr = loaded.problem("proposers.base.evictor.budget", "too small", "raise it")
    assert pr.file.endswith("valid.yaml") and pr.line == 14


def test_aggregate_is_rejected_where_it_means_nothing(write):
    """Only a scorer that combines per-step scores (prm) takes `aggregate`; on likelihood, the
    judge or random it used to be accepted and ignored."""
    for kind in ("likelihood", "random"):
        p = write(f"{kind}.yaml", f"""
            kvflow: 1
            name: agg
            models: {{m: {{id: some/model}}}}
            proposers: {{base: {{model: m}}}}
            scorer: {{kind: {kind}, aggregate: min}}
            """)
        with pytest.raises(UserError) as ei:
            load_pipeline(p)
        assert any(pr.path == "scorer.aggregate" for pr in problems_of(ei)), kind
    p = write("prm.yaml", """
        kvflow: 1
        name: agg
        models: {m: {id: some/model}, prm: {id: some/prm}}
        proposers: {base: {model: m}}
        scorer: {kind: prm, model: prm, aggregate: min}
        """)
    assert load_pipeline(p).components.scorer.params.aggregate == "min"
