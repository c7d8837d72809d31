"""Compare the trajectories of two runs of the same pipeline and problems (e.g. decode room 1
vs 8, bench/batch_invariance.sh): how many differ, and from which committed step.

    python bench/batch_invariance.py RUN_A RUN_B
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def steps(run: Path) -> dict[str, list[tuple[str, str]]]:
    out = {}
    for line in (run / "samples.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["id"]] = [(s["text"], s["source"]) for s in r["steps"]]
    return out


def first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(a: str, b: str) -> None:
    ra, rb = steps(Path(a)), steps(Path(b))
    common = sorted(set(ra) & set(rb))
    diffs = {pid: first_difference(ra[pid], rb[pid]) for pid in common}
    differ = {pid: i for pid, i in diffs.items() if i is not None}
    print(f"{Path(a).name} vs {Path(b).name}: {len(common)} problems, {len(differ)} trajectories differ")
    for pid, i in sorted(differ.items(), key=lambda kv: kv[1]):
        print(f"  {pid}: first different committed step {i} (of {len(ra[pid])} / {len(rb[pid])})")
    if differ:
        print(f"  earliest difference at step {min(differ.values())}, median "
              f"{sorted(differ.values())[len(differ) // 2]}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
