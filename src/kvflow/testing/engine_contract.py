"""The contract every engine must pass (`kvflow.components.engine`), as a pytest suite.

Built-in and third-party engines run the same tests. In a backend plugin's test suite:

    import pytest
    from kvflow.testing.engine_contract import EngineContract

    class TestMyEngine(EngineContract):
        @pytest.fixture(scope="class")
        def engine_factory(self):
            # model_dir: a saved tiny random-weight Qwen2 with its tokenizer (config.json
            # names `architectures`); returns an Engine over it, in float32 on the CPU
            return lambda model_dir: MyBackend.load(ModelConfig(id=str(model_dir), backend="mine", dtype="float32"))

pytest collects the inherited `test_*` methods. References are the same weights run by plain
transformers (`model.generate`), so the suite checks what a user relies on:

- greedy proposals reproduce `generate` token for token, with a full cache and with an
  evicting cache whose budget exceeds the sequence;
- candidates: n per request, indexed 0..n-1, `source` the proposer, `text` the tokens
  decoded (EOS dropped), logprobs and entropies per token and in range, finish reasons valid,
  `max_step_tokens` and `token_room` respected, the delimiter ending a step where it completes;
- sampling is seeded per request and candidate: same seed, same candidates; a request's
  candidates do not depend on the other requests decoded with it; another seed differs;
- pruners see every token of every live row and stop flagged rows at once;
- sync: adopting the committed candidate and ingesting committed text both leave a state
  from which greedy decoding continues exactly as `generate` over the whole text would;
- nothing is left queued once every proposal has ended, and release frees what was handed back.
"""

from __future__ import annotations

import pytest

from kvflow.components.base import Pruner, PrunerParams
from kvflow.components.engine import Engine, ProposeRequest, SamplingSpec, StartRequest, SyncRequest

QUESTIONS = ["How many clips did Natalia sell?", "Natalia sold 48 clips in April. How many in May?",
             "What is 48 / 2 + 24?"]
NO_DELIMITER = "\x00\x01\x02"  # never produced: steps end at max_step_tokens or EOS
FINISHES = {"eos", "delimiter", "max_step_tokens"}


class _StopAt(Pruner):
    """Flags every row once it has `threshold` tokens; records what it saw."""

    Params = PrunerParams
    needs_text = False

    def __init__(self, at: int) -> None:
        super().__init__(PrunerParams(threshold=at))
        self.seen: list[list[int]] = []

    def signal(self, trace):
        return trace.n_tokens.float()

    def check(self, trace):
        self.seen.append(trace.n_tokens.tolist())
        return trace.n_tokens >= int(self.params.threshold)


def _full():
    from kvflow.registry import get_registry

    cls = get_registry().get("evictors", "none")
    return cls(cls.Params())


def _evicting(budget: int):
    from kvflow.registry import get_registry

    cls = get_registry().get("evictors", "random")
    return cls(cls.Params(budget=budget, buffer=16, window=4))


def run_to_end(engine: Engine, requests) -> list:
    """Submit requests and step until each has ended: their Proposals, in request order."""
    engine.submit(requests)
    done = {}
    for _ in range(100_000):
        for p in engine.step():
            done[id(p.request)] = p
        if len(done) == len(requests):
            return [done[id(r)] for r in requests]
    raise AssertionError("proposals did not end")


