"""One request's failure ends that request only (the engine's failure contract).

Failures are injected where a request's own work runs (its constraint, its forks) and in
batched work (the model pass, sampling, draft proposals) for one chosen request; every
other request must finish with exactly the tokens it gets alone (greedy, float32: token
for token against transformers), the failed one with finish reason "error" and its
exception, and the block pool must balance afterwards.
"""

from __future__ import annotations

import pytest

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from tests.serve.conftest import PROMPTS, assert_all_blocks_free, encode, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
BAD = "bad"
REPETITIVE = ("The file object is open. The file object is closed. The file object is "
              "open. The file object")  # n-gram drafts find matches in it


class Boom(RuntimeError):
    pass


class FailingConstraint:
    """Allows every token; raises in ``where`` once ``after`` tokens were accepted."""

    def __init__(self, where: str, after: int) -> None:
        self.where, self.after, self.accepted = where, after, 0

    def mask(self, logits) -> None:
        if self.where == "mask" and self.accepted >= self.after:
            raise Boom("mask failed")

    def accept(self, token_id: int) -> None:
        self.accepted += 1
        if self.where == "accept" and self.accepted >= self.after:
            raise Boom("accept failed")

    def is_finished(self) -> bool:
        return False


class FailingFactory:
    """``where="fork"``: the first constraint is made, the second (an n > 1 sibling's,
    made in the engine thread) raises."""

    def __init__(self, where: str, after: int = 3) -> None:
        self.where, self.after, self.made = where, after, 0

    def new_constraint(self) -> FailingConstraint:
        self.made += 1
        if self.where == "fork" and self.made > 1:
            raise Boom("constraint factory failed")
        return FailingConstraint(self.where, self.after)


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Submit every request before the first step; step until all are final."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in final, "an output after the final one"
            if out.finished:
                final[out.request_id] = out
    assert set(final) == set(requests)
    return final


def _good(tiny_llama) -> dict[str, tuple[list[int], SamplingParams]]:
    return {f"good-{i}": (encode(tiny_llama, p), GREEDY) for i, p in enumerate(PROMPTS[:4])}


def _assert_good(tiny_llama, final, good) -> None:
    for rid, (ids, params) in good.items():
        out = final[rid]
        assert out.error is None
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama, ids, params.max_tokens), rid


def _assert_failed(out, needle: str) -> None:
    assert out.finished
    assert out.error is not None and needle in out.error
    assert "error" in {c.finish_reason for c in out.outputs}


@pytest.mark.parametrize("where", ["mask", "accept", "fork"])
def test_failing_constraint_ends_only_its_request(tiny_llama, where):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    good = _good(tiny_llama)
    n = 2 if where == "fork" else 1
    bad_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=n,
                                logits_constraint=FailingFactory(where))
    final = _run(llm.engine, {**good, BAD: (encode(tiny_llama, PROMPTS[4]), bad_params)})
    _assert_good(tiny_llama, final, good)
    _assert_failed(final[BAD], "Boom")
    assert_all_blocks_free(llm.engine)
    # the engine goes on as before
    _assert_good(tiny_llama, _run(llm.engine, good), good)


def test_model_pass_failure_ends_only_the_request_that_causes_it(tiny_llama, monkeypatch):
    """The batched forward pass raises whenever the bad request is in it: each sequence
    is re-run alone, the bad one fails, the others keep their solo logits."""
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    runner = llm.engine.runner
    real = runner.execute_with_prompt
    calls = {"batched_failures": 0}

    def execute_with_prompt(scheduled, with_prompt=True):
        bad = [s for s in scheduled if s.seq.request.request_id == BAD]
        if bad and bad[0].seq.num_output_tokens >= 2:
            calls["batched_failures"] += len(scheduled) > 1
            raise Boom("kernel failed")
        return real(scheduled, with_prompt)

    monkeypatch.setattr(runner, "execute_with_prompt", execute_with_prompt)
    good = _good(tiny_llama)
    final = _run(llm.engine, {**good, BAD: (encode(tiny_llama, PROMPTS[4]), GREEDY)})
    assert calls["batched_failures"] == 1  # it failed in a batch and was isolated
    _assert_good(tiny_llama, final, good)
    _assert_failed(final[BAD], "kernel failed")
    assert len(final[BAD].outputs[0].token_ids) == 2
    assert_all_blocks_free(llm.engine)


