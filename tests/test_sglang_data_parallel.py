"""SGLang data parallelism (`dp_size: 2`) on the CPU, one core per replica (kvflow's thread
binding, as for `tp_size: 2`): a problem's state lives on one replica, every request made
from it is routed there (SGLang's `routed_dp_rank`), and its tokens are those of `dp_size: 1`
(here: `hf`'s, which `dp_size: 1` equals). A full-context engine with two replicas keeps
decoding the same tokens too.
"""

from __future__ import annotations

from conftest import require_sglang
from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest
from kvflow.config.schema import ModelConfig
from kvflow.registry import get_registry
from kvflow.testing.engine_contract import run_to_end
from kvflow.testing.engine_parity import NEVER, greedy_steps
from kvflow.testing.engine_parity import chat_prompt as _prompt


def _evictor(kind: str, **params):
    cls = get_registry().get("evictors", kind)
    if kind == "none":
        return cls(cls.Params())
    return cls(cls.Params(**{"budget": 16, "buffer": 8, "window": 4, **params}))


def test_data_parallel_replicas_hold_the_states_routed_to_them(shared_tiny_qwen, hf_engine):
    require_sglang()
    from kvflow.backends.sglang import SGLangBackend

    engine = SGLangBackend.load(ModelConfig(backend="sglang", id=str(shared_tiny_qwen), dtype="float32",
                                            device="cpu", engine={"dp_size": 2}))
    try:
        assert engine.dp_size == 2 and engine.settings()["dp_size"] == 2
        # two evicted states at once: the second goes to the other replica; each one's ingests,
        # candidates and adoptions run on its own replica (a request sent to the other one would
        # not find the snapshot it starts from, and fail)
        got, want, states = {}, {}, []
        for kind in ("rkv", "h2o"):
            got[kind], state = greedy_steps(engine, _evictor(kind))
            want[kind], ref = greedy_steps(hf_engine, _evictor(kind))
            hf_engine.release([ref])
            states.append(state)
        assert [s.dp_rank for s in states] == [0, 1]
        for kind in got:
            assert [[(t, f) for t, f, _ in step] for step in got[kind]] == \
                   [[(t, f) for t, f, _ in step] for step in want[kind]], kind
        info = engine.server_state()
        assert len(info["replicas"]) == 2
        assert all(r["compactions"] > 0 and r["snapshots"] >= 1 for r in info["replicas"]), info["replicas"]
        engine.release(states)

        # a full-context state is routed too (its prefix stays in one replica's radix cache)
        spec = SamplingSpec(1, 0.0, 1.0, 24, NEVER)
        tokens = {}
        for e in (hf_engine, engine):
            starts = e.start([StartRequest(_prompt(e), _evictor("none"), 1), StartRequest(_prompt(e) + "Hi", _evictor("none"), 2)])
            proposals = run_to_end(e, [ProposeRequest(s, "helper", spec, 0, 400) for s in starts])
            tokens[e.backend] = [p.candidates[0].token_ids for p in proposals]
            if e is engine:
                assert sorted(s.dp_rank for s in starts) == [0, 1]
            e.release(starts, proposals)
        assert tokens["sglang"] == tokens["hf"]
    finally:
        engine.worker.close()
