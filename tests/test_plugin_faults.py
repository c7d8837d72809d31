"""A plugin component that fails at run time is named (issue 34, 4): the component's kind and
name, its plugin's distribution and version, the method kvflow called and what went wrong,
exit code 5 (kvflow's own internal errors keep 1), the traceback saved to a file.

One faulty component per kind, in a real installed distribution (a dist-info with an entry
point), run through `kvflow run` on the tiny models: two raise inside their method (the
evictor, the committer), two return what their method may not (the pruner a list, the scorer
one score too few, which kvflow's `zip` used to drop silently)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import make_dist

from kvflow.errors import EXIT_PLUGIN_FAULT
from kvflow.testing import tiny_pipeline

PLUGIN = '''
import kvflow
from kvflow.components import Committer, Evictor, Pruner, PrunerParams, Scorer


@kvflow.hookimpl
def register_evictors(register):
    register("bad-evictor", "kvflow_faulty_plugin:BadEvictor")


@kvflow.hookimpl
def register_pruners(register):
    register("bad-pruner", "kvflow_faulty_plugin:BadPruner")


@kvflow.hookimpl
def register_scorers(register):
    register("bad-scorer", "kvflow_faulty_plugin:BadScorer")


@kvflow.hookimpl
def register_committers(register):
    register("bad-committer", "kvflow_faulty_plugin:BadCommitter")


def _lookup(table, key):
    return table[key]


class BadEvictor(Evictor):
    """Raises when it scores."""

    def score(self, keys, values, queries, **kwargs):
        raise ValueError(f"cannot score {keys.shape[2]} tokens")


class BadPruner(Pruner):
    """Returns a list."""

    def check(self, trace):
        return [False] * len(trace.texts)


class BadScorer(Scorer):
    """One score too few."""

    def score(self, requests):
        return [1.0] * (len(requests) - 1)


class BadCommitter(Committer):
    """Raises inside a helper of its own."""

    def pick(self, candidates):
        return _lookup({}, candidates[0].source)
'''

CASES = {
    "evictor": ({"evictor": {"kind": "bad-evictor", "budget": 8, "buffer": 4, "window": 2}},
                "evictor 'bad-evictor'", "score()", r"raised ValueError: cannot score \d+ tokens"),
    "pruner": ({"pruners": [{"kind": "bad-pruner", "threshold": 1, "min_tokens": 0}]},
               "pruner 'bad-pruner'", "check()", r"returned list, expected a bool tensor of shape \[\d+\]"),
    "scorer": ({"scorer": {"kind": "bad-scorer"}},
               "scorer 'bad-scorer'", "score()", r"returned \d+ scores for \d+ requests, expected a list of"),
    "committer": ({"committer": {"kind": "bad-committer"}},
                  "committer 'bad-committer'", "pick()", r"raised KeyError: 'base'"),
}


@pytest.fixture
def faulty_plugin(tmp_path, monkeypatch):
    site = make_dist(tmp_path / "site", "kvflow-faulty", {"faulty": "kvflow_faulty_plugin"},
                     {"kvflow_faulty_plugin": PLUGIN})
    monkeypatch.syspath_prepend(str(site))
    from kvflow.registry import set_registry

    set_registry(None)  # the CLI builds it again, from the entry points now on the path
    return site


@pytest.mark.parametrize("kind", list(CASES))
def test_a_faulty_plugin_component_is_named_with_its_distribution_method_and_fault(kind, tmp_path, cli,
                                                                                    faulty_plugin, monkeypatch):
    overrides, who, method, what = CASES[kind]
    monkeypatch.setenv("KVFLOW_CACHE", str(tmp_path / "cache"))
    path = tiny_pipeline(tmp_path, problems=1, n=2, max_step_tokens=12, **overrides)
    result = cli("run", path)
    assert result.exit_code == EXIT_PLUGIN_FAULT, result.output
    assert "Traceback" not in result.output and "internal error" not in result.stderr
    first, second = result.stderr.strip().splitlines()[-2:]
    assert first.startswith(f"kvflow: plugin fault: {who} of plugin 'faulty' (distribution kvflow-faulty 0.1) "
                            f"failed in {method}: "), first
    assert re.search(what, first), first
    assert "kvflow-faulty 0.1" in second and "not of kvflow" in second, second
    saved = Path(second.split("the traceback is in ")[1].split(";")[0])
    assert saved.is_file() and "Traceback" in saved.read_text()


def test_a_builtin_components_fault_stays_an_internal_error_and_names_it(tmp_path, cli, monkeypatch):
    """kvflow's own components are kvflow's: exit code 1, 'internal error', the component named."""
    from kvflow_builtin.committers import best

    def broken(self, candidates):
        return "first"

    monkeypatch.setattr(best.BestCommitter, "pick", broken)
    from kvflow.faults import guard

    guard(best.BestCommitter, "Committer")
    monkeypatch.setenv("KVFLOW_CACHE", str(tmp_path / "cache"))
    result = cli("run", tiny_pipeline(tmp_path, problems=1, n=2, max_step_tokens=12))
    assert result.exit_code == 1, result.output
    assert "kvflow: internal error: committer 'best' of plugin 'builtin'" in result.stderr, result.stderr
    assert "returned str ('first'), not an int index into its" in result.stderr
