"""Embedding requests (``SamplingParams.pooling``) in the engine: prefill only, pooled
final hidden states equal to transformers' ``last_hidden_state`` (after the final norm)
whatever the prompt's chunking, a preemption or the requests they share steps with;
nothing sampled, no KV kept, generation beside them unchanged."""

from __future__ import annotations

import pytest
import torch

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.core.sequence import SequenceStatus
from llmctl.serve.engine.llm_engine import LLMEngine
from llmctl.serve.engine.request_checks import ContextLengthError, InvalidRequestError
from tests.serve.conftest import PROMPTS, assert_all_blocks_free, encode, hf_model

ENGINE = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_num_seqs": 8,
          "max_num_batched_tokens": 32, "max_model_len": 128}  # 32: prompts run in chunks


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine.from_args(str(tiny_llama), **ENGINE)


def _reference(path, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.inference_mode():
        hidden = hf_model(str(path)).model(torch.tensor([ids])).last_hidden_state[0].float()
    return hidden[-1] if pooling == "last" else hidden.mean(dim=0)


def _run(engine, until=None) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if until is not None and until():
            break
    return finished


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n)


def test_pooled_states_equal_transformers_beside_generation(engine, tiny_llama):
    prompts = [encode(tiny_llama, p) for p in PROMPTS] + [[1] + list(range(3, 90))]
    engine.add_request("gen-alone", prompts[1], _greedy(12))
    alone = _run(engine)["gen-alone"].outputs[0].token_ids
    engine.add_request("gen", prompts[1], _greedy(12))
    for pooling in ("last", "mean"):
        for i, ids in enumerate(prompts):
            engine.add_request(f"{pooling}-{i}", ids, SamplingParams(pooling=pooling))
    out = _run(engine)
    assert out["gen"].outputs[0].token_ids == alone and out["gen"].embedding is None
    for pooling in ("last", "mean"):
        for i, ids in enumerate(prompts):
            got = out[f"{pooling}-{i}"]
            assert got.outputs[0].finish_reason == "stop" and got.outputs[0].token_ids == []
            torch.testing.assert_close(torch.tensor(got.embedding),
                                       _reference(tiny_llama, ids, pooling),
                                       atol=1e-5, rtol=0)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_preempted_prompt_pools_each_position_once(engine, tiny_llama, pooling):
    # four chunks of 32, none cached: a prefix of no other test's prompt
    ids = [1] + [(i * 7) % 80 + 3 for i in range(99)] + [{"last": 5, "mean": 6}[pooling]]
    engine.add_request("p", ids, SamplingParams(pooling=pooling))
    request = None

    def two_chunks() -> bool:
        nonlocal request
        request = request or engine.requests.get("p")
        return request is not None and request.seqs[0].num_computed_tokens >= 64

    _run(engine, until=two_chunks)
    seq = request.seqs[0]
    engine.scheduler._preempt(seq)  # as the scheduler does when blocks run out
    assert seq.status is SequenceStatus.PREEMPTED and seq.num_computed_tokens == 0
    out = _run(engine)["p"]
    torch.testing.assert_close(torch.tensor(out.embedding),
                               _reference(tiny_llama, ids, pooling), atol=1e-5, rtol=0)
    assert_all_blocks_free(engine)


def test_last_pooling_reads_through_the_prefix_cache(engine, tiny_llama):
    ids = [1] + list(range(3, 70))
    for i in range(2):
        engine.add_request(f"c{i}", ids, SamplingParams(pooling="last"))
        out = _run(engine)[f"c{i}"]
        torch.testing.assert_close(torch.tensor(out.embedding),
                                   _reference(tiny_llama, ids, "last"), atol=1e-5, rtol=0)
    assert out.metrics.num_cached_tokens > 0  # the second was served from the cache
    engine.add_request("m", ids, SamplingParams(pooling="mean"))
    assert _run(engine)["m"].metrics.num_cached_tokens == 0  # mean reads every position


def test_an_embedding_may_fill_the_context(engine):
    engine.add_request("full", [1] * 128, SamplingParams(pooling="last"))
    assert len(_run(engine)["full"].embedding) == 64
    with pytest.raises(ContextLengthError) as info:
        engine.add_request("over", [1] * 129, SamplingParams(pooling="last"))
    assert info.value.param == "input"


def test_an_embedding_has_one_sequence(engine):
    with pytest.raises(InvalidRequestError, match="one sequence") as info:
        engine.add_request("n2", [1, 2], SamplingParams(pooling="mean", n=2))
    assert info.value.param == "n"


def test_a_target_without_pooling_refuses(engine, monkeypatch):
    monkeypatch.setattr(engine.target, "serves_pooling", False, raising=False)
    with pytest.raises(InvalidRequestError, match="cannot return embeddings"):
        engine.add_request("no", [1, 2], SamplingParams(pooling="mean"))


def test_no_drafts_for_an_embedding(tiny_llama):
    """With speculative decoding, a prompt whose last chunk is one token is never sent
    draft tokens (n-gram drafts would find this repetitive prompt's pattern)."""
    engine = LLMEngine.from_args(str(tiny_llama), **ENGINE,
                                 speculative={"method": "ngram", "num_speculative_tokens": 3})
    ids = [1] + [5, 6, 7, 8] * 8  # 33 tokens: a chunk of 32, then one
    for pooling in ("last", "mean"):
        engine.add_request(pooling, ids, SamplingParams(pooling=pooling))
        out = _run(engine)[pooling]
        torch.testing.assert_close(torch.tensor(out.embedding),
                                   _reference(tiny_llama, ids, pooling), atol=1e-5, rtol=0)
    assert engine.counters.spec_draft_tokens == 0
    assert_all_blocks_free(engine)
