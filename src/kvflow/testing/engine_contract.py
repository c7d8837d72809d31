"""The contract every engine must pass (`kvflow.components.engine`), as a pytest suite.

Built-in and third-party engines run the same tests. In a backend plugin's test suite:

    import pytest
    from kvflow.testing.engine_contract import EngineContract

    class TestMyEngine(EngineContract):
        @pytest.fixture(scope="class")
        @classmethod
        def engine_factory(cls):
            # model_dir: a saved tiny random-weight Qwen2 with its tokenizer (config.json
            # names `architectures`); returns an Engine over it, in float32 on the CPU
            return lambda model_dir: MyBackend.load(ModelConfig(id=str(model_dir), backend="mine", dtype="float32"))

pytest collects the inherited `test_*` methods. The fixture is class-scoped (the engine is
loaded once per class) and, like every class-scoped fixture under pytest 9 and 10, a
`@classmethod` under `@pytest.fixture` (pytest 9 deprecates class-scoped fixtures that are
instance methods, and pytest 10 removes them). References are the same weights run by plain
transformers (`model.generate`, or one forward over the whole sequence), so the suite checks
what a user relies on:

- greedy proposals reproduce `generate` token for token, with a full cache and with an
  evicting cache whose budget exceeds the sequence (logprobs and entropies too);
- sampling follows the spec: every sampled token lies in the top-p nucleus of the model's
  distribution at the spec's temperature, its logprob is the model's own (temperature 1)
  and its entropy that of the sampling distribution (after temperature, before top-p);
- candidates: n per request, indexed 0..n-1, `source` the proposer, `text` the tokens
  decoded (EOS dropped), logprobs, entropies and token confidences per token and in range
  (confidences exact: DeepConf's, minus the mean top-20 log-probability), finish reasons valid,
  `max_step_tokens` and `token_room` respected, the delimiter ending a step where it
  completes, also when it spans two tokens;
- sampling is seeded per request and candidate: same seed, same candidates; a request's
  candidates do not depend on the other requests decoded with it; another seed differs;
- pruners see every token of every live row and stop flagged rows at once; a stop rule on
  the same token wins (the row is not shown to them); the first flagging pruner names the
  finish; recorded signals are each pruner's own `signal()` at every live token;
- `step(max_rows)`: whole proposals, oldest first, never more than `max_rows` rows decoding
  (save one proposal larger than `max_rows` alone), the same candidates as unbounded;
  `busy_rows()`, `forwards` and `rows_decoded` count, forwards run in `clock.phase("forward:...")`;
- the scoring session gives the model's log-probabilities of a text after the prompt and
  each committed step, tokenized step by step, follows a trajectory that grows, and
  forgets a released problem;
- sync: adopting the committed candidate and ingesting committed text both leave a state
  from which greedy decoding continues exactly as `generate` over the whole text would;
- nothing is left queued once every proposal has ended, and release frees what was handed back.

An engine whose entropies are estimates sets `exact_entropy = False` (entropies are then
compared within 2%), one that runs full-context proposers only `evicts = False` (the
evicting cases skip). The suite checks what the engine's protocol version (`protocol`,
"0.1" when absent; docs/changelog.md) promised: token confidences from 0.2 on. An engine of
an older protocol than kvflow's passes with a FutureWarning that says what it lacks.
"""

from __future__ import annotations

import pytest

from kvflow.components.base import CONFIDENCE_TOP_K, Step, StepTrace, Trajectory
from kvflow.components.engine import (PROTOCOL_VERSION, Engine, ProposeRequest, SamplingSpec, StartRequest,
                                     SyncRequest, check_protocol, speaks)
from kvflow.testing.engine_contract_steps import StepContract
from kvflow.testing.engine_scenarios import (  # noqa: F401 - the contract's scenarios, imported from here by engines' tests
    FINISHES, NO_DELIMITER, NUCLEUS_SLACK, QUESTIONS, SCORED_STEPS, SCORED_TEXTS, StopAt, _evicting, _Probe, full_cache,
    run_to_end)


