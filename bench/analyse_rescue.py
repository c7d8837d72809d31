"""Per-problem analysis of a KV-Rescue run against its baselines (docs/reproduction.md).

For every problem the runs share: whether the evicted base, the full-KV base, the helper
alone and KV-Rescue got it right (the outcome class: rescued, kept, lost, both wrong), which
source's steps KV-Rescue committed (the sequence, b = base, h = helper, f = a fallback after
every candidate was pruned), how many base candidates early exit stopped, and how often a
base step was committed when the base had an unpruned candidate (from the run's recorded
signals: `run.record_signals`). Prints markdown.

    python bench/analyse_rescue.py RESCUE_DIR --evicted DIR --full DIR --helper DIR
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def records(path: str) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (Path(path) / "samples.jsonl").read_text().splitlines())}


def steps_code(rec: dict) -> str:
    out = []
    for s in rec["steps"]:
        out.append("f" if s.get("fallback") else ("b" if s["source"] == "base" else "h"))
    return "".join(out)


def base_survivors_by_step(rec: dict) -> dict[int, int]:
    """Step index -> base candidates that were not pruned (from recorded signals)."""
    out: Counter = Counter()
    for sig in rec.get("signals") or []:
        if sig["source"] == "base" and not sig["finish"].startswith("pruned:"):
            out[sig["step"]] += 1
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rescue")
    ap.add_argument("--evicted", required=True)
    ap.add_argument("--full", required=True)
    ap.add_argument("--helper", required=True)
    args = ap.parse_args()
    rs, ev, fl, hp = (records(p) for p in (args.rescue, args.evicted, args.full, args.helper))
    ids = [i for i in rs if i in ev and i in fl and i in hp]
    classes: Counter = Counter()
    rows = []
    committed_base_when_possible = possible = 0
    for i in ids:
        r = rs[i]
        cls = {(False, True): "rescued", (True, True): "kept", (True, False): "lost",
               (False, False): "both wrong"}[(ev[i]["correct"], r["correct"])]
        classes[cls] += 1
        surv = base_survivors_by_step(r)
        for k, s in enumerate(r["steps"]):
            if surv.get(k, 0) > 0:
                possible += 1
                committed_base_when_possible += s["source"] == "base"
        code = steps_code(r)
        rows.append((i, cls, ev[i]["correct"], fl[i]["correct"], hp[i]["correct"], r["correct"], code,
                     sum(r["pruned"].values()), r["finish"], r["output_tokens"]))
    print(f"{len(ids)} problems shared by the four runs: " + ", ".join(f"{k} {v}" for k, v in classes.most_common()))
    if possible:
        print(f"a base step was committed at {committed_base_when_possible} of {possible} steps where the base had "
              f"an unpruned candidate ({committed_base_when_possible / possible:.0%})")
    n_steps = Counter(c for row in rows for c in row[6])
    total = sum(n_steps.values()) or 1
    print("committed steps: " + ", ".join(f"{name} {n_steps[c]} ({n_steps[c] / total:.0%})"
                                          for c, name in (("b", "base"), ("h", "helper"), ("f", "fallback"))))
    by_class = {}
    for row in rows:
        code = row[6]
        by_class.setdefault(row[1], []).append(code.count("h") / max(1, len(code)))
    print("helper share of committed steps by outcome: " + ", ".join(
        f"{k} {sum(v) / len(v):.0%}" for k, v in sorted(by_class.items())))
    print()
    print("| problem | outcome | evicted | full KV | helper | KV-Rescue | committed steps (b/h/f) | base pruned | finish | tokens |")
    print("|---|---|---|---|---|---|---|---:|---|---:|")
    yes = lambda b: "✓" if b else "✗"  # noqa: E731
    for i, cls, e, f, h, r, code, pruned, finish, tokens in sorted(rows, key=lambda x: (x[1], x[0])):
        print(f"| {i} | {cls} | {yes(e)} | {yes(f)} | {yes(h)} | {yes(r)} | `{code}` | {pruned} | {finish} | {tokens} |")


if __name__ == "__main__":
    main()
