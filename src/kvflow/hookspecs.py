"""Plugin hook specifications.

A plugin is a module (or object) named by an entry point in the group ``kvflow``, with
functions decorated by ``kvflow.hookimpl`` and named after the hooks below. Each hook is
called once, when the registry is first built (the first time a command needs component
names), with a ``register`` callable::

    # my_plugin.py, entry point:  [project.entry-points.kvflow]  tova = "my_plugin"
    import kvflow

    @kvflow.hookimpl
    def register_evictors(register):
        register("tova", "my_plugin.tova:TovaEvictor")

``register(name, target)`` takes a component name (what YAML's ``kind:`` says) and either
the class itself or a lazy ``"module:Class"`` string, imported only when the component is
used or its parameters are validated. Built-in components register through these same hooks.
"""

from __future__ import annotations

from typing import Callable, Union

import pluggy

PROJECT = "kvflow"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[[str, Union[type, str]], None]


@hookspec
def register_evictors(register: Register) -> None:
    """Register KV eviction methods (subclasses of `kvflow.components.Evictor`).

    Called once when the registry is built. Example::

        register("streaming", "kvflow_builtin.evictors.streaming:StreamingEvictor")

    Added in kvflow 0.1.
    """


@hookspec
def register_pruners(register: Register) -> None:
    """Register online degeneration detectors (subclasses of `kvflow.components.Pruner`).

    Called once when the registry is built. Example::

        register("ngram", "my_plugin:NgramRepetitionPruner")

    Added in kvflow 0.1.
    """


@hookspec
def register_scorers(register: Register) -> None:
    """Register candidate scorers (subclasses of `kvflow.components.Scorer`).

    Called once when the registry is built. Example::

        register("length", "my_plugin:LengthScorer")

    Added in kvflow 0.1.
    """


@hookspec
def register_committers(register: Register) -> None:
    """Register committers (subclasses of `kvflow.components.Committer`).

    Called once when the registry is built. Example::

        register("margin", "my_plugin:MarginCommitter")

    Added in kvflow 0.1.
    """


@hookspec
def register_backends(register: Register) -> None:
    """Register inference backends (what a model entry's ``backend:`` names).

    Called once when the registry is built. A backend is a class with two static methods:
    ``check(model_cfg) -> str | None`` (loads nothing: None if the model can be loaded here,
    else a sentence saying why not; `kvflow run` calls it before anything loads) and
    ``load(model_cfg) -> Engine``, one engine per loaded model, implementing
    `kvflow.components.engine.Engine` (start, submit, step, sync, release, ...). A backend
    whose ``load`` also takes an ``evicting`` keyword is told whether an evicted proposer
    runs on the model, and one whose ``load`` takes ``evictors`` (added in kvflow 0.1, optional) gets the
    (class, params) pair of every evictor the pipeline serves on it (SGLang builds its decode
    hook from them); an engine may offer
    ``settings() -> dict``, what it resolved on this machine, recorded in ``manifest.json``
    (``engine_settings``). The engine contract suite `kvflow.testing.engine_contract`
    checks an implementation. Example::

        register("hf", "kvflow.backends.hf:HFBackend")

    ``check``, ``load`` and the Engine protocol, its optional members included, are part of
    the hook as of 0.1 (docs/plugins.md, "Versions").

    Added in kvflow 0.1.
    """


#: the component kinds, in the order `kvflow ls` shows them, and their hooks
KINDS = {
    "evictors": "register_evictors",
    "pruners": "register_pruners",
    "scorers": "register_scorers",
    "committers": "register_committers",
    "backends": "register_backends",
}
