"""The `kvflow` CLI: validate, ls, plugins, run; exit codes; broken plugins; no heavy imports."""

from __future__ import annotations

import json
import sys
import types

import pytest
from conftest import DATA, VALID, make_dist, run_kvflow

from kvflow.errors import UserError

BAD = DATA / "bad"


def test_help(cli):
    r = cli("--help")
    assert r.exit_code == 0
    for cmd in ("validate", "ls", "plugins", "run"):
        assert cmd in r.stdout


def test_validate_ok(cli):
    r = cli("validate", VALID, DATA / "pipelines" / "best_of_n.yaml")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == [f"ok: {VALID}", f"ok: {DATA / 'pipelines' / 'best_of_n.yaml'}"]


@pytest.mark.parametrize("name, expected", [
    ("unknown_field.yaml", [
        "unknown_field.yaml:4: proposers.base.evcitor: unknown field 'evcitor'",
        "  hint: did you mean 'evictor'? allowed: model, n, sampling, evictor, pruners",
    ]),
    ("unknown_kind.yaml", [
        "unknown_kind.yaml:4: proposers.base.evictor.kind: unknown evictor 'randon'",
        "  hint: did you mean 'random'? installed evictors: ",
    ]),
    ("wrong_type.yaml", [
        "wrong_type.yaml:4: proposers.base.n: input should be a valid integer, unable to parse string as an integer (got 'many')",
    ]),
    ("cycle_a.yaml", ["cycle_b.yaml:1: include: include cycle: ", "cycle_a.yaml -> ", "cycle_b.yaml -> "]),
    ("duplicate_key.yaml", ["duplicate_key.yaml:7: name: duplicate key 'name' (first defined on line 2)"]),
    ("unknown_model.yaml", [
        "unknown_model.yaml:4: proposers.helper.model: unknown model 'helpr'",
        "  hint: did you mean 'helper'? models defined in `models`: base, helper",
    ]),
    ("bad_tag.yaml", ["bad_tag.yaml:2: name: unsupported YAML tag '!!python/object/apply:os.system'"]),
])
def test_validate_bad_files(cli, name, expected):
    r = cli("validate", BAD / name)
    assert r.exit_code == 2
    assert r.stdout == ""
    for text in expected:
        assert text in r.stderr, r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_validate_reports_every_file_and_every_problem(cli):
    r = cli("validate", BAD / "many_problems.yaml", VALID)
    assert r.exit_code == 2
    assert f"ok: {VALID}" in r.stdout
    assert len([line for line in r.stderr.splitlines() if "many_problems.yaml:" in line]) == 6


def test_set_and_unset(cli):
    r = cli("validate", VALID, "--set", "proposers.base.pruners=[]", "--set", "run.seed=3", "--unset", "proposers.helper")
    assert r.exit_code == 0, r.stderr
    r = cli("validate", VALID, "-s", "proposers.base.n=abc", "--unset", "proposers.helpr")
    assert r.exit_code == 2
    assert "--set proposers.base.n: input should be a valid integer" in r.stderr
    assert "--unset proposers.helpr: 'helpr' does not exist in proposers" in r.stderr
    assert "did you mean 'helper'?" in r.stderr


def test_ls_components(cli):
    r = cli("ls", "evictors")
    assert r.exit_code == 0, r.stderr
    assert "none" in r.stdout and "random" in r.stdout and "budget=" in r.stdout
    r = cli("ls")
    assert r.exit_code == 0
    for word in ("evictors", "pruners", "scorers", "committers", "entropy", "gzip", "likelihood", "best"):
        assert word in r.stdout
    assert cli("ls", "nonsense").exit_code == 2


def test_ls_pipelines(cli, write, monkeypatch, tmp_path):
    write("pipelines/a.yaml", "name: alpha\ndescription: first one\n")
    write("pipelines/sub/b.yaml", "include: ../a.yaml\nname: beta\n")
    write("pipelines/broken.yaml", "name: [\n")
    monkeypatch.chdir(tmp_path)
    r = cli("ls", "pipelines")
    assert r.exit_code == 0, r.stderr
    assert "alpha" in r.stdout and "first one" in r.stdout and "beta" in r.stdout and "invalid" in r.stdout


def test_plugins(cli):
    r = cli("plugins", "--json")
    assert r.exit_code == 0, r.stderr
    plugins = {p["name"]: p for p in json.loads(r.stdout)}
    assert plugins["builtin"]["status"] == "ok" and "none" in plugins["builtin"]["registered"]["evictors"]
    r = cli("plugins")
    assert r.exit_code == 0 and "builtin" in r.stdout


# --------------------------------------------------------------------------- run


