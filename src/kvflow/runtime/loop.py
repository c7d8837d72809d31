"""The step loop (DESIGN.md §6): propose, prune, score, commit, sync — batched over problems.

One call to `run_batch` decodes a batch of problems to the end. Each round every proposer
proposes `n` candidates per live problem (all in one decode batch), pruners stop degenerate
candidates while they are generated, the scorer scores the survivors, the committer picks
one step per problem, and every proposer brings its state up to date. A finished problem
is handed to `on_done` at once, so results are written as they come.

Timing: with a `timings` dict, the loop keeps wall-clock accounting by phase (kvflow.timing)
and, before handing a finished problem to `on_done`, stores its `timing` under its id: the
batch's wall time from the start of `run_batch` until the problem finished (`wall`), split
into exclusive phases (`phases`) that sum to it: `prefill`, `propose`, `prune`, `score`,
`commit`, `sync`, `record` (the `on_done`/`on_round` callbacks of problems that finished
earlier), with model forwards nested as `<phase>/forward:<proposers>`, and `other` (loop code
outside every phase). Problems of one batch share that wall time; it is not divided among them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from kvflow.backends.hf import decode
from kvflow.backends.hf.engine import HFRunner
from kvflow.components.base import Candidate, Committer, Evictor, Scorer, ScoreRequest, Step, Trajectory
from kvflow.config.schema import LimitsConfig
from kvflow.timing import NULL_CLOCK, PhaseClock


@dataclass
class Proposer:
    """A compiled proposer: a model runner, its evictor, and how it samples."""

    name: str
    runner: HFRunner
    evictor: Evictor
    spec: decode.DecodeSpec


@dataclass
class Plan:
    """Everything the step loop needs, built by `kvflow.runtime.compile`."""

    proposers: list[Proposer]
    scorer: Scorer
    committer: Committer
    limits: LimitsConfig
    seed: int


def run_batch(plan: Plan, trajectories: Sequence[Trajectory], on_done: Callable[[Trajectory], None],
              on_round: Optional[Callable[[], None]] = None, timings: Optional[dict[str, dict]] = None) -> None:
    t0 = time.perf_counter()
    clock = PhaseClock() if timings is not None else NULL_CLOCK
    trajs = list(trajectories)
    for t in trajs:
        for p in plan.proposers:
            t.tokens_generated.setdefault(p.name, 0)
            t.candidates.setdefault(p.name, 0)
            for pname, _ in p.spec.pruners:
                t.pruned.setdefault(pname, 0)
    with clock.phase("prefill"):
        states = {
            p.name: decode.start(p.runner, p.evictor, [t.prompt for t in trajs],
                                 [decode.row_seed(plan.seed, t.problem_id, p.name) for t in trajs],
                                 name=p.name, clock=clock)
            for p in plan.proposers
        }
    base = plan.proposers[0]
    live = list(range(len(trajs)))  # batch rows still decoding; row i of every state is trajs[live[i]]
    while live:
        by_problem: list[list[Candidate]] = [[] for _ in live]
        room = [plan.limits.max_tokens - trajs[i].committed_tokens for i in live]
        proposed: dict[str, list[Candidate]] = {}
        with clock.phase("propose"):
            for group in _by_model(plan.proposers):  # proposers on one model decode in one batch
                jobs = [(states[p.name], p.spec, room,
                         [decode.row_seed(plan.seed, trajs[i].problem_id, p.name, len(trajs[i].steps)) for i in live])
                        for p in group]
                for p, cands in zip(group, decode.propose_together(group[0].runner, jobs, clock=clock)):
                    proposed[p.name] = cands
            for p in plan.proposers:
                for c in proposed[p.name]:
                    by_problem[c.problem].append(c)
                    traj = trajs[live[c.problem]]
                    traj.tokens_generated[p.name] += c.n_tokens
                    traj.candidates[p.name] += 1
                    if c.signals:
                        traj.signals.append({"step": len(traj.steps), "source": c.source, "index": c.index,
                                             "finish": c.finish, "signals": c.signals})
                    if c.pruned:
                        traj.pruned[c.finish.split(":", 1)[1]] += 1
        with clock.phase("score"):
            _score(plan.scorer, [trajs[i] for i in live], [[c for c in cs if not c.pruned] for cs in by_problem])
        commits: dict[str, list[tuple[Optional[int], str]]] = {p.name: [] for p in plan.proposers}
        keep: list[int] = []
        with clock.phase("commit"):
            for row, cands in enumerate(by_problem):
                traj = trajs[live[row]]
                survivors = [c for c in cands if not c.pruned]
                winner: Optional[Candidate] = None
                if survivors:
                    winner = survivors[plan.committer.pick(survivors)]
                elif plan.limits.on_all_pruned == "fallback":
                    with clock.phase("score"):
                        _score(plan.scorer, [traj], [cands])
                    winner = cands[plan.committer.pick(cands)]
                if winner is None:
                    traj.finish = "pruned"
                else:
                    _commit(traj, winner, base, fallback=not survivors)
                    _finish_if_done(traj, winner, plan.limits)
                for p in plan.proposers:
                    own = winner.index if winner is not None and winner.source == p.name else None
                    commits[p.name].append((own, winner.text if winner is not None else ""))
                if traj.finish is None:
                    keep.append(row)
        kept = set(keep)
        done = [live[r] for r in range(len(live)) if r not in kept]
        with clock.phase("sync"):
            for p in plan.proposers:
                states[p.name] = decode.sync(p.runner, states[p.name], commits[p.name], keep, name=p.name, clock=clock)
        with clock.phase("score"):
            plan.scorer.release([trajs[i].problem_id for i in done])
        if timings is not None:
            for i in done:
                timings[trajs[i].problem_id] = _timing(clock, t0)
        with clock.phase("record"):
            for i in done:
                on_done(trajs[i])
            live = [live[r] for r in keep]
            if on_round is not None:
                on_round()


def _timing(clock: PhaseClock, t0: float) -> dict:
    wall = time.perf_counter() - t0
    phases = clock.snapshot()
    phases["other"] = max(0.0, wall - sum(phases.values()))
    return {"wall": round(wall, 4), "phases": {k: round(v, 4) for k, v in sorted(phases.items())}}


def _by_model(proposers: Sequence[Proposer]) -> list[list[Proposer]]:
    groups: dict[int, list[Proposer]] = {}
    for p in proposers:
        groups.setdefault(id(p.runner.model), []).append(p)
    return list(groups.values())


def _score(scorer: Scorer, trajs: Sequence[Trajectory], candidates: Sequence[Sequence[Candidate]]) -> None:
    # A problem with one candidate has nothing to choose: its pick is forced, so it is not
    # scored (its committed step's score stays None). Scorers sync to the trajectory lazily.
    requests = [ScoreRequest(t, c) for t, cs in zip(trajs, candidates) if len(cs) > 1
                for c in cs if scorer.can_score(c.source)]
    if not requests:
        return
    for req, s in zip(requests, scorer.score(requests)):
        req.candidate.score = float(s)


def _commit(traj: Trajectory, winner: Candidate, base: Proposer, *, fallback: bool) -> None:
    n_tokens = winner.n_tokens if winner.source == base.name else len(base.runner.encode(winner.text))
    score = None if winner.score is None or math.isnan(winner.score) else winner.score
    traj.steps.append(Step(winner.text, winner.source, score, n_tokens, fallback))
    traj.committed_tokens += n_tokens


def _finish_if_done(traj: Trajectory, winner: Candidate, limits: LimitsConfig) -> None:
    if winner.finish == "eos":
        traj.finish = "eos"
    elif limits.stop_on_answer and "\\boxed" in winner.text:
        traj.finish = "answer"
    elif len(traj.steps) >= limits.max_steps:
        traj.finish = "cap_steps"
    elif traj.committed_tokens >= limits.max_tokens:
        traj.finish = "cap_tokens"
