"""Plugin registry: registration, lazy targets, conflicts, broken plugins, entry points."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import make_dist
from pydantic import Field

import kvflow
from kvflow.components.base import Committer, CommitterParams, Evictor, EvictorParams
from kvflow.errors import ComponentImportError, PluginError, UserError
from kvflow.registry import KINDS, Registry, get_registry, set_registry


class WindowParams(EvictorParams):
    stride: int = Field(2, ge=1)
    mode: str  # required


class WindowEvictor(Evictor):
    """Keeps every `stride`-th token.

    More text that `info` must not show.
    """

    Params = WindowParams


class PickFirst(Committer):
    """Always the first candidate."""

    Params = CommitterParams


class GoodPlugin:
    @kvflow.hookimpl
    def register_evictors(self, register):
        register("window", WindowEvictor)
        register("lazy", "kvflow.components.base:Evictor")

    @kvflow.hookimpl
    def register_committers(self, register):
        register("first", PickFirst)


class OtherPlugin:
    @kvflow.hookimpl
    def register_evictors(self, register):
        register("window", "elsewhere:Window")


class RaisingPlugin:
    @kvflow.hookimpl
    def register_pruners(self, register):
        register("ok_before_raise", "x:Y")
        raise RuntimeError("hook exploded")


class BadTargetPlugin:
    @kvflow.hookimpl
    def register_scorers(self, register):
        register("missing", "kvflow_no_such_module_xyz:Scorer")


def test_names_get_info():
    reg = Registry.from_plugins([("good", GoodPlugin())])
    assert reg.names("evictors") == ["lazy", "window"]
    assert reg.names("committers") == ["first"]
    assert reg.names("pruners") == []
    assert reg.get("evictors", "window") is WindowEvictor
    assert reg.get("evictors", "lazy") is Evictor  # "module:Class" imported on demand
    info = reg.info("evictors", "window")
    assert info.plugin == "good" and info.description == "Keeps every `stride`-th token."
    assert info.target == f"{__name__}:WindowEvictor"
    assert info.defaults["stride"] == 2 and info.defaults["mode"] == "<required>" and info.defaults["budget"] == 64
    (p,) = reg.plugins()
    assert (p.name, p.status, p.registered) == ("good", "ok", {"evictors": ["window", "lazy"], "committers": ["first"]})
    assert set(KINDS) == {"evictors", "pruners", "scorers", "committers", "backends"}


def test_unknown_name_and_kind():
    reg = Registry.from_plugins([GoodPlugin()])
    with pytest.raises(UserError) as ei:
        reg.get("evictors", "windw")
    assert "unknown evictor 'windw'" in str(ei.value) and "did you mean 'window'?" in str(ei.value)
    with pytest.raises(ValueError, match="unknown component kind"):
        reg.names("evictor")


def test_lazy_target_import_failure_is_clear():
    reg = Registry.from_plugins([("badtarget", BadTargetPlugin())])
    with pytest.raises(ComponentImportError) as ei:
        reg.get("scorers", "missing")
    msg = str(ei.value)
    assert "kvflow_no_such_module_xyz:Scorer" in msg and "'badtarget'" in msg and "ModuleNotFoundError" in msg
    info = reg.info("scorers", "missing")
    assert info.error and "ModuleNotFoundError" in info.error


def test_duplicate_name_names_both_plugins():
    with pytest.raises(PluginError) as ei:
        Registry.from_plugins([("good", GoodPlugin()), ("other", OtherPlugin())])
    msg = str(ei.value)
    assert "duplicate evictor name 'window'" in msg and "'good'" in msg and "'other'" in msg


def test_raising_hook_is_a_warning_then_strict_error(capsys):
    reg = Registry.from_plugins([("good", GoodPlugin()), ("raiser", RaisingPlugin())])
    assert reg.names("pruners") == []  # rolled back
    failed = {p.name: p for p in reg.plugins() if p.status == "failed"}
    assert list(failed) == ["raiser"] and "hook exploded" in failed["raiser"].error
    err = capsys.readouterr().err
    assert "warning: plugin 'raiser'" in err and "RuntimeError: hook exploded" in err
    with pytest.raises(PluginError, match="hook exploded"):
        Registry.from_plugins([("raiser", RaisingPlugin())], strict=True)


def test_invalid_registration_and_unknown_hook(capsys):
    class BadName:
        @kvflow.hookimpl
        def register_evictors(self, register):
            register("has space", WindowEvictor)

    class Typo:
        @kvflow.hookimpl
        def register_evictorz(self, register):
            pass

    reg = Registry.from_plugins([("badname", BadName()), ("typo", Typo())])
    errors = {p.name: p.error for p in reg.plugins()}
    assert "invalid evictor name" in errors["badname"]
    assert "register_evictorz" in errors["typo"]


def test_builtins_registered_through_entry_point():
    reg = Registry.from_entry_points(disabled=[])
    builtin = {p.name: p for p in reg.plugins()}["builtin"]
    assert builtin.distribution == "kvflow" and builtin.status == "ok"
    for kind, name in [("evictors", "none"), ("evictors", "random"), ("pruners", "entropy"), ("pruners", "gzip"),
                       ("scorers", "likelihood"), ("scorers", "random"), ("committers", "best")]:
        assert name in reg.names(kind)
    without = Registry.from_entry_points(disabled=["builtin"])  # other installed plugins may stay
    assert not set(without.names("evictors")) & set(builtin.registered["evictors"])


def test_get_registry_is_cached_and_strict_rechecks(capsys):
    reg = get_registry()
    assert get_registry() is reg
    set_registry(Registry.from_plugins([("raiser", RaisingPlugin())]))
    assert get_registry().failures()
    with pytest.raises(PluginError):
        get_registry(strict=True)


# --------------------------------------------------------------------------- entry points


BROKEN = {"kvflow_broken_plugin": "raise ImportError('kaboom: missing dependency')\n"}


def _registry_report(tmp_path, env=None):
    make_dist(tmp_path / "site", "kvflow-broken", {"broken": "kvflow_broken_plugin"}, BROKEN)
    code = (
        "import json, sys\nfrom kvflow.registry import Registry, strict_from_env\n"
        "reg = Registry.from_entry_points(strict=strict_from_env())\n"
        "print(json.dumps({p.name: p.status for p in reg.plugins()}))\n"
    )
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    full_env["PYTHONPATH"] = str(tmp_path / "site")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=60)


def test_broken_entry_point_warns_naming_dist_entry_point_and_exception(tmp_path):
    r = _registry_report(tmp_path)
    assert r.returncode == 0, r.stderr
    statuses = json.loads(r.stdout)  # (installed example plugins may be listed too)
    assert statuses["broken"] == "failed" and statuses["builtin"] == "ok"
    assert "plugin 'broken' (distribution kvflow-broken 0.1)" in r.stderr
    assert "entry point broken = kvflow_broken_plugin" in r.stderr
    assert "ImportError: kaboom: missing dependency" in r.stderr


def test_disable_and_strict_env(tmp_path):
    r = _registry_report(tmp_path, {"KVFLOW_DISABLE_PLUGINS": "other, broken"})
    assert r.returncode == 0 and r.stderr == ""
    assert json.loads(r.stdout)["broken"] == "disabled"
    r = _registry_report(tmp_path, {"KVFLOW_STRICT_PLUGINS": "1"})
    assert r.returncode != 0 and "PluginError" in r.stderr and "kaboom" in r.stderr
