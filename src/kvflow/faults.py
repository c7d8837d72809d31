"""A component that fails at run time is named: its kind and name, the plugin and distribution
that registered it, the method, and what went wrong (issue 34).

Two kinds of fault are told apart from kvflow's own errors:

- **a wrong return value.** The component base classes check what the methods kvflow calls
  return (`guard`, installed on every subclass by `Evictor`, `Pruner`, `Scorer` and
  `Committer`): `Pruner.check()` a bool tensor of one value per live row, `Pruner.signal()` a
  floating tensor of one value per row, `Scorer.score()` a list of one number per request,
  `Committer.pick()` an index into its candidates, `Evictor.score()` a tensor of the keys'
  [rows, kv_heads, N]. A wrong one raises `ComponentFault` at once, saying what was expected
  and what came back, instead of an `AttributeError` somewhere inside kvflow. The checks read
  types and shapes only (never a tensor's values: no device sync).
- **an exception raised inside a component.** `attribute()` reads the traceback: the outermost
  frame whose `self` is an instance of a registered component class names the component and
  the method kvflow called; the fault is the plugin's when code of the plugin's own package
  ran between that frame and the one that raised (a base-class method of kvflow's that fails
  on a plugin's component is still kvflow's fault). An exception in a plugin's code that no
  component frame encloses (a backend's engine, say) names the plugin alone.

`crash_report` (the CLI's last resort) turns either into ``kvflow: plugin fault: ...`` and exit code
`EXIT_PLUGIN_FAULT` (5), with the traceback saved to a file as for an internal error. A fault
of a built-in component (registered by kvflow itself) is kvflow's: an internal error (exit
code 1), whose message names the component too.

Nothing here imports torch at import time.
"""

from __future__ import annotations

import functools
import numbers
import operator
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Iterator, Optional

from kvflow.errors import EXIT_INTERNAL_ERROR, EXIT_PLUGIN_FAULT

#: distributions whose components are kvflow's own: their faults are internal errors
_OWN_DISTRIBUTIONS = {"kvflow"}
_OWN_PACKAGES = ("kvflow", "kvflow_builtin")


class ComponentFault(AssertionError):
    """A component broke its contract at run time: `method` returned something it may not.
    `component` is the instance; `problem` says what was expected and what came back. An
    AssertionError, as the contract suites' own checks are: a suite run by pytest fails on it
    like on any of its assertions."""

    def __init__(self, component: Any, method: str, problem: str) -> None:
        self.component, self.method, self.problem = component, method, problem
        super().__init__(f"{type(component).__name__}.{method}() {problem}")


# --------------------------------------------------------------------------- return checks


def _kind(obj: Any) -> str:
    return "None" if obj is None else type(obj).__name__


def _shape(t: Any) -> str:
    return "[" + ", ".join(str(int(d)) for d in t.shape) + "]"


