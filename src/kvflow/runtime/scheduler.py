"""The step scheduler (DESIGN.md §6): step-level continuous batching over engines.

Every problem is its own small state machine: propose (every proposer's `n` candidates,
pruners watching each token) → score → commit → sync → propose again, until the trajectory
ends. Engines (`kvflow.components.engine`) decode the proposals of all live problems
together, one step at a time; a problem whose candidates have all ended is scored,
committed and synced at once, while the others keep decoding, and a problem that finishes
makes room for the next one, which is admitted (prefilled) right away. This module imports
no backend.

Bounds (`Plan`): each engine decodes at most `batch_problems` × (candidates per problem on
that engine) rows per forward; up to `live_problems` problems are in flight, so that the
decode batch stays full while some problems score, sync, or wait for another engine. With
`kv_budget` (`run.kv_memory`, `kvflow.kv_memory.KVBudget`) a problem is admitted only while
the KV bytes its rows can grow to fit beside those of the problems in flight (reserved at
admission, given back when it ends), and the count bounds are None unless the pipeline sets
them. Problems are admitted after every round of forwards (one per busy engine), not only
when a problem reaches a step boundary: a problem that ends, or a request that arrives,
frees or takes room at the next forward. One taken from the source that does not fit yet
waits, first in line, until problems in flight end.

Results do not depend on scheduling: candidate i of a problem's step s on proposer p samples
from row_seed(row_seed(seed, problem, p, s), i) whatever else is decoded with it. `problem` is
the problem's id, or what `run(..., seed_key=)` names for it (a server seeds a request by the
request's `seed`, several requests may share one, while problem ids stay unique).

Cancellation (`run(..., cancelled=)`): a problem for which `cancelled(traj)` is true when its
proposals have all ended (a step boundary) is not scored or committed: its states and
proposals are released in every engine and its scorer state dropped, its `finish` is set to
"cancelled" (unless already set) and it goes to `on_done` like a finished one. An engine
with the optional `cancel(requests)` (hf) stops such a problem's proposals after the decode
step in which `cancelled` turned true, instead of decoding them to the step's end.

Engines overlap (`Plan.overlap`, `run.overlap_engines`): when several engines have rows to
decode, each engine that computes in this process (an `hf` model, on its own device) steps on
a thread of its own, and engines that decode elsewhere (`streams = True`: SGLang's worker
process) are read in the meantime, as often as their tokens arrive, so their pruners and stop
rules act on tokens while the other forwards run instead of after them. Each computing engine
still steps exactly once per round, on the same rows as without overlap, and a problem's
state machine is unchanged: only wall time differs. `auto` overlaps when it can pay (an engine
that streams, or computing engines on distinct accelerators); on one CPU the forwards would
only share its cores, so they run one after another.

Timing: with a `timings` dict, a finished problem's `timing` is stored under its id before
`on_done`: `wall` from its admission until it finished, split into the exclusive phases the
scheduler spent meanwhile (`prefill`, `propose`, `score`, `commit`, `sync`, `record`, model
forwards nested as `<phase>/forward:<proposers>`, pruning as `propose/prune`, and `other`),
which sum to `wall`. Problems in flight together share that time; it is not divided. A round
in which engines overlapped is one `forward:<proposers>` phase naming every proposer that
decoded in it (`model:base+helper`: both models were running), since wall time cannot be
split between forwards that ran at once.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable, Optional, Sequence

from kvflow.components.base import Candidate, Scorer, ScoreRequest, Step, Trajectory
from kvflow.components.engine import Engine, Proposal, ProposeRequest, StartRequest, SyncRequest, row_seed
from kvflow.config.schema import LimitsConfig
from kvflow.runtime.admission import (Admission, Occupancy, Problem, ProblemTooLarge,  # noqa: F401 - the run's API
                                      describe_admission, prompt_tokens)
from kvflow.runtime.overlap import Overlap
from kvflow.runtime.plan import Plan, Proposer  # noqa: F401 - the scheduler's API
from kvflow.timing import NULL_CLOCK, PhaseClock


def run(plan: Plan, trajectories: Iterable[Trajectory], on_done: Callable[[Trajectory], None], *,
        timings: Optional[dict[str, dict]] = None, occupancy: Optional[Occupancy] = None,
        on_tick: Optional[Callable[[int], None]] = None,
        cancelled: Optional[Callable[[Trajectory], bool]] = None,
        seed_key: Optional[Callable[[Trajectory], str]] = None) -> None:
    """Decode every trajectory to its end, handing each to `on_done` as it finishes (problems
    finish in any order). `trajectories` is consumed lazily, as room frees up; a source fed
    from elsewhere (a Ray worker's, `kvflow.runtime.ray_executor`) may yield None for "nothing
    ready yet": the problems in flight decode on and it is asked again after the next step.
    `on_tick(live)` is called after every decode step with the number of problems in flight
    (for progress). `cancelled` and `seed_key`: see the module docstring."""
    clock = PhaseClock() if timings is not None else NULL_CLOCK
    occupancy = occupancy if occupancy is not None else Occupancy()
    names = {id(e): "+".join(p.name for p in plan.proposers if p.engine is e) for e in plan.engines()}
    for e in plan.engines():
        e.clock, e.label = clock, names[id(e)]
        bound = plan.row_bound(e)
        occupancy.bound[names[id(e)]] = bound if bound is not None else plan.room_in_problems() * plan.rows_per_problem(e)
    if plan.kv_budget is not None:
        occupancy.kv["bound"] = plan.kv_budget.bound
    overlap = Overlap(plan, clock, names, _step)
    try:
        _loop(plan, iter(trajectories), on_done, clock, occupancy, overlap, names, timings, on_tick,
              cancelled, seed_key or _problem_key)
    finally:
        overlap.close()


def _problem_key(traj: Trajectory) -> str:
    return traj.problem_id


def _loop(plan: Plan, source, on_done, clock, occupancy: Occupancy, overlap: "Overlap", names: dict[int, str],
          timings: Optional[dict], on_tick, cancelled=None, key=_problem_key) -> None:
    admission = Admission(plan, source, clock, occupancy, cancelled)
    live: list[Problem] = []
    while True:
        admitted, dropped = admission.next(live)
        if dropped:  # cancelled before they started: nothing to release
            for p in dropped:
                p.traj.finish = p.traj.finish or "cancelled"
            _retire(dropped, dropped[:], timings, clock, on_done)
        if admitted:
            _start(plan, admitted, clock, key)
            live += admitted
        if not live:
            if admission.done:
                return
            continue
        busy = [e for e in plan.engines() if e.busy_rows()]
        together = overlap.wanted(busy)
        with clock.phase("propose"):
            stepped = overlap.step(plan, busy) if together else [(e, *_step(plan, e)) for e in busy]
        for engine, finished, forwards, rows in stepped:
            name = names[id(engine)]
            occupancy.forwards[name] = occupancy.forwards.get(name, 0) + forwards
            occupancy.rows[name] = occupancy.rows.get(name, 0) + rows
            if together:
                occupancy.overlapped[name] = occupancy.overlapped.get(name, 0) + 1
            for proposal in finished:
                _ended(proposal)
        if on_tick is not None:
            on_tick(len(live))
        if cancelled is not None:
            _cancel_proposing(plan, live, cancelled)
        ready = [p for p in live if not p.waiting]
        if cancelled is not None and ready:
            dropped = [p for p in ready if cancelled(p.traj)]
            if dropped:
                _drop(plan, dropped, clock)
                ready = [p for p in ready if p not in dropped]
                admission.ended(dropped)
                _retire(dropped, live, timings, clock, on_done)
        if ready:
            done = _advance(plan, ready, clock, key)
            admission.ended(done)
            _retire(done, live, timings, clock, on_done)


def _retire(ended: list, live: list, timings, clock, on_done) -> None:
    """Problems that ended (finished or cancelled) leave the live set: their timing, then their record."""
    for p in ended:
        live.remove(p)
    if timings is not None:
        for p in ended:
            timings[p.traj.problem_id] = _timing(clock, p)
    with clock.phase("record"):
        for p in ended:
            on_done(p.traj)


def _step(plan: Plan, engine: Engine) -> tuple[list[Proposal], int, int]:
    """One `step()` of `engine`: (finished proposals, forwards run, rows decoded)."""
    before = (engine.forwards, engine.rows_decoded)
    finished = engine.step(plan.row_bound(engine))
    return finished, engine.forwards - before[0], engine.rows_decoded - before[1]


def _cancel_proposing(plan: Plan, live: Sequence[Problem], cancelled) -> None:
    """Cancelled problems whose proposals are still decoding: on an engine that can stop them
    (`Engine.cancel`) they end now, not at their step's end, so the problem is ready and dropped
    this round; an engine that cannot (its `cancel` returns none) decodes them to the step boundary."""
    for prop in plan.proposers:
        going = [p for p in live if prop.name in p.waiting and cancelled(p.traj)]
        if going:
            for proposal in prop.engine.cancel([p.requests[prop.name] for p in going]):
                _ended(proposal)


def _ended(proposal: Proposal) -> None:
    """A proposal handed back by its engine: its problem holds it until sync or release. The
    request is no longer held (it refers back to the problem: a cycle that would keep the
    states it carries for Python's cyclic GC)."""
    problem, proposer = proposal.request.tag
    problem.proposals[proposer] = proposal
    problem.requests.pop(proposer, None)
    problem.waiting.discard(proposer)


def _drop(plan: Plan, problems: Sequence[Problem], clock) -> None:
    """Cancelled problems at a step boundary: their states and proposals released in every
    engine, their scorer state dropped."""
    with clock.phase("sync"):
        for prop in plan.proposers:
            prop.engine.release([p.states.pop(prop.name) for p in problems],
                                [p.proposals.pop(prop.name) for p in problems if prop.name in p.proposals])
    with clock.phase("score"):
        plan.scorer.release([p.traj.problem_id for p in problems])
    for p in problems:
        if p.traj.finish is None:
            p.traj.finish = "cancelled"


def _start(plan: Plan, problems: Sequence[Problem], clock, key=_problem_key) -> None:
    for p in problems:
        t = p.traj
        for prop in plan.proposers:
            t.tokens_generated.setdefault(prop.name, 0)
            t.candidates.setdefault(prop.name, 0)
            for pname, _ in prop.spec.pruners:
                t.pruned.setdefault(pname, 0)
    with clock.phase("prefill"):
        for prop in plan.proposers:
            states = prop.engine.start([StartRequest(p.traj.prompt, prop.evictor, row_seed(plan.seed, key(p.traj), prop.name))
                                        for p in problems])
            for p, s in zip(problems, states):
                p.states[prop.name] = s
    with clock.phase("propose"):
        _submit(plan, problems, key)


def _submit(plan: Plan, problems: Sequence[Problem], key=_problem_key) -> None:
    for prop in plan.proposers:
        requests = []
        for p in problems:
            t = p.traj
            seed = row_seed(plan.seed, key(t), prop.name, len(t.steps))
            requests.append(ProposeRequest(p.states[prop.name], prop.name, prop.spec, seed,
                                           plan.limits.max_tokens - t.committed_tokens, tag=(p, prop.name)))
            p.requests[prop.name] = requests[-1]
            p.waiting.add(prop.name)
        prop.engine.submit(requests)


def _advance(plan: Plan, ready: Sequence[Problem], clock, key=_problem_key) -> list[Problem]:
    """Score, commit and sync every ready problem; resubmit the ones that go on. Returns the
    problems that finished."""
    by_problem = []
    for p in ready:
        cands: list[Candidate] = []
        for prop in plan.proposers:
            for c in p.proposals[prop.name].candidates:
                _tally(p.traj, c)
                cands.append(c)
        by_problem.append(cands)
    with clock.phase("score"):
        _score(plan.scorer, [p.traj for p in ready], [[c for c in cs if not c.pruned] for cs in by_problem])
    winners: list[Optional[Candidate]] = []
    with clock.phase("commit"):
        for p, cands in zip(ready, by_problem):
            survivors = [c for c in cands if not c.pruned]
            winner: Optional[Candidate] = None
            if survivors:
                winner = survivors[plan.committer.pick(survivors)]
            elif plan.limits.on_all_pruned == "fallback":
                with clock.phase("score"):
                    _score(plan.scorer, [p.traj], [cands])
                winner = cands[plan.committer.pick(cands)]
            if plan.record_candidates:  # before the commit: the step index is the one proposed for
                _keep_candidates(p.traj, cands, winner)
            if winner is None:
                p.traj.finish = "pruned"
            else:
                _commit(p.traj, winner, plan.proposers[0], fallback=not survivors)
                _finish_if_done(p.traj, winner, plan.limits)
            winners.append(winner)
    going = [(p, w) for p, w in zip(ready, winners) if p.traj.finish is None]
    done = [p for p in ready if p.traj.finish is not None]
    with clock.phase("sync"):
        for prop in plan.proposers:
            requests = []
            for p, w in going:
                own = w.index if w.source == prop.name else None
                requests.append(SyncRequest(p.states[prop.name], p.proposals.pop(prop.name), own, w.text))
            for p, s in zip([p for p, _ in going], prop.engine.sync(requests) if requests else []):
                p.states[prop.name] = s
            if done:
                prop.engine.release([p.states.pop(prop.name) for p in done], [p.proposals.pop(prop.name) for p in done])
    with clock.phase("score"):
        plan.scorer.release([p.traj.problem_id for p in done])
    with clock.phase("propose"):
        if going:
            _submit(plan, [p for p, _ in going], key)
    return done


def _tally(traj: Trajectory, c: Candidate) -> None:
    traj.tokens_generated[c.source] += c.n_tokens
    traj.candidates[c.source] += 1
    if c.signals:
        traj.signals.append({"step": len(traj.steps), "source": c.source, "index": c.index,
                             "finish": c.finish, "signals": c.signals})
    if c.pruned:
        traj.pruned[c.finish.split(":", 1)[1]] += 1


def _keep_candidates(traj: Trajectory, cands: Sequence[Candidate], winner: Optional[Candidate]) -> None:
    """Every candidate of the step being committed, as `samples.jsonl` records it under
    `all_candidates` (run.record_candidates): the same (step, source, index) as `signals`."""
    step = len(traj.steps)
    for c in cands:
        traj.all_candidates.append({"step": step, "source": c.source, "index": c.index, "text": c.text,
                                    "n_tokens": c.n_tokens, "finish": c.finish, "score": c.score,
                                    "committed": c is winner})


def _timing(clock: PhaseClock, p: Problem) -> dict:
    wall = time.perf_counter() - p.admitted
    now = clock.snapshot()
    phases = {k: v - p.phases_at_admission.get(k, 0.0) for k, v in now.items()}
    phases = {k: v for k, v in phases.items() if v > 0}
    phases["other"] = max(0.0, wall - sum(phases.values()))
    return {"wall": round(wall, 6), "phases": {k: round(v, 6) for k, v in sorted(phases.items())}}


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
    n_tokens = winner.n_tokens if winner.source == base.name else len(base.engine.encode(winner.text))
    score = None if winner.score is None or math.isnan(winner.score) else winner.score
    kept = winner.n_tokens - 1 if winner.finish == "eos" else winner.n_tokens  # the EOS is not in the text
    traj.steps.append(Step(winner.text, winner.source, score, n_tokens, fallback,
                           token_ids=winner.token_ids[:kept], logprobs=winner.logprobs[:kept]))
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


