"""The engine contract's step-scheduling cases (`EngineContract` inherits them): `step(max_rows)`
decodes whole proposals, oldest first, within the bound; a proposal wider than the bound runs
alone; forwards are timed and counted; an empty queue steps to nothing."""

from __future__ import annotations

from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest
from kvflow.testing.engine_scenarios import NO_DELIMITER, full_cache, run_to_end


class StepContract:
    """Cases of `EngineContract` (which provides the `engine` and `reference` fixtures and `prompt`)."""

    def test_step_respects_max_rows(self, engine, reference):
        """`step(max_rows)` decodes whole proposals, oldest first, never more than `max_rows`
        rows at once; the candidates are those of unbounded steps."""
        spec = SamplingSpec(2, 1.0, 1.0, 6, NO_DELIMITER)

        def propose(max_rows):
            states = engine.start([StartRequest(self.prompt(reference, i), full_cache(), 3) for i in range(3)])
            reqs = [ProposeRequest(s, "base", spec, 30 + j, 100, tag=j) for j, s in enumerate(states)]
            order, widest = [], 0
            engine.submit(reqs)
            assert engine.busy_rows() == 6, f"busy_rows() is {engine.busy_rows()} with 3 proposals of 2 rows queued"
            done = {}
            for _ in range(100_000):
                before = engine.rows_decoded
                ended = engine.step(max_rows)
                widest = max(widest, engine.rows_decoded - before)
                for p in ended:
                    order.append(p.request.tag)
                    done[p.request.tag] = p
                if len(done) == 3:
                    break
            engine.release(states, list(done.values()))
            return [done[j] for j in range(3)], order, widest

        free, _, _ = propose(None)
        forwards = engine.forwards
        bounded, order, widest = propose(2)
        assert widest <= 2, (
            f"step(max_rows=2) decoded {widest} rows in one step (rows_decoded grew by {widest}): start queued "
            "proposals only while the rows decoding stay within max_rows")
        assert engine.forwards > forwards, "forwards did not grow while proposals were decoded"
        assert order == [0, 1, 2], (
            f"with max_rows=2 and proposals of 2 rows each, they must run one after the other, oldest first; "
            f"they ended in the order {order}")
        for a, b in zip(free, bounded):
            assert [c.token_ids for c in a.candidates] == [c.token_ids for c in b.candidates], (
                "candidates differ between step() and step(max_rows=2): a candidate must not depend on how "
                "proposals are batched")
        assert engine.busy_rows() == 0

    def test_a_proposal_wider_than_max_rows_runs_alone(self, engine, reference):
        """When nothing is decoding, the oldest proposal starts even if it alone needs more
        rows than `max_rows`; the next waits until it has ended."""
        spec3, spec1 = SamplingSpec(3, 1.0, 1.0, 5, NO_DELIMITER), SamplingSpec(1, 1.0, 1.0, 5, NO_DELIMITER)
        states = engine.start([StartRequest(self.prompt(reference, i), full_cache(), 3) for i in range(2)])
        reqs = [ProposeRequest(states[0], "base", spec3, 50, 100, tag="wide"),
                ProposeRequest(states[1], "base", spec1, 51, 100, tag="next")]
        order, widest = [], 0
        engine.submit(reqs)
        done = []
        for _ in range(100_000):
            before = engine.rows_decoded
            ended = engine.step(max_rows=2)
            widest = max(widest, engine.rows_decoded - before)
            done += ended
            order += [p.request.tag for p in ended]
            if len(done) == 2:
                break
        assert order == ["wide", "next"], f"proposals ended in the order {order}"
        assert widest <= 3, f"step(max_rows=2) decoded {widest} rows at once; the wide proposal has 3"
        engine.release(states, done)

    def test_forwards_are_timed_and_counted(self, engine, reference):
        """Decode forwards run inside `clock.phase("forward:<proposers>")` (what the timing
        report files under `model:`), and `forwards` / `rows_decoded` count them."""
        from kvflow.timing import PhaseClock

        clock, saved = PhaseClock(), (engine.clock, engine.label)
        (state,) = engine.start([StartRequest(self.prompt(reference, 0), full_cache(), 1)])
        engine.clock, engine.label = clock, "base"
        try:
            forwards, rows = engine.forwards, engine.rows_decoded
            (p,) = run_to_end(engine, [ProposeRequest(state, "base", SamplingSpec(2, 1.0, 1.0, 4, NO_DELIMITER),
                                                      2, 100)])
        finally:
            engine.clock, engine.label = saved
        engine.release([state], [p])
        assert "forward:base" in clock.totals, (
            f"no decode time under clock.phase('forward:base') (phases timed while stepping: "
            f"{sorted(clock.totals)}): run the model's forwards inside the clock the scheduler sets, named after "
            "the proposers decoded")
        assert engine.forwards > forwards and engine.rows_decoded >= engine.forwards - forwards + rows, (
            "forwards and rows_decoded must count the decode forwards and the candidate rows fed to them")

    def test_step_with_nothing_queued_returns_nothing(self, engine):
        assert engine.busy_rows() == 0
        assert engine.step() == []
