"""Command-line overrides of a loaded pipeline: ``--set a.b.c=VALUE`` and ``--unset a.b``.

VALUE is parsed as YAML (same safety rules as files), so ``--set run.seed=3`` gives an int,
``--set proposers.base.pruners=[]`` an empty list and ``--set a.b={x: 1}`` a mapping.
``--set`` creates missing intermediate mappings and replaces whatever was at the path;
``--unset`` removes a key (or list item) that must exist. List items are addressed as
``pruners[0]`` or ``pruners.0``; keys that contain dots are quoted: ``models."qwen2.5".id``.

Overridden values are located at the pseudo-file ``<--set>`` (line 0), so later errors about
them read ``--set proposers.base.n: ...``. All unsets are applied before all sets, so
``--unset proposers.base.evictor --set proposers.base.evictor.kind=none`` replaces an entry.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from kvflow.config.loader import Location, Locations, PathParts, format_path, iter_paths, load_yaml_value, parse_path
from kvflow.errors import ConfigProblem, UserError, did_you_mean

SET_FILE = "<--set>"
UNSET_FILE = "<--unset>"


def parse_set(text: str) -> tuple[PathParts, Any]:
    """``"a.b=VALUE"`` -> (("a", "b"), parsed VALUE). Raises ValueError with a readable message."""
    if "=" not in text:
        raise ValueError("expected PATH=VALUE")
    key, _, raw = text.partition("=")
    path = parse_path(key.strip())
    try:
        value = load_yaml_value(raw)
    except ValueError as e:
        raise ValueError(f"value is not valid YAML: {e}") from None
    return path, value


def apply_overrides(
    data: dict,
    locations: Locations,
    sets: Iterable[str] = (),
    unsets: Iterable[str] = (),
) -> None:
    """Apply ``--unset`` then ``--set`` in place on `data` and `locations`.
    Raises UserError listing every override that could not be applied."""
    problems: list[ConfigProblem] = []
    for text in unsets:
        try:
            path = parse_path(text.strip())
            _unset(data, path)
            locations.prune(path)
        except ValueError as e:
            problems.append(ConfigProblem(UNSET_FILE, 0, text.strip(), str(e), _hint(e)))
    for text in sets:
        try:
            path, value = parse_set(text)
            _set(data, path, value)
        except ValueError as e:
            key = text.partition("=")[0].strip()
            problems.append(ConfigProblem(SET_FILE, 0, key, str(e), _hint(e) or "use --set dotted.path=VALUE, VALUE in YAML syntax"))
            continue
        locations.prune(path)
        for i in range(1, len(path)):  # intermediate mappings the --set created
            locations.setdefault(path[:i], Location(SET_FILE, 0))
        for p in ((path,) + tuple(iter_paths(value, path))):
            locations[p] = Location(SET_FILE, 0)
    if problems:
        raise UserError(problems)


class _PathError(ValueError):
    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.hint = hint


def _hint(e: ValueError) -> Optional[str]:
    return getattr(e, "hint", None)


def _step(node: Any, part: Any, done: PathParts) -> Any:
    """The child of `node` at `part`, or raise _PathError explaining why there is none."""
    where = format_path(done) or "the pipeline"
    if isinstance(node, dict):
        if part not in node:
            raise _PathError(f"'{part}' does not exist in {where}", did_you_mean(str(part), list(node), "existing keys"))
        return node[part]
    if isinstance(node, list):
        if not isinstance(part, int):
            raise _PathError(f"{where} is a list: address its items as {where}[0]")
        if part >= len(node):
            raise _PathError(f"{where} has {len(node)} item(s); index {part} is out of range")
        return node[part]
    raise _PathError(f"{where} is a {type(node).__name__}, not a mapping or list")


def _unset(data: dict, path: PathParts) -> None:
    if not path:
        raise _PathError("cannot unset the whole pipeline")
    node: Any = data
    for i, part in enumerate(path[:-1]):
        node = _step(node, part, path[:i])
    _step(node, path[-1], path[:-1])  # must exist
    del node[path[-1]]


def _set(data: dict, path: PathParts, value: Any) -> None:
    if not path:
        raise _PathError("cannot set the whole pipeline")
    node: Any = data
    for i, part in enumerate(path[:-1]):
        if isinstance(node, dict) and part not in node:
            node[part] = {}  # create missing intermediate mappings
        elif isinstance(node, dict) and node[part] is None:
            node[part] = {}  # `evictor:` left empty in YAML counts as missing
        node = _step(node, part, path[:i])
    last = path[-1]
    if isinstance(node, dict):
        node[last] = value
    elif isinstance(node, list):
        _step(node, last, path[:-1])  # index must be in range
        node[last] = value
    else:
        raise _PathError(f"{format_path(path[:-1])} is a {type(node).__name__}, not a mapping or list")
