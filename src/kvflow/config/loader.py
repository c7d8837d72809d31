"""Loading pipeline YAML with line numbers, strict safety rules and `include:` (DESIGN.md §5).

`load_config(path)` returns plain data (dicts, lists, scalars) plus a `Locations` map from
each path in the data (a tuple such as ``("proposers", "base", "pruners", 0)``) to the file
and line its effective value came from, so that any later check can say ``file:line``.

Rules enforced while loading (every violation is collected, then one `UserError` is raised):
- safe YAML only: any tag outside the standard YAML types (``!foo``, ``!!python/...``) is an
  error, so nothing in a pipeline file can construct objects or run code;
- duplicate keys in a mapping are errors naming both lines;
- ``include: other.yaml`` (or a list of files), relative to the including file or absolute:
  the included files are loaded first (in order), then the including file is deep-merged
  on top (mappings merge recursively, lists and scalars are replaced, a mapping whose
  `kind` changes is replaced too, and a null value deletes the key it names, e.g.
  ``proposers: {helper: null}``); cycles are errors listing the chain.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional, Union

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from kvflow.errors import ConfigProblem, UserError

PathParts = tuple[Union[str, int], ...]

_STD = "tag:yaml.org,2002:"
#: the only tags a pipeline file may use (all of them resolved implicitly by plain YAML)
ALLOWED_TAGS = {_STD + t for t in ("str", "int", "float", "bool", "null", "map", "seq", "timestamp")}
MERGE_TAG = _STD + "merge"


class Location(NamedTuple):
    file: str
    line: int  # 1-based; 0 for values given on the command line


class Locations(dict):
    """``{path tuple: Location}`` for every mapping key and sequence item, plus ``()``."""

    def lookup(self, path: PathParts) -> Location:
        """Where `path` is, or its nearest recorded ancestor (e.g. for a missing field)."""
        path = tuple(path)
        while path:
            if path in self:
                return self[path]
            path = path[:-1]
        return self.get((), Location("", 0))

    def at(self, dotted: str) -> Location:
        """Convenience for tests and tools: ``locations.at("proposers.base.n")``."""
        return self.lookup(parse_path(dotted))

    def prune(self, prefix: PathParts) -> None:
        """Forget `prefix` and everything below it."""
        n = len(prefix)
        for p in [p for p in self if p[:n] == tuple(prefix)]:
            del self[p]


# --------------------------------------------------------------------------- dotted paths

_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_\-]+$")


def format_path(path: PathParts) -> str:
    """``("proposers", "base", "pruners", 0, "window")`` -> ``proposers.base.pruners[0].window``.
    Keys that are not plain words (e.g. ``qwen2.5``) are quoted: ``models."qwen2.5".id``."""
    out = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            key = str(part)
            if not _PLAIN_KEY.match(key):
                key = '"' + key.replace('"', '\\"') + '"'
            out += ("." if out else "") + key
    return out


_TOKEN = re.compile(r'\s*(?:"((?:[^"\\]|\\.)*)"|\'([^\']*)\'|([^.\[\]"\']+))((?:\[\d+\])*)\s*')


def parse_path(text: str) -> PathParts:
    """Inverse of `format_path`; also accepts ``a.0.b`` for list items.
    Raises ValueError on malformed paths."""
    parts: list[Union[str, int]] = []
    pos = 0
    while True:
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError(f"malformed path {text!r} at character {pos + 1}")
        if m.group(1) is not None:
            parts.append(m.group(1).replace('\\"', '"'))
        elif m.group(2) is not None:
            parts.append(m.group(2))
        else:
            word = m.group(3).strip()
            parts.append(int(word) if word.isdigit() else word)
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", m.group(4)))
        pos = m.end()
        if pos == len(text):
            return tuple(parts)
        if text[pos] != ".":
            raise ValueError(f"malformed path {text!r} at character {pos + 1}")
        pos += 1


def iter_paths(data: Any, prefix: PathParts = ()) -> Iterator[PathParts]:
    """Every path below `data` (not including `prefix` itself)."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield prefix + (k,)
            yield from iter_paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield prefix + (i,)
            yield from iter_paths(v, prefix + (i,))


# --------------------------------------------------------------------------- YAML -> data


def _short_tag(tag: str) -> str:
    return "!!" + tag[len(_STD):] if tag.startswith(_STD) else tag