def _tensor(out: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(out, torch.Tensor)


def _rows(trace: Any) -> int:
    return len(trace.n_tokens)


def _check_verdict(self: Any, out: Any, trace: Any, *args: Any, **kw: Any) -> Optional[str]:
    rows = _rows(trace)
    want = f"a bool tensor of shape [{rows}] (one value per live row)"
    if not _tensor(out):
        return f"returned {_kind(out)}, expected {want}"
    if str(out.dtype) != "torch.bool" or tuple(out.shape) != (rows,):
        return f"returned a {str(out.dtype).removeprefix('torch.')} tensor of shape {_shape(out)}, expected {want}"
    return None


def _check_signal(self: Any, out: Any, trace: Any, *args: Any, **kw: Any) -> Optional[str]:
    rows = _rows(trace)
    want = f"a float tensor of shape [{rows}] (one value per live row, nan before warm-up)"
    if not _tensor(out):
        return f"returned {_kind(out)}, expected {want}"
    if not out.dtype.is_floating_point or tuple(out.shape) != (rows,):
        return f"returned a {str(out.dtype).removeprefix('torch.')} tensor of shape {_shape(out)}, expected {want}"
    return None


def _number(s: Any) -> bool:
    if isinstance(s, bool):
        return False
    if isinstance(s, numbers.Real):
        return True
    return _tensor(s) and s.numel() == 1 and not s.dtype.is_complex and str(s.dtype) != "torch.bool"


def _check_scores(self: Any, out: Any, requests: Any, *args: Any, **kw: Any) -> Optional[str]:
    n = len(requests)
    want = f"a list of {n} numbers (one per request, in request order)"
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        return f"returned {_kind(out)}, expected {want}"
    if len(out) != n:
        return f"returned {len(out)} scores for {n} requests, expected {want}"
    for i, s in enumerate(out):
        if not _number(s):
            return f"returned {_kind(s)} ({s!r:.40}) as the score of request {i}, expected {want}"
    return None


def _check_pick(self: Any, out: Any, candidates: Any, *args: Any, **kw: Any) -> Optional[str]:
    n = len(candidates)
    want = f"an int index into its {n} candidates (0 to {n - 1})"
    if isinstance(out, bool):
        return f"returned {out!r}, not {want}"
    try:
        i = operator.index(out)
    except TypeError:
        return f"returned {_kind(out)} ({out!r:.40}), not {want}"
    if not 0 <= i < n:
        return f"returned {i} for {n} candidates, expected {want}"
    return None


def _check_evictor_scores(self: Any, out: Any, keys: Any, *args: Any, **kw: Any) -> Optional[str]:
    shape = tuple(keys.shape[:3])
    want = "a float tensor of shape [" + ", ".join(map(str, shape)) + "] (rows, kv_heads, cached tokens)"
    if not _tensor(out):
        return f"returned {_kind(out)}, expected {want}"
    if tuple(out.shape) != shape or not (out.dtype.is_floating_point or str(out.dtype).startswith("torch.int")):
        return f"returned a {str(out.dtype).removeprefix('torch.')} tensor of shape {_shape(out)}, expected {want}"
    return None


#: per base class: the methods whose return value `guard` checks
CHECKS: dict[str, dict[str, Callable[..., Optional[str]]]] = {
    "Pruner": {"check": _check_verdict, "signal": _check_signal},
    "Scorer": {"score": _check_scores},
    "Committer": {"pick": _check_pick},
    "Evictor": {"score": _check_evictor_scores},
}


def _guarded(fn: Callable, method: str, check: Callable[..., Optional[str]]) -> Callable:
    @functools.wraps(fn)
    def guarded(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        problem = check(self, out, *args, **kwargs)
        if problem is not None:
            raise ComponentFault(self, method, problem)
        return out

    guarded.__kvflow_guarded__ = True  # type: ignore[attr-defined]
    return guarded


_GUARD_CODE = _guarded(lambda self: None, "", lambda *a, **k: None).__code__


def guard(cls: type, base: str) -> None:
    """Wrap the checked methods (`CHECKS[base]`) that `cls` itself defines, so that a wrong
    return value raises `ComponentFault`. Called by the base classes' `__init_subclass__`."""
    for method, check in CHECKS[base].items():
        fn = cls.__dict__.get(method)
        if callable(fn) and not getattr(fn, "__kvflow_guarded__", False):
            setattr(cls, method, _guarded(fn, method, check))


# --------------------------------------------------------------------------- attribution


@dataclass
class Fault:
    """Who failed: the component (kind and name; None when only the plugin is known), the
    plugin that registered it, the method kvflow called and what went wrong."""

    kind: Optional[str]  # "pruner", "evictor", ...
    name: Optional[str]
    plugin: str  # the plugin's label: 'name' (distribution dist version)
    distribution: Optional[str]
    version: Optional[str]
    method: Optional[str]
    what: str
    builtin: bool  # registered by kvflow itself: kvflow's own fault

    def describe(self) -> str:
        where = f" in {self.method}()" if self.method else ""
        if self.kind is None:
            return f"code of plugin {self.plugin} failed{where}: {self.what}"
        return f"{self.kind} '{self.name}' of plugin {self.plugin} failed{where}: {self.what}"

    @property
    def reporter(self) -> str:
        """Whom to tell: the distribution (and version), else the plugin's name."""
        if self.distribution:
            return f"{self.distribution} {self.version}" if self.version else self.distribution
        return self.plugin


def _top(module: Optional[str]) -> str:
    return (module or "").partition(".")[0]


def _registry() -> Any:
    from kvflow import registry

    return registry._REGISTRY  # the process's, if one was built; never build one here


def _origin(reg: Any, cls: type) -> Optional[tuple[str, str, Any, type]]:
    """(kind, name, PluginInfo, registered class) of the registered class nearest `cls` in its
    MRO (kvflow may build a subclass of a registered one)."""
    for klass in cls.__mro__:
        for kind, entries in reg._entries.items():
            for name, entry in entries.items():
                if entry.cls is klass:
                    return kind, name, entry.plugin, klass
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def _frames(exc: BaseException) -> list[FrameType]:
    out = []
    tb = exc.__traceback__
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return out


def _builtin(info: Any, cls: Optional[type]) -> bool:
    """Registered by kvflow itself (its distribution, or, in a registry built from plugin
    modules, a class of kvflow's own packages)."""
    return info.distribution in _OWN_DISTRIBUTIONS or (cls is not None and _top(cls.__module__) in _OWN_PACKAGES)


def _what(exc: BaseException) -> str:
    text = str(exc)
    return f"raised {type(exc).__name__}: {text}" if text else f"raised {type(exc).__name__}"


def _fault(reg: Any, kind: Optional[str], name: Optional[str], info: Any, method: Optional[str], what: str,
           cls: Optional[type]) -> Fault:
    return Fault(kind[:-1] if kind else None, name, info.label, info.distribution, info.version, method, what,
                 _builtin(info, cls))


def _plugin_packages(reg: Any) -> dict[str, Any]:
    """Top-level package -> PluginInfo, for every plugin that is not kvflow's own."""
    out: dict[str, Any] = {}
    for kind, entries in reg._entries.items():
        for entry in entries.values():
            target = entry.target if isinstance(entry.target, str) else entry.target.__module__
            top = _top(target.partition(":")[0])
            if top and top not in _OWN_PACKAGES and entry.plugin.distribution not in _OWN_DISTRIBUTIONS:
                out.setdefault(top, entry.plugin)
    return out


def _from_traceback(reg: Any, exc: BaseException) -> Optional[Fault]:
    frames = _frames(exc)
    for i, frame in enumerate(frames):
        obj = frame.f_locals.get("self")
        if obj is None or isinstance(obj, type):
            continue
        origin = _origin(reg, type(obj))
        if origin is None:
            continue
        kind, name, info, klass = origin
        own = {_top(k.__module__) for k in type(obj).__mro__} - {"builtins", *_OWN_PACKAGES}
        if _builtin(info, klass):
            own = {_top(klass.__module__)}
        mine = [f for f in frames[i:] if _top(f.f_globals.get("__name__")) in own]
        if not mine:
            return None  # kvflow's code failed on a plugin's component: kvflow's fault
        # the method: the innermost of the component's own methods that ran (the one that
        # raised, or called what raised), else the one kvflow called
        methods = [f for f in mine if f.f_locals.get("self") is obj] or [frame]
        last = methods[-1]
        method = last.f_locals.get("method") if last.f_code is _GUARD_CODE else last.f_code.co_name
        return _fault(reg, kind, name, info, method, _what(exc), klass)
    packages = _plugin_packages(reg)
    for frame in reversed(frames):  # innermost first: the plugin code nearest the raise
        info = packages.get(_top(frame.f_globals.get("__name__")))
        if info is not None:
            return _fault(reg, None, None, info, frame.f_code.co_name, _what(exc), None)
    return None


def attribute(exc: BaseException) -> Optional[Fault]:
    """The component (or plugin) at fault for `exc`, or None when it is kvflow's own (or no
    registry was built in this process). Never raises."""
    try:
        reg = _registry()
        if reg is None:
            return None
        for e in _chain(exc):
            if isinstance(e, ComponentFault):
                origin = _origin(reg, type(e.component))
                if origin is None:
                    return None
                kind, name, info, klass = origin
                return _fault(reg, kind, name, info, e.method, e.problem, klass)
            fault = _from_traceback(reg, e)
            if fault is not None:
                return fault
        return None
    except Exception:  # noqa: BLE001 - a report of a crash must not crash
        return None


def crash_report(exc: BaseException, traceback_path: Optional[object]) -> tuple[list[str], int]:
    """(the lines to print, the exit code) for an exception no check caught, whose traceback
    was saved at `traceback_path` (None: it could not be). A plugin component's fault names
    the component, its plugin's distribution and version, the method and what went wrong
    (exit code `EXIT_PLUGIN_FAULT`); anything else is an internal error (`EXIT_INTERNAL_ERROR`)."""
    fault = attribute(exc)
    saved = f"the traceback is in {traceback_path}" if traceback_path else "(the traceback could not be saved)"
    if fault is not None and not fault.builtin:
        return [f"kvflow: plugin fault: {fault.describe()}",
                f"kvflow: {saved}; this is a fault of the plugin, not of kvflow: please report it to the "
                f"authors of {fault.reporter}"], EXIT_PLUGIN_FAULT
    head = (f"kvflow: internal error: {fault.describe()}" if fault is not None
            else f"kvflow: internal error: {type(exc).__name__}: {exc}")
    tail = f"kvflow: {saved}; please include it in a bug report" if traceback_path else f"kvflow: {saved}"
    return [head, tail], EXIT_INTERNAL_ERROR
