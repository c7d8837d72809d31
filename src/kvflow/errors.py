"""Errors a kvflow user sees (DESIGN.md §5): located config problems, user errors, plugin errors.

A `UserError` is anything the user can fix (a bad pipeline file, a bad `--set`, a missing
dataset...). The CLI prints it without a traceback and exits with code 2. It carries every
problem found, so one run of `kvflow validate` reports them all at once::

    pipelines/x.yaml:12: proposers.base.evictor.budgt: unknown field 'budgt'
      hint: did you mean 'budget'? allowed: budget, buffer, window, protect_prompt

A `PluginError` is a broken plugin under `--strict-plugins` (or a registry conflict); the
CLI exits with code 4.

Any other exception is a crash, and `kvflow.faults.crash_report` says whose: a plugin's
component that raised, or returned what its method may not, is named with its plugin's
distribution and version and the method (exit code 5); anything else is kvflow's own internal
error (exit code 1). Either way the traceback goes to a file.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

#: exit codes of the CLI
EXIT_USER_ERROR = 2
EXIT_PLUGIN_ERROR = 4
EXIT_PLUGIN_FAULT = 5  # a plugin's component failed at run time (kvflow.faults)
EXIT_INTERNAL_ERROR = 1
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a configuration, with where it is.

    `file` is a path, or a pseudo-file such as ``<--set>`` / ``<--unset>`` (then `line` is 0).
    `line` is 1-based; 0 means "no line". `path` is the dotted path into the pipeline,
    e.g. ``proposers.base.pruners[0].threshold`` ("" for the whole file).
    """

    file: str
    line: int
    path: str
    message: str
    hint: Optional[str] = None

    def format(self) -> str:
        if self.file.startswith("<") and self.file.endswith(">"):
            # command-line overrides: "--set proposers.base.n: message"
            where = self.file[1:-1] + (f" {self.path}" if self.path else "")
        else:
            where = f"{self.file}:{self.line}" if self.line else self.file
            if self.path:
                where += f": {self.path}"
        text = f"{where}: {self.message}" if where else f"error: {self.message}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text

    def __str__(self) -> str:
        return self.format()


class KvflowError(Exception):
    """Base of kvflow's own exceptions."""

    exit_code = 1


class EngineError(KvflowError):
    """An engine in a process of its own (SGLang's, vLLM's worker) failed, exited or refused a request."""


class UserError(KvflowError):
    """Something the user can fix. Holds one or more `ConfigProblem`s.

    ``UserError("message", hint="...")`` is the short form for problems without a file.
    """

    exit_code = EXIT_USER_ERROR

    def __init__(
        self,
        problems: Union[str, ConfigProblem, Iterable[ConfigProblem]],
        hint: Optional[str] = None,
    ) -> None:
        if isinstance(problems, str):
            problems = [ConfigProblem("", 0, "", problems, hint)]
        elif isinstance(problems, ConfigProblem):
            problems = [problems]
        self.problems: list[ConfigProblem] = list(problems)
        super().__init__(self.format())

    def format(self) -> str:
        return "\n".join(p.format() for p in self.problems)


class EngineSettingError(KvflowError):
    """An engine cannot run under a setting of a model entry, found only once the engine
    started (what SGLang resolved for the device, say). `field` is under the model entry
    (``engine.page_size``); `kvflow run` reports it as ``models.<key>.<field>``, exit code 2."""

    exit_code = EXIT_USER_ERROR

    def __init__(self, field: str, message: str, hint: Optional[str] = None) -> None:
        self.field, self.message, self.hint = field, message, hint
        super().__init__(f"{field}: {message}")


class PluginError(KvflowError):
    """A plugin failed to load (fatal under `--strict-plugins`), or two plugins conflict."""

    exit_code = EXIT_PLUGIN_ERROR


class ComponentImportError(PluginError):
    """A registered component's lazy ``"module:Class"`` target could not be imported."""


def did_you_mean(word: str, choices: Sequence[str], what: str = "allowed") -> str:
    """Hint text: "did you mean 'x'? allowed: a, b, c" (the first part only when close)."""
    choices = [str(c) for c in choices]
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    listing = ", ".join(choices) if choices else "(none)"
    tail = f"{what}: {listing}"
    return f"did you mean '{close[0]}'? {tail}" if close else tail


def unknown_component_hint(kind: str, name: str, installed: Sequence[str]) -> str:
    """Hint for a component name that no loaded plugin registers (`kind` is plural, e.g.
    "evictors"): a close installed name, the installed names, and the usual cause."""
    return (f"{did_you_mean(name, installed, f'installed {kind}')}; is the plugin that provides "
            f"'{name}' installed (and not skipped by KVFLOW_DISABLE_PLUGINS)? `kvflow plugins` lists installed plugins")
