"""Names a resolved pipeline gives its parts, in one place (the runtime writes them into every
result; `report`, `view` and `calibrate` read them back).

A proposer's pruners are named by kind, the second of a kind within the same proposer
`<kind>_2`, the third `<kind>_3`, and so on: `pruner_names(["entropy", "gzip", "entropy"])` is
`["entropy", "gzip", "entropy_2"]`.
"""

from __future__ import annotations

from typing import Iterable


def pruner_names(kinds: Iterable[str]) -> list[str]:
    """The result name of each pruner of one proposer, in order (see the module docstring)."""
    seen: dict[str, int] = {}
    out = []
    for kind in kinds:
        seen[kind] = seen.get(kind, 0) + 1
        out.append(kind if seen[kind] == 1 else f"{kind}_{seen[kind]}")
    return out


def pruner_kind(name: str) -> str:
    """The kind of a pruner's result name (`entropy_2` -> `entropy`)."""
    base, _, suffix = name.rpartition("_")
    return base if base and suffix.isdigit() else name
