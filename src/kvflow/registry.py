"""The plugin registry (DESIGN.md §4): which evictors, pruners, scorers, ... are installed.

Plugins are modules named by entry points of the group ``kvflow`` (built-ins included, under
the entry point ``builtin``). Each entry point is loaded here one by one, so that a plugin
which fails to import only costs a warning on stderr (naming the distribution, the entry
point and the exception) instead of taking the CLI down. Strict mode (``--strict-plugins``
or ``KVFLOW_STRICT_PLUGINS=1``) turns such failures into a `PluginError` (CLI exit code 4).
``KVFLOW_DISABLE_PLUGINS=name,...`` skips entry points by name.

Loaded plugin modules go into a pluggy PluginManager; each plugin's ``register_*`` hooks are
called with a ``register(name, target)`` bound to that plugin, so the registry knows who
registered what and can name both plugins when a component name is taken twice.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Iterable, Optional, Union

import pluggy

from kvflow import hookspecs
from kvflow.errors import ComponentImportError, PluginError, UserError, unknown_component_hint

ENTRY_POINT_GROUP = "kvflow"
KINDS = tuple(hookspecs.KINDS)
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


@dataclass
class PluginInfo:
    """One plugin: an entry point (or an object given to `Registry.from_plugins`)."""

    name: str
    distribution: Optional[str] = None
    version: Optional[str] = None
    entry_point: Optional[str] = None  # "name = module" as declared
    status: str = "ok"  # ok | failed | disabled
    error: Optional[str] = None
    registered: dict[str, list[str]] = field(default_factory=dict)  # kind -> names

    @property
    def label(self) -> str:
        """How messages name the plugin: ``'tova' (distribution kvflow-tova 0.2)``."""
        if self.distribution:
            dist = f"{self.distribution} {self.version}" if self.version else self.distribution
            return f"'{self.name}' (distribution {dist})"
        return f"'{self.name}'"


@dataclass
class _Entry:
    kind: str
    name: str
    target: Union[type, str]
    plugin: PluginInfo
    cls: Optional[type] = None


@dataclass
class ComponentInfo:
    kind: str
    name: str
    plugin: str
    distribution: Optional[str]
    target: str
    description: str
    defaults: dict[str, Any]  # Params field -> default ("<required>" when it has none)
    error: Optional[str] = None  # set when the target could not be imported


def _target_str(target: Union[type, str]) -> str:
    if isinstance(target, str):
        return target
    return f"{target.__module__}:{target.__qualname__}"


def _import_target(target: str) -> Any:
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ValueError(f"target {target!r} is not of the form 'module:Class'")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def params_defaults(cls: type) -> dict[str, Any]:
    """Field defaults of a component's `Params` model (``"<required>"`` for required fields)."""
    params = getattr(cls, "Params", None)
    fields = getattr(params, "model_fields", None) or {}
    out: dict[str, Any] = {}
    for name, f in fields.items():
        out[name] = "<required>" if f.is_required() else f.get_default(call_default_factory=True)
    return out


def _first_doc_line(cls: type) -> str:
    doc = (cls.__doc__ or "").strip()
    return doc.splitlines()[0].strip() if doc else ""