class LocatingLoader(yaml.SafeLoader):
    """A SafeLoader that composes the node tree and builds plain data from it itself, so it can
    record the line of every mapping key and sequence item, reject duplicate keys and reject
    non-standard tags (SafeLoader alone silently keeps the last duplicate)."""

    def __init__(self, stream: str, file: str) -> None:
        super().__init__(stream)
        self.file = file
        self.locations = Locations()
        self.problems: list[ConfigProblem] = []
        self._active: set[int] = set()  # node ids on the walk stack (recursive aliases)

    def load_located(self) -> tuple[Any, Locations, list[ConfigProblem]]:
        try:
            node = self.get_single_node()
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            msg = e.problem or str(e)
            if e.context and e.context not in msg:
                msg = f"{e.context}: {msg}"
            line = mark.line + 1 if mark else 0
            return None, self.locations, [ConfigProblem(self.file, line, "", f"invalid YAML: {msg}")]
        finally:
            self.dispose()
        if node is None:
            return None, self.locations, []
        self.locations[()] = Location(self.file, node.start_mark.line + 1)
        return self._node(node, ()), self.locations, self.problems

    def _problem(self, node: Node, path: PathParts, message: str, hint: Optional[str] = None) -> None:
        p = ConfigProblem(self.file, node.start_mark.line + 1, format_path(path), message, hint)
        if p not in self.problems:  # an aliased node is walked once per use
            self.problems.append(p)

    def _node(self, node: Node, path: PathParts) -> Any:
        if node.tag not in ALLOWED_TAGS:
            self._problem(
                node, path, f"unsupported YAML tag '{_short_tag(node.tag)}'",
                "pipeline files are plain YAML: remove the tag (tags that build objects or run code are never allowed)",
            )
            return None
        if id(node) in self._active:
            self._problem(node, path, "recursive YAML alias")
            return None
        self._active.add(id(node))
        try:
            if isinstance(node, MappingNode):
                return self._mapping(node, path)
            if isinstance(node, SequenceNode):
                out = []
                for i, item in enumerate(node.value):
                    self.locations[path + (i,)] = Location(self.file, item.start_mark.line + 1)
                    out.append(self._node(item, path + (i,)))
                return out
            return self.construct_object(node, deep=True)
        finally:
            self._active.discard(id(node))

    def _mapping(self, node: MappingNode, path: PathParts) -> dict:
        result: dict = {}
        merges: list[Node] = []
        explicit: list[tuple[Any, Node, Node]] = []
        first_line: dict = {}
        for knode, vnode in node.value:
            if knode.tag == MERGE_TAG:
                merges.append(vnode)
                continue
            if not isinstance(knode, ScalarNode) or knode.tag not in ALLOWED_TAGS:
                self._problem(knode, path, "mapping keys must be plain scalars")
                continue
            key = self.construct_object(knode)
            line = knode.start_mark.line + 1
            if key in first_line:
                self._problem(
                    knode, path + (key,), f"duplicate key '{key}' (first defined on line {first_line[key]})",
                    "a key may appear only once in a mapping; delete one of them",
                )
                continue
            first_line[key] = line
            explicit.append((key, knode, vnode))
        # YAML merge keys (`<<: *defaults`): explicit keys win over merged ones, and earlier
        # merge sources over later ones, so apply the sources in reverse, explicit keys last.
        for vnode in reversed(merges):
            sources = vnode.value if isinstance(vnode, SequenceNode) else [vnode]
            for src in reversed(sources):
                if not isinstance(src, MappingNode):
                    self._problem(src, path, "'<<' merges only mappings")
                    continue
                result.update(self._mapping(src, path))
        for key, knode, vnode in explicit:
            self.locations.prune(path + (key,))
            self.locations[path + (key,)] = Location(self.file, knode.start_mark.line + 1)
            result[key] = self._node(vnode, path + (key,))
        return result


def display_path(path: Path) -> str:
    """How a file is named in messages: relative to the working directory when inside it."""
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def parse_yaml(text: str, file: str) -> tuple[Any, Locations, list[ConfigProblem]]:
    """Parse one YAML document. Returns (data, locations, problems); never raises on bad YAML."""
    return LocatingLoader(text, file).load_located()