class EngineContract(StepContract):
    """Subclass and provide `engine_factory` (see the module docstring)."""

    @pytest.fixture(scope="class")
    @classmethod
    def engine_factory(cls):
        raise NotImplementedError("provide an engine_factory fixture: model_dir -> Engine")

    @pytest.fixture(scope="class")
    @classmethod
    def contract_model_dir(cls, tmp_path_factory):
        from kvflow.testing.pipelines import tiny_model_dir

        return tiny_model_dir(tmp_path_factory.mktemp("engine-contract"), "qwen2", seed=3)

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, engine_factory, contract_model_dir):
        return engine_factory(contract_model_dir)

    @pytest.fixture(scope="class")
    @classmethod
    def reference(cls, contract_model_dir):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(contract_model_dir, dtype="float32").eval()
        return model, AutoTokenizer.from_pretrained(contract_model_dir)

    # ------------------------------------------------------------------ helpers

    def prompt(self, reference, i: int) -> str:
        _, tok = reference
        return tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i]}], tokenize=False,
                                       add_generation_prompt=True)

    def encode(self, reference, text: str) -> list[int]:
        return reference[1](text, add_special_tokens=False)["input_ids"]

    def greedy(self, reference, text, n: int, *, scores: bool = False):
        """Greedy `generate` of n tokens after `text` (a string, or pieces tokenized one by one);
        with scores=True also each token's logprob, the entropy (nats) of its distribution and
        its token confidence (minus the mean of the top-`CONFIDENCE_TOP_K` log-probabilities)."""
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
        k = min(CONFIDENCE_TOP_K, logp.shape[-1])
        confidence = (-logp.sort(dim=-1, descending=True).values[:, :k].mean(-1)).tolist()
        return new, chosen, entropy, confidence

    def logits(self, reference, context: list[int], tokens: list[int]):
        """The reference model's logits [len(tokens), vocab] (float32) for each of `tokens`
        after `context` and the tokens before it: one forward over the whole sequence."""
        import torch

        model, _ = reference
        ids = torch.tensor([context + tokens])
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
        return out[len(context) - 1 : len(context) - 1 + len(tokens)]

    def eos(self, reference) -> int:
        return reference[1].eos_token_id

    def until_eos(self, ids, eos):
        return ids[: ids.index(eos) + 1] if eos in ids else ids

    def entropy_tolerance(self, engine) -> dict:
        """An engine that estimates entropies (from top-k logprobs) says so and stays close."""
        return dict(abs=1e-3) if engine.exact_entropy else dict(rel=0.02, abs=0.02)

    # ------------------------------------------------------------------ tests

    def test_is_an_engine(self, engine):
        assert isinstance(engine, Engine)
        assert isinstance(engine.backend, str) and engine.backend
        assert engine.encode("Natalia sold 48 clips") and all(isinstance(i, int) for i in engine.encode("48"))
        layers, heads, dim, elem = engine.kv_shape()
        assert layers >= 1 and heads >= 1 and dim >= 1 and elem in (2, 4)

    def test_speaks_a_served_protocol(self, engine):
        """The engine's `protocol` is one this kvflow serves; an older one than kvflow's is
        deprecated: loading it warns (FutureWarning), naming what it does not fill."""
        import warnings

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            check_protocol(engine, once=False)
        deprecated = [w for w in seen if issubclass(w.category, FutureWarning)]
        if speaks(engine, PROTOCOL_VERSION):
            assert not deprecated
        else:
            assert deprecated and "docs/changelog.md" in str(deprecated[0].message)

    def evictor(self, engine, kind: str, budget: int = 400):
        """The full cache, or an evicting one (skips the test on an engine that does not evict)."""
        if kind == "full":
            return full_cache()
        if not engine.evicts:
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
            ids, logprobs, entropies, confidences = self.greedy(reference, prompt, 24, scores=True)
            assert c.token_ids == self.until_eos(ids, self.eos(reference))
            assert c.logprobs == pytest.approx(logprobs[: c.n_tokens], abs=1e-4)  # the model's own, temperature 1
            # at temperature 0 the entropy is the temperature-1 distribution's (not greedy's point mass)
            assert c.entropies == pytest.approx(entropies[: c.n_tokens], **self.entropy_tolerance(engine))
            if speaks(engine, "0.2"):  # Candidate.confidences: engine protocol 0.2
                assert c.confidences == pytest.approx(confidences[: c.n_tokens], abs=1e-4), (
                    "token confidences are not minus the mean top-20 temperature-1 log-probability (exact on every "
                    "engine)")
            assert c.finish == ("eos" if c.token_ids[-1] == self.eos(reference) else "max_step_tokens")
        engine.release(states, proposals)
        assert engine.busy_rows() == 0

    def test_sampling_follows_the_spec(self, engine, reference):
        """Sampled tokens lie in the top-p nucleus of the distribution at the spec's
        temperature; logprobs are the model's own at temperature 1; entropies are the sampling
        distribution's, after temperature and before top-p. The nucleus at top_p = 0.05 holds
        a few tokens of this flat model's ~400, so an engine that samples from the whole
        distribution fails at once."""
        import torch

        temperature, top_p = 0.7, 0.05
        prompt = self.prompt(reference, 2)
        (state,) = engine.start([StartRequest(prompt, full_cache(), 5)])
        spec = SamplingSpec(4, temperature, top_p, 8, NO_DELIMITER)
        (p,) = run_to_end(engine, [ProposeRequest(state, "base", spec, 41, 100)])
        context = self.encode(reference, prompt)
        for c in p.candidates:
            logits = self.logits(reference, context, c.token_ids)
            logp = torch.log_softmax(logits, dim=-1)
            probs = torch.softmax(logits / temperature, dim=-1)
            entropy = -(probs * probs.log()).nan_to_num().sum(-1)
            confidence = -logp.topk(min(CONFIDENCE_TOP_K, logp.shape[-1]), dim=-1).values.mean(-1)  # temperature 1
            if speaks(engine, "0.2"):  # Candidate.confidences: engine protocol 0.2
                assert c.confidences == pytest.approx(confidence.tolist(), abs=1e-4), (
                    f"candidate {c.index}: token confidences are not those of the model's own distribution (minus "
                    f"the mean top-{CONFIDENCE_TOP_K} temperature-1 log-probability), whatever the temperature and "
                    f"top-p")
            for k, token in enumerate(c.token_ids):
                before = float(probs[k][probs[k] > probs[k, token]].sum())  # mass of the more probable tokens
                assert before < top_p + NUCLEUS_SLACK, (
                    f"candidate {c.index}, token {k}: sampled token {token} lies outside the top-p nucleus "
                    f"(top_p={top_p}: the tokens more probable than it already hold {before:.3f} of the mass at "
                    f"temperature {temperature}); is top_p applied?")
                assert c.logprobs[k] == pytest.approx(float(logp[k, token]), abs=1e-4), (
                    f"candidate {c.index}, token {k}: logprob {c.logprobs[k]:.5f} is not the model's own "
                    f"temperature-1 log-probability {float(logp[k, token]):.5f} (sampled at temperature "
                    f"{temperature}, top_p {top_p}: logprobs must not depend on either)")
                assert c.entropies[k] == pytest.approx(float(entropy[k]), **self.entropy_tolerance(engine)), (
                    f"candidate {c.index}, token {k}: entropy {c.entropies[k]:.4f} is not that of the sampling "
                    f"distribution after temperature {temperature} and before top-p ({float(entropy[k]):.4f})")
        assert len({tuple(c.token_ids) for c in p.candidates}) > 1, "the candidates should differ"
        engine.release([state], [p])

    def test_delimiter_spanning_two_tokens_ends_the_step(self, engine, reference):
        """The delimiter is matched on the text, across token boundaries: a delimiter made of
        the last character of one greedy token and the first of the next ends the step at the
        second token."""
        _, tok = reference
        delimiter = None
        for i in (1, 2, 0):  # the first prompt whose greedy text has such a pair of tokens
            prompt = self.prompt(reference, i)
            ids = self.until_eos(self.greedy(reference, prompt, 24), self.eos(reference))
            pieces = [tok.decode([t]) for t in ids]
            for k in range(len(pieces) - 1):
                a, b = pieces[k], pieces[k + 1]
                if not a or not b or ids[k + 1] == self.eos(reference):
                    continue
                d = a[-1] + b[0]
                if any(ch.isspace() or ch == "\ufffd" for ch in d):
                    continue
                first = next(j for j in range(len(pieces)) if d in "".join(pieces[: j + 1]))
                if any(d in piece for piece in pieces[: first + 1]):
                    continue  # inside one token: not what this case is about
                delimiter, end = d, first
                break
            if delimiter is not None:
                break
        assert delimiter is not None, "the contract's greedy texts have no delimiter to try across two tokens"
        (state,) = engine.start([StartRequest(prompt, full_cache(), 5)])
        spec = SamplingSpec(1, 0.0, 1.0, 24, delimiter)
        (p,) = run_to_end(engine, [ProposeRequest(state, "base", spec, 0, 100)])
        (c,) = p.candidates
        assert (c.finish, c.token_ids) == ("delimiter", ids[: end + 1]), (
            f"delimiter {delimiter!r} completes at token {end} across the boundary of tokens {end - 1} and {end} "
            f"({pieces[end - 1]!r} + {pieces[end]!r}): the step must end there with finish 'delimiter', but it "
            f"ended after {c.n_tokens} tokens with {c.finish!r}; match the delimiter on the text so far, not "
            "within one token's piece")
        engine.release([state], [p])

    def test_stop_rules_win_over_pruners(self, engine, reference):
        """A row that a stop rule ends on this token is not live: pruners do not see it, and
        its finish is the stop rule's. Here the pruner flags every row at its 3rd token, the
        step cap (max_step_tokens, or token_room) ends it there too."""
        prompt = self.prompt(reference, 1)
        by_cap, by_room = StopAt(3), StopAt(3)
        states = engine.start([StartRequest(prompt, full_cache(), 2) for _ in range(2)])
        reqs = [ProposeRequest(states[0], "base", SamplingSpec(2, 1.0, 1.0, 3, NO_DELIMITER,
                                                               pruners=(("stop3", by_cap),)), 8, 100),
                ProposeRequest(states[1], "base", SamplingSpec(2, 1.0, 1.0, 10, NO_DELIMITER,
                                                               pruners=(("stop3", by_room),)), 9, 3)]
        for p, pruner in zip(run_to_end(engine, reqs), (by_cap, by_room)):
            for c in p.candidates:
                assert c.finish in ("max_step_tokens", "eos"), (
                    f"candidate {c.index} ended with {c.finish!r} at token {c.n_tokens}, where the step cap ends "
                    "it: a stop rule on the same token wins over a pruner")
            seen = [x for trace in pruner.seen for x in trace]
            assert 3 not in seen, (
                f"pruners were shown rows at their 3rd token (counts seen: {sorted(set(seen))}), which the step "
                "cap had already ended: only rows still live after the stop rules go to the pruners")
        engine.release(states, [])

    def test_the_first_flagging_pruner_names_the_finish(self, engine, reference):
        first, second = StopAt(2), StopAt(2)
        spec = SamplingSpec(2, 1.0, 1.0, 10, NO_DELIMITER, pruners=(("first", first), ("second", second)))
        (state,) = engine.start([StartRequest(self.prompt(reference, 0), full_cache(), 1)])
        (p,) = run_to_end(engine, [ProposeRequest(state, "base", spec, 4, 100)])
        for c in p.candidates:
            assert c.finish == "pruned:first" or (c.finish == "eos" and c.n_tokens <= 2), (
                f"candidate {c.index} ended with {c.finish!r}: when two pruners flag a row on the same token, "
                "the first in the spec's order names the finish")
        engine.release([state], [p])

    def test_recorded_signals_are_the_pruners_own(self, engine, reference):
        """With `record_signals`, each candidate carries every pruner's `signal()` at every
        token at which it was live: all of its tokens if a pruner stopped it, all but the last
        if a stop rule did. Each value is what the pruner's `signal()` gives on a trace of the
        candidate's own tokens so far (entropies, token count, and text: its tokens' texts
        decoded one by one and joined)."""
        import torch

        probes = {name: _Probe(name) for name in ("entropy", "text", "count")}
        pruners = (("stop4", StopAt(4)),) + tuple(probes.items())
        spec = SamplingSpec(4, 1.0, 1.0, 8, " ", pruners=pruners, record_signals=True)
        (state,) = engine.start([StartRequest(self.prompt(reference, 1), full_cache(), 6)])
        (p,) = run_to_end(engine, [ProposeRequest(state, "base", spec, 17, 100)])
        _, tok = reference
        recorded = 0
        for c in p.candidates:
            live = c.n_tokens if c.pruned else c.n_tokens - 1  # tokens at which the row was live
            pieces = [tok.decode([t]) for t in c.token_ids]
            for name, pruner in (("stop4", pruners[0][1]),) + tuple(probes.items()):
                values = c.signals.get(name, [])
                assert len(values) == live, (
                    f"record_signals: candidate {c.index} ({c.finish} after {c.n_tokens} tokens) carries "
                    f"{len(values)} values of {name!r}, not {live}: one per token at which it was live")
                for k, value in enumerate(values, start=1):
                    own = StepTrace(torch.tensor([c.entropies[:k]]), torch.tensor([k]), ["".join(pieces[:k])])
                    want = float(pruner.signal(own)[0])
                    assert value == pytest.approx(want, rel=1e-5, abs=1e-4), (
                        f"record_signals: candidate {c.index}, token {k}: recorded {name!r} = {value}, but the "
                        f"pruner's signal() on the candidate's own trace up to that token gives {want}")
                recorded += len(values)
        assert recorded, "record_signals: no candidate carries signals"
        engine.release([state], [p])


    def test_scoring_session_matches_the_model(self, engine, reference):
        """`scoring_session().token_logprobs(trajectories, texts)`: a list per text with the
        model's log-probability of each token of `encode(text)` after the prompt and every
        committed step (each tokenized on its own), following a trajectory that grows, and
        forgetting a released problem (its id may come back with another trajectory)."""
        import torch

        try:
            session = engine.scoring_session()
        except Exception as e:  # noqa: BLE001 — the contract reports what the scorer would meet
            raise AssertionError(f"scoring_session() raised {type(e).__name__}: {e} (the `likelihood` scorer "
                                 "with a model on this backend needs it)") from e
        enc = lambda text: self.encode(reference, text)  # noqa: E731
        assert enc("".join(SCORED_STEPS)) != [i for s in SCORED_STEPS for i in enc(s)], "the scenario needs steps that tokenize apart"

        def expected(traj, text):
            context = enc(traj.prompt) + [i for s in traj.steps for i in enc(s.text)]
            logp = torch.log_softmax(self.logits(reference, context, enc(text)), dim=-1)
            return logp.gather(-1, torch.tensor(enc(text))[:, None]).squeeze(-1).tolist()

        def check(trajs, texts, when):
            got = session.token_logprobs(trajs, texts)
            assert isinstance(got, list) and len(got) == len(texts), (
                f"token_logprobs() must return a list with one entry per text ({when})")
            for t, text, lps in zip(trajs, texts, got):
                assert isinstance(lps, list) and len(lps) == len(enc(text)) and all(isinstance(x, float) for x in lps), (
                    f"token_logprobs(): one float per token of encode(text) ({len(enc(text))}), got {lps!r} ({when})")
                want = expected(t, text)
                assert lps == pytest.approx(want, abs=1e-4), (
                    f"token_logprobs() of {text!r} for problem {t.problem_id} ({len(t.steps)} committed steps) are "
                    f"not the model's log-probabilities after encode(prompt) + encode(step) for each step ({when}): "
                    f"max difference {max(abs(a - b) for a, b in zip(lps, want)):.2e}")

        p0 = Trajectory("p0", QUESTIONS[0], self.prompt(reference, 0), steps=[Step(s, "base", None, 0) for s in SCORED_STEPS])
        p1 = Trajectory("p1", QUESTIONS[1], self.prompt(reference, 1))
        check([p0, p0, p1], [SCORED_TEXTS[0], SCORED_TEXTS[1], SCORED_TEXTS[0]], "first call")
        p0.steps.append(Step(SCORED_TEXTS[0], "base", None, 0))  # a step is committed
        check([p0, p1], [SCORED_TEXTS[1], SCORED_TEXTS[1]], "after a step was committed to p0")
        session.release(["p0", "no-such-problem"])
        again = Trajectory("p0", QUESTIONS[2], self.prompt(reference, 2))  # a released id, another problem
        check([again], [SCORED_TEXTS[1]], "after p0 was released and its id reused")
        session.release(["p0", "p1"])

    def test_candidates_are_well_formed(self, engine, reference):
        (state,) = engine.start([StartRequest(self.prompt(reference, 0), full_cache(), 7)])
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
            ev = _evicting(8) if engine.evicts else full_cache()
            states = engine.start([StartRequest(p, ev, 9) for p in prompts])
            reqs = [ProposeRequest(s, "base", spec, seed + 100 * j, 100) for j, s in enumerate(states)]
            proposals = run_to_end(engine, reqs)
            engine.release(states, proposals)
            return [c.token_ids for c in proposals[0].candidates]

        alone = candidates(11)
        assert candidates(11) == alone, "the same seed gave other candidates: sampling must be seeded per request"
        assert candidates(11, others=2) == alone, (
            "a request's candidates changed when other requests were decoded with it: candidate i must draw "
            "from its own stream, seeded by row_seed(request.seed, i)")
        assert candidates(12) != alone, "another seed gave the same candidates"
        assert len({tuple(c) for c in alone}) > 1, "the candidates of one request should differ"

    def test_pruners_stop_rows_at_once(self, engine, reference):
        pruner = StopAt(3)
        spec = SamplingSpec(2, 1.0, 1.0, 10, NO_DELIMITER, pruners=(("stop3", pruner),))
        (state,) = engine.start([StartRequest(self.prompt(reference, 2), full_cache(), 1)])
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