def test_sampling_failure_is_isolated_and_seeded_draws_are_not_repeated(tiny_llama,
                                                                        monkeypatch):
    """The batched sampler draws, then raises (as a failing logprobs pass would): the
    re-run alone must put the seeded generators back, or the seeded request would draw
    twice in that step and differ from its solo run."""
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    seeded_ids = encode(tiny_llama, PROMPTS[5])
    alone = _run(LLM(str(tiny_llama), kv_cache_memory="8MiB").engine,
                 {"seeded": (seeded_ids, seeded)})["seeded"].outputs[0].token_ids

    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    real = llm.engine.sampler.sample
    failures = []

    def sample(logits, seqs):
        tokens = real(logits, seqs)
        if any(s.request.request_id == BAD and s.num_output_tokens >= 3 for s in seqs):
            failures.append(len(seqs))
            raise Boom("sampler failed")
        return tokens

    monkeypatch.setattr(llm.engine.sampler, "sample", sample)
    good = _good(tiny_llama)
    final = _run(llm.engine, {**good, "seeded": (seeded_ids, seeded),
                              BAD: (encode(tiny_llama, PROMPTS[4]), GREEDY)})
    assert failures[0] > 1  # the first failure was a batch's
    _assert_good(tiny_llama, final, good)
    assert final["seeded"].outputs[0].token_ids == alone
    _assert_failed(final[BAD], "sampler failed")
    assert_all_blocks_free(llm.engine)


def test_failing_draft_proposal_costs_only_that_sequence_its_drafts(tiny_llama, monkeypatch):
    """Proposals only save time: the sequence whose proposal fails decodes on without
    drafts, exactly, and the others keep speculating."""
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB", block_size=4,
              speculative={"method": "ngram", "num_speculative_tokens": 3})
    proposer = llm.engine.proposer
    real = proposer.propose
    proposed_for_bad = []

    def propose(seqs, limits):
        if any(s.request.request_id == BAD for s in seqs):
            proposed_for_bad.append(len(seqs))
            raise Boom("proposer failed")
        return real(seqs, limits)

    monkeypatch.setattr(proposer, "propose", propose)
    good = {**_good(tiny_llama), "repetitive": (encode(tiny_llama, REPETITIVE), GREEDY)}
    bad_ids = encode(tiny_llama, REPETITIVE + " again")
    final = _run(llm.engine, {**good, BAD: (bad_ids, GREEDY)})
    _assert_good(tiny_llama, final, {**good, BAD: (bad_ids, GREEDY)})
    # one failed batch, one failed solo run; never asked again
    assert proposed_for_bad[0] > 1 and proposed_for_bad[1:] == [1]
    assert llm.engine.stats().spec_draft_tokens > 0
    assert_all_blocks_free(llm.engine)


def test_failing_detokenizer_at_admission_with_an_abort_queued_ends_once(tiny_llama,
                                                                         monkeypatch):
    """The request's detokenizer is made in the engine thread when it is admitted; it
    raises there, and an abort of the same request sits in the same inbox: exactly one
    final output (the error), nothing scheduled, nothing leaked."""
    from llmctl.serve.engine import llm_engine

    bad_ids = encode(tiny_llama, PROMPTS[4])
    real = llm_engine.IncrementalDetokenizer

    def detokenizer(tokenizer, prompt_ids, params):
        if list(prompt_ids) == bad_ids:
            raise Boom("detokenizer failed")
        return real(tokenizer, prompt_ids, params)

    monkeypatch.setattr(llm_engine, "IncrementalDetokenizer", detokenizer)
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    engine = llm.engine
    engine.add_request(BAD, bad_ids, GREEDY)
    engine.abort_request(BAD)
    outs = engine.step()
    assert [o.request_id for o in outs] == [BAD]
    _assert_failed(outs[0], "detokenizer failed")
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert_all_blocks_free(engine)
    good = _good(tiny_llama)
    _assert_good(tiny_llama, _run(engine, good), good)