def _ep(info: PluginInfo) -> str:
    return f" [entry point {info.entry_point}]" if info.entry_point else ""


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Registry:
    """Installed components by kind. Build with `from_entry_points()` (what the CLI does, via
    `get_registry()`) or `from_plugins([...])` (tests: plugin modules/objects, no entry points)."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._entries: dict[str, dict[str, _Entry]] = {k: {} for k in KINDS}
        self._plugins: list[PluginInfo] = []

    # ------------------------------------------------------------------ building

    @classmethod
    def from_entry_points(
        cls,
        *,
        strict: bool = False,
        disabled: Optional[Iterable[str]] = None,
        group: str = ENTRY_POINT_GROUP,
    ) -> "Registry":
        if disabled is None:
            disabled = [n.strip() for n in os.environ.get("KVFLOW_DISABLE_PLUGINS", "").split(",") if n.strip()]
        disabled = set(disabled)
        reg = cls()
        for ep in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
            dist = getattr(ep, "dist", None)
            info = PluginInfo(
                name=ep.name,
                distribution=dist.metadata["Name"] if dist is not None else None,
                version=dist.version if dist is not None else None,
                entry_point=f"{ep.name} = {ep.value}",
            )
            if ep.name in disabled:
                info.status = "disabled"
                reg._plugins.append(info)
                continue
            try:
                obj = ep.load()
            except Exception as e:  # noqa: BLE001 - any import failure is the plugin's, not ours
                reg._fail(info, f"failed to import: {_describe(e)}")
                continue
            reg._add(obj, info)
        reg._finish(strict)
        return reg

    @classmethod
    def from_plugins(cls, plugins: Iterable[Any], *, strict: bool = False) -> "Registry":
        """A registry of the given plugin modules/objects (or ``(name, obj)`` pairs)."""
        reg = cls()
        for p in plugins:
            name, obj = p if isinstance(p, tuple) else (getattr(p, "__name__", type(p).__name__), p)
            reg._add(obj, PluginInfo(name=name))
        reg._finish(strict)
        return reg

    def _fail(self, info: PluginInfo, error: str) -> None:
        info.status, info.error = "failed", error
        self._plugins.append(info)

    def _add(self, obj: Any, info: PluginInfo) -> None:
        """Register one plugin object and run its hooks; a failure rolls it back."""
        try:
            self.pm.register(obj, name=info.name)
            self.pm.check_pending()  # hookimpls named after no hookspec (typos)
        except Exception as e:  # noqa: BLE001
            if self.pm.is_registered(obj):
                self.pm.unregister(obj)
            self._fail(info, f"invalid plugin: {_describe(e)}")
            return
        added: list[_Entry] = []
        others = [p for p in self.pm.get_plugins() if p is not obj]
        try:
            for kind, hook in hookspecs.KINDS.items():
                caller = self.pm.subset_hook_caller(hook, remove_plugins=others)
                caller(register=lambda name, target, _k=kind: added.append(self._register(_k, name, target, info)))
        except PluginError:
            raise  # a name conflict is an error whatever the mode
        except Exception as e:  # noqa: BLE001
            for entry in added:
                del self._entries[entry.kind][entry.name]
            self.pm.unregister(obj)
            info.registered = {}
            self._fail(info, f"a register hook raised {_describe(e)}")
            return
        self._plugins.append(info)

    def _register(self, kind: str, name: Any, target: Any, info: PluginInfo) -> _Entry:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"invalid {kind[:-1]} name {name!r} (letters, digits, '_', '-', '.')")
        if not (isinstance(target, type) or (isinstance(target, str) and ":" in target)):
            raise ValueError(f"{kind[:-1]} {name!r}: target must be a class or a 'module:Class' string, got {target!r}")
        old = self._entries[kind].get(name)
        if old is not None:
            raise PluginError(
                f"duplicate {kind[:-1]} name '{name}': registered by plugin {old.plugin.label} "
                f"({_target_str(old.target)}) and by plugin {info.label} ({_target_str(target)}); "
                f"uninstall one, or skip one with KVFLOW_DISABLE_PLUGINS={info.name}"
            )
        entry = _Entry(kind, name, target, info, target if isinstance(target, type) else None)
        self._entries[kind][name] = entry
        info.registered.setdefault(kind, []).append(name)
        return entry

    def _finish(self, strict: bool) -> None:
        if strict:
            self.check_strict()
        for info in self.failures():
            print(
                f"kvflow: warning: plugin {info.label}{_ep(info)} {info.error}; skipped "
                f"(KVFLOW_DISABLE_PLUGINS={info.name} silences this, --strict-plugins makes it an error)",
                file=sys.stderr,
            )

    def check_strict(self) -> None:
        """Raise PluginError if any plugin failed to load."""
        failed = self.failures()
        if failed:
            raise PluginError(
                "plugin(s) failed to load (strict mode):\n"
                + "\n".join(f"  plugin {i.label}{_ep(i)} {i.error}" for i in failed)
            )

    # ------------------------------------------------------------------ queries

    def failures(self) -> list[PluginInfo]:
        return [p for p in self._plugins if p.status == "failed"]

    def plugins(self) -> list[PluginInfo]:
        return list(self._plugins)

    def _kind(self, kind: str) -> dict[str, _Entry]:
        if kind not in self._entries:
            raise ValueError(f"unknown component kind {kind!r}; kinds: {', '.join(KINDS)}")
        return self._entries[kind]

    def names(self, kind: str) -> list[str]:
        return sorted(self._kind(kind))

    def has(self, kind: str, name: str) -> bool:
        return name in self._kind(kind)

    def get(self, kind: str, name: str) -> type:
        """The component class; imports a lazy target on first use."""
        entries = self._kind(kind)
        entry = entries.get(name)
        if entry is None:
            raise UserError(f"unknown {kind[:-1]} '{name}'", hint=unknown_component_hint(kind, name, sorted(entries)))
        if entry.cls is None:
            try:
                entry.cls = _import_target(entry.target)  # type: ignore[arg-type]
            except Exception as e:  # noqa: BLE001
                raise ComponentImportError(
                    f"cannot import {kind[:-1]} '{name}' from {entry.target} "
                    f"(registered by plugin {entry.plugin.label}): {_describe(e)}"
                ) from e
        return entry.cls

    def info(self, kind: str, name: str) -> ComponentInfo:
        """Who registered a component, its target, one-line description and Params defaults.
        An import failure is reported in `.error`, not raised (for `kvflow ls`)."""
        entry = self._kind(kind).get(name)
        if entry is None:
            self.get(kind, name)  # raises the did-you-mean UserError
        assert entry is not None
        info = ComponentInfo(kind, name, entry.plugin.name, entry.plugin.distribution, _target_str(entry.target), "", {})
        try:
            cls = self.get(kind, name)
        except ComponentImportError as e:
            info.error = str(e.__cause__ and _describe(e.__cause__) or e)
            return info
        info.description = _first_doc_line(cls)
        info.defaults = params_defaults(cls)
        return info


# --------------------------------------------------------------------------- process-wide

_REGISTRY: Optional[Registry] = None


def strict_from_env() -> bool:
    return os.environ.get("KVFLOW_STRICT_PLUGINS", "").strip().lower() in ("1", "true", "yes", "on")


def get_registry(strict: bool = False) -> Registry:
    """The registry of installed plugins, built once per process.
    Strict mode (argument or KVFLOW_STRICT_PLUGINS=1) raises PluginError on any failed plugin."""
    global _REGISTRY
    strict = strict or strict_from_env()
    if _REGISTRY is None:
        _REGISTRY = Registry.from_entry_points(strict=strict)
    elif strict:
        _REGISTRY.check_strict()
    return _REGISTRY


def set_registry(registry: Optional[Registry]) -> None:
    """Replace (or with None, forget) the process-wide registry; for tests and embedding."""
    global _REGISTRY
    _REGISTRY = registry