class EngineContract:
    """Subclass and provide `engine_factory` (see the module docstring)."""

    @pytest.fixture(scope="class")
    def engine_factory(self):
        raise NotImplementedError("provide an engine_factory fixture: model_dir -> Engine")

    @pytest.fixture(scope="class")
    def contract_model_dir(self, tmp_path_factory):
        from kvflow.testing.pipelines import tiny_model_dir

        return tiny_model_dir(tmp_path_factory.mktemp("engine-contract"), "qwen2", seed=3)

    @pytest.fixture(scope="class")
    def engine(self, engine_factory, contract_model_dir):
        return engine_factory(contract_model_dir)

    @pytest.fixture(scope="class")
    def reference(self, contract_model_dir):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(contract_model_dir, dtype="float32").eval()
        return model, AutoTokenizer.from_pretrained(contract_model_dir)

    # ------------------------------------------------------------------ helpers

    def prompt(self, reference, i: int) -> str:
        _, tok = reference
        return tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i]}], tokenize=False,
                                       add_generation_prompt=True)

    def greedy(self, reference, text, n: int, *, scores: bool = False):
        """Greedy `generate` of n tokens after `text` (a string, or pieces tokenized one by one);
        with scores=True also each token's logprob and the entropy (nats) of its distribution."""
        import torch

        model, tok = reference
        pieces = [text] if isinstance(text, str) else text
        ids = torch.tensor([[i for piece in pieces for i in tok(piece, add_special_tokens=False)["input_ids"]]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        new = out.sequences[0, ids.shape[1]:].tolist()
        if not scores:
            return new
        logp = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)  # [n, vocab]
        chosen = logp.gather(-1, torch.tensor(new)[:, None]).squeeze(-1).tolist()
        entropy = (-(logp.exp() * logp).nan_to_num().sum(-1)).tolist()
        return new, chosen, entropy

    def eos(self, reference) -> int:
        return reference[1].eos_token_id

    def until_eos(self, ids, eos):
        return ids[: ids.index(eos) + 1] if eos in ids else ids

    # ------------------------------------------------------------------ tests

    def test_is_an_engine(self, engine):
        assert isinstance(engine, Engine)
        assert isinstance(engine.backend, str) and engine.backend
        assert engine.encode("Natalia sold 48 clips") and all(isinstance(i, int) for i in engine.encode("48"))
        layers, heads, dim, elem = engine.kv_shape()
        assert layers >= 1 and heads >= 1 and dim >= 1 and elem in (2, 4)

    def evictor(self, engine, kind: str, budget: int = 400):
        """The full cache, or an evicting one (skips the test on an engine that does not evict)."""
        if kind == "full":
            return _full()
        if not getattr(engine, "evicts", True):
            pytest.skip(f"the {engine.backend} engine runs full-context proposers only")
        return _evicting(budget)

    @pytest.mark.parametrize("evictor", ["full", "budget-above-length"])
    def test_greedy_proposal_equals_generate(self, engine, reference, evictor):
        ev = self.evictor(engine, evictor)
        prompts = [self.prompt(reference, i) for i in range(2)]
        states = engine.start([StartRequest(p, ev, 7) for p in prompts])
        spec = SamplingSpec(1, 0.0, 1.0, 24, NO_DELIMITER)
        proposals = run_to_end(engine, [ProposeRequest(s, "base", spec, 0, 100) for s in states])
        for p, prompt in zip(proposals, prompts):
            (c,) = p.candidates
            ids, logprobs, entropies = self.greedy(reference, prompt, 24, scores=True)
            assert c.token_ids == self.until_eos(ids, self.eos(reference))
            assert c.logprobs == pytest.approx(logprobs[: c.n_tokens], abs=1e-4)  # the model's own, temperature 1
            # an engine that estimates entropies (from top-k logprobs) says so and stays close
            tol = dict(abs=1e-3) if getattr(engine, "exact_entropy", True) else dict(rel=0.02, abs=0.02)
            assert c.entropies == pytest.approx(entropies[: c.n_tokens], **tol)
            assert c.finish == ("eos" if c.token_ids[-1] == self.eos(reference) else "max_step_tokens")
        engine.release(states, proposals)
        assert engine.busy_rows() == 0

    def test_candidates_are_well_formed(self, engine, reference):
        (state,) = engine.start([StartRequest(self.prompt(reference, 0), _full(), 7)])
        spec = SamplingSpec(4, 1.0, 0.9, 12, " ")
        (p,) = run_to_end(engine, [ProposeRequest(state, "helper", spec, 5, 7, tag="mine")])
        assert p.request.tag == "mine" and len(p.candidates) == 4
        tok = reference[1]
        eos = self.eos(reference)
        for i, c in enumerate(p.candidates):
            assert (c.index, c.source) == (i, "helper")
            assert c.finish in FINISHES
            assert 1 <= c.n_tokens <= 7  # token_room 7 < max_step_tokens 12
            assert len(c.logprobs) == len(c.entropies) == c.n_tokens
            assert all(lp <= 1e-4 for lp in c.logprobs) and all(e >= -1e-4 for e in c.entropies)
            body = c.token_ids[:-1] if c.finish == "eos" else c.token_ids
            assert c.text == tok.decode(body)
            assert (c.finish == "eos") == (c.token_ids[-1] == eos)
            before = tok.decode(c.token_ids[:-1])
            if c.finish == "delimiter":
                assert " " in c.text and " " not in before  # the step ends where the delimiter completes
            elif c.finish == "max_step_tokens":
                assert c.n_tokens == 7 and " " not in c.text
        assert any(c.finish == "delimiter" for c in p.candidates), "no candidate met the delimiter"
        engine.release([state], [p])

    def test_sampling_is_seeded_and_independent_of_the_batch(self, engine, reference):
        spec = SamplingSpec(3, 1.0, 0.95, 10, NO_DELIMITER)

        def candidates(seed, others=0):
            prompts = [self.prompt(reference, 1)] + [self.prompt(reference, i % 3) for i in range(others)]
            ev = _evicting(8) if getattr(engine, "evicts", True) else _full()
            states = engine.start([StartRequest(p, ev, 9) for p in prompts])
            reqs = [ProposeRequest(s, "base", spec, seed + 100 * j, 100) for j, s in enumerate(states)]
            proposals = run_to_end(engine, reqs)
            engine.release(states, proposals)
            return [c.token_ids for c in proposals[0].candidates]

        alone = candidates(11)
        assert candidates(11) == alone
        assert candidates(11, others=2) == alone  # decoded alongside other requests
        assert candidates(12) != alone
        assert len({tuple(c) for c in alone}) > 1  # candidates of one request differ

    def test_pruners_stop_rows_at_once(self, engine, reference):
        pruner = _StopAt(3)
        spec = SamplingSpec(2, 1.0, 1.0, 10, NO_DELIMITER, pruners=(("stop3", pruner),))
        (state,) = engine.start([StartRequest(self.prompt(reference, 2), _full(), 1)])
        (p,) = run_to_end(engine, [ProposeRequest(state, "base", spec, 3, 100)])
        for c in p.candidates:
            assert c.finish == "pruned:stop3" or (c.finish == "eos" and c.n_tokens <= 3)
            assert c.n_tokens <= 3
        # every live row after each of its tokens, once (rows may be checked together or apart)
        seen = [x for trace in pruner.seen for x in trace]
        assert seen.count(1) == 2 and seen.count(2) == 2
        engine.release([state], [p])

    @pytest.mark.parametrize("evictor", ["full", "budget-above-length"])
    def test_adopt_and_ingest_continue_like_generate(self, engine, reference, evictor):
        ev = self.evictor(engine, evictor)
        prompt = self.prompt(reference, 1)
        spec = SamplingSpec(1, 0.0, 1.0, 8, NO_DELIMITER)
        committed = "Step 1: In May she sold 48 / 2 = 24 clips.\n\n"
        # ingest: the committed text comes from elsewhere (another proposer)
        (state,) = engine.start([StartRequest(prompt, ev, 3)])
        (state,) = engine.sync([SyncRequest(state, None, None, committed)])
        (p,) = run_to_end(engine, [ProposeRequest(state, "base", spec, 0, 100)])
        expected = self.until_eos(self.greedy(reference, [prompt, committed], 8), self.eos(reference))
        assert p.candidates[0].token_ids == expected
        # adopt: the engine's own candidate is committed, and decoding goes on from it
        (state2,) = engine.start([StartRequest(prompt, ev, 3)])
        (first,) = run_to_end(engine, [ProposeRequest(state2, "base", spec, 0, 100)])
        (state2,) = engine.sync([SyncRequest(state2, first, 0, first.candidates[0].text)])
        (second,) = run_to_end(engine, [ProposeRequest(state2, "base", spec, 0, 100)])
        both = first.candidates[0].token_ids + second.candidates[0].token_ids
        eos = self.eos(reference)
        if eos not in first.candidates[0].token_ids:
            assert both == self.until_eos(self.greedy(reference, prompt, 16), eos)
        engine.release([state, state2], [p, second])
        assert engine.busy_rows() == 0

    def test_step_with_nothing_queued_returns_nothing(self, engine):
        assert engine.busy_rows() == 0
        assert engine.step() == []