@pytest.fixture
def fake_runner(monkeypatch):
    """Install a fake kvflow.runtime.runner whose run_pipeline does what the test says."""
    calls = []
    mod = types.ModuleType("kvflow.runtime.runner")

    def run_pipeline(loaded, force=False):
        calls.append((loaded, force))
        return mod.behaviour(loaded)

    mod.run_pipeline = run_pipeline
    mod.behaviour = lambda loaded: 0
    monkeypatch.setitem(sys.modules, "kvflow.runtime.runner", mod)
    return mod, calls


def test_run_calls_runner(cli, fake_runner):
    mod, calls = fake_runner
    r = cli("run", VALID, "--set", "run.seed=5", "--force")
    assert r.exit_code == 0, r.stderr
    (loaded, force), = calls
    assert force is True and loaded.pipeline.run.seed == 5
    mod.behaviour = lambda loaded: 3
    assert cli("run", VALID).exit_code == 3


def test_run_errors_and_interrupt(cli, fake_runner):
    mod, calls = fake_runner
    r = cli("run", BAD / "unknown_kind.yaml")
    assert r.exit_code == 2 and not calls and "unknown evictor" in r.stderr

    def user_error(loaded):
        raise UserError("dataset 'nope' not found", hint="try gsm8k")

    mod.behaviour = user_error
    r = cli("run", VALID)
    assert r.exit_code == 2 and "error: dataset 'nope' not found\n  hint: try gsm8k" in r.stderr
    assert "Traceback" not in r.stderr

    def interrupt(loaded):
        raise KeyboardInterrupt

    mod.behaviour = interrupt
    r = cli("run", VALID)
    assert r.exit_code == 130 and "interrupted" in r.stderr


# --------------------------------------------------------------------------- subprocess


@pytest.mark.parametrize("args", [["--help"], ["validate", str(VALID)], ["ls"], ["plugins"]])
def test_no_heavy_imports(args):
    r = run_kvflow(*args, check_no_torch=True)
    assert r.returncode == 0, r.stderr


@pytest.fixture
def broken_site(tmp_path):
    return make_dist(tmp_path / "site", "kvflow-broken", {"broken": "kvflow_broken_plugin"},
                     {"kvflow_broken_plugin": "raise ImportError('kaboom: needs a missing library')\n"})


def test_broken_plugin_does_not_take_cli_down(broken_site):
    r = run_kvflow("--help", pythonpath=broken_site)
    assert r.returncode == 0 and "validate" in r.stdout
    for args in (["plugins"], ["validate", str(VALID)]):
        r = run_kvflow(*args, pythonpath=broken_site)
        assert r.returncode == 0, r.stderr
        assert "warning: plugin 'broken' (distribution kvflow-broken 0.1)" in r.stderr
        assert "entry point broken = kvflow_broken_plugin" in r.stderr
        assert "ImportError: kaboom" in r.stderr
    r = run_kvflow("plugins", "--json", pythonpath=broken_site)
    statuses = {p["name"]: p["status"] for p in json.loads(r.stdout)}
    assert statuses["broken"] == "failed" and statuses["builtin"] == "ok"  # (and any installed examples)


def test_strict_plugins_exit_4(broken_site):
    r = run_kvflow("--strict-plugins", "validate", str(VALID), pythonpath=broken_site)
    assert r.returncode == 4 and "kaboom" in r.stderr and "Traceback" not in r.stderr
    r = run_kvflow("validate", str(VALID), pythonpath=broken_site, env={"KVFLOW_STRICT_PLUGINS": "1"})
    assert r.returncode == 4
    r = run_kvflow("validate", str(VALID), pythonpath=broken_site, env={"KVFLOW_DISABLE_PLUGINS": "broken"})
    assert r.returncode == 0 and "warning" not in r.stderr


def test_duplicate_component_across_distributions(tmp_path):
    site = make_dist(tmp_path / "site", "kvflow-dupe", {"dupe": "kvflow_dupe_plugin"}, {"kvflow_dupe_plugin": """
        import kvflow

        @kvflow.hookimpl
        def register_evictors(register):
            register("random", "kvflow_dupe_plugin:Other")
        """})
    r = run_kvflow("validate", str(VALID), pythonpath=site)
    assert r.returncode == 4
    assert "duplicate evictor name 'random'" in r.stderr
    assert "'builtin' (distribution kvflow" in r.stderr and "'dupe' (distribution kvflow-dupe 0.1)" in r.stderr
    r = run_kvflow("validate", str(VALID), pythonpath=site, env={"KVFLOW_DISABLE_PLUGINS": "dupe"})
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("bits", ["5", "4,x", ","])
def test_calibrate_bits_refuses_a_bit_width_it_cannot_use(cli, bits):
    """Checked before anything runs (exit 2 naming --bits): the quick tier's test of
    kvflow.tools.calibrate_bits (its end-to-end run is tests/test_breadthkv_e2e.py)."""
    r = cli("calibrate-bits", VALID, "--bits", bits)
    assert r.exit_code == 2 and f"--bits {bits}:" in r.stderr and "Traceback" not in r.output
