"""The early-stop signals a result records, as its readers need them: which way each pruner
kind flags (`DIRECTIONS`), a pruner's kind from its result name, and the thresholds a resolved
pipeline configured (by result name, `kvflow.config.names`)."""

from __future__ import annotations

from kvflow.config.names import pruner_kind, pruner_names

#: direction a pruner kind flags in: "high" = stop when the signal exceeds the threshold
DIRECTIONS = {"entropy": "high", "gzip": "low", "confidence": "low"}


def kind_of(name: str) -> str:
    """The pruner kind of a result name (`gzip_2` -> `gzip`)."""
    return pruner_kind(name)


def pruner_owners(config: dict) -> dict[str, list[str]]:
    """Pruner result names -> the proposers they watch, from a resolved pipeline (plain data)."""
    owners: dict[str, list[str]] = {}
    for pname, prop in (config.get("proposers") or {}).items():
        entries = (prop or {}).get("pruners") or []
        for name in pruner_names(str(p.get("kind")) for p in entries):
            owners.setdefault(name, []).append(pname)
    return owners


def configured_thresholds(resolved: dict) -> dict[str, float]:
    """Pruner result name -> threshold from a resolved pipeline (plain data)."""
    out: dict[str, float] = {}
    for prop in (resolved.get("proposers") or {}).values():
        entries = (prop or {}).get("pruners") or []
        for name, entry in zip(pruner_names(str(e.get("kind")) for e in entries), entries):
            if "threshold" in entry:
                out.setdefault(name, entry["threshold"])
    return out