def load_yaml_value(text: str) -> Any:
    """A single YAML value from the command line (``--set a=VALUE``), with the same safety rules.
    Raises ValueError with a readable message."""
    data, _, problems = parse_yaml(text, "<value>")
    if problems:
        raise ValueError("; ".join(p.message for p in problems))
    return data


# --------------------------------------------------------------------------- include + merge


def _same_component(base: dict, over: dict) -> bool:
    return "kind" not in over or "kind" not in base or base["kind"] == over["kind"]


def deep_merge(base: Any, over: Any) -> Any:
    """`over` on top of `base`: mappings merge recursively; lists and scalars are replaced.
    A component entry whose `kind` changes is replaced, not merged: the old component's
    parameters mean nothing to the new one (``scorer: {kind: random}`` over a PRM scorer).
    A key whose value in `over` is null deletes that key of `base` (``proposers: {helper:
    null}`` removes the helper), so the field falls back to its default; for the optional
    fields that default to null this is the same as setting null."""
    if isinstance(base, dict) and isinstance(over, dict) and _same_component(base, over):
        out = dict(base)
        for k, v in over.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = deep_merge(base[k], v) if k in base else v
        return out
    return over


def _merge_located(base: tuple[dict, Locations], over: tuple[dict, Locations]) -> tuple[dict, Locations]:
    data = deep_merge(base[0], over[0])
    # A path of the merged data exists in `over` exactly when its value came from `over`
    # (or, for a merged mapping, when `over` names the key too), so `over` wins.
    locs = Locations({(): over[1].get((), base[1].get((), Location("", 0)))})
    for p in iter_paths(data):
        loc = over[1].get(p) or base[1].get(p)
        if loc is not None:
            locs[p] = loc
    return data, locs


def load_config(path: Union[str, os.PathLike]) -> tuple[dict, Locations]:
    """Load a pipeline file with its includes resolved; `include` is removed from the result.
    Raises UserError listing every problem found."""
    return _load(Path(path).expanduser(), stack=())


def _load(path: Path, stack: tuple[Path, ...]) -> tuple[dict, Locations]:
    resolved = path.resolve()
    name = display_path(resolved)
    try:
        text = resolved.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(ConfigProblem(name, 0, "", "file not found")) from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(ConfigProblem(name, 0, "", f"cannot read file: {e}")) from None
    data, locs, problems = parse_yaml(text, name)
    if data is None and not problems:
        data = {}
        locs[()] = Location(name, 1)
    if problems:
        raise UserError(problems)
    if not isinstance(data, dict):
        raise UserError(ConfigProblem(name, locs.lookup(()).line, "", f"a pipeline file must be a mapping, not a {type(data).__name__}"))

    includes = data.pop("include", None)
    if includes is None:
        return data, locs
    if isinstance(includes, str):
        entries = [(("include",), includes)]
    elif isinstance(includes, list) and all(isinstance(x, str) for x in includes):
        entries = [(("include", i), x) for i, x in enumerate(includes)]
    else:
        loc = locs.lookup(("include",))
        raise UserError(ConfigProblem(loc.file, loc.line, "include", "must be a file name or a list of file names"))

    problems = []
    merged: Optional[tuple[dict, Locations]] = None
    for ipath, target in entries:
        loc = locs.lookup(ipath)
        child = Path(os.path.expanduser(target))
        child = (child if child.is_absolute() else resolved.parent / child).resolve()
        chain = stack + (resolved,)
        if child in chain:
            names = " -> ".join(display_path(p) for p in chain[chain.index(child):] + (child,))
            problems.append(ConfigProblem(loc.file, loc.line, format_path(ipath), f"include cycle: {names}",
                                          "a file may not include itself, directly or through other files"))
            continue
        if not child.is_file():
            problems.append(ConfigProblem(loc.file, loc.line, format_path(ipath), f"included file not found: {display_path(child)}",
                                          "include paths are relative to the including file, or absolute"))
            continue
        try:
            loaded = _load(child, chain)
        except UserError as e:
            problems.extend(e.problems)
            continue
        merged = loaded if merged is None else _merge_located(merged, loaded)
    if problems:
        raise UserError(problems)
    for p in [p for p in locs if p[:1] == ("include",)]:
        del locs[p]
    return _merge_located(merged, (data, locs)) if merged is not None else (data, locs)
