"""Greedy outputs of the engine equal transformers ``generate``, token for token, under
every scheduling regime: mixed batches, prefix caching, chunked prefill, preemption."""

from __future__ import annotations

import pytest

from llmctl.errors import ResourceError, UsageError
from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from tests.serve.conftest import PROMPTS, assert_all_blocks_free, encode, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def _check_against_hf(path, llm: LLM, prompts=PROMPTS, params=GREEDY) -> list:
    ids = [encode(path, p) for p in prompts]
    outs = llm.generate(ids, params)
    for prompt_ids, out in zip(ids, outs):
        expected = hf_greedy(path, prompt_ids, params.max_tokens)
        assert out.outputs[0].token_ids == expected, out.request_id
        assert out.finished and out.outputs[0].finish_reason in ("length", "stop")
    assert_all_blocks_free(llm.engine)
    return outs


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_mixed_batch_equals_transformers(tiny_llama, prefix_caching):
    llm = LLM(str(tiny_llama), enable_prefix_caching=prefix_caching, kv_cache_memory="8MiB")
    _check_against_hf(tiny_llama, llm)


def test_short_and_long_contexts_in_one_decode_batch(tiny_llama):
    """Contexts from 2 to ~400 tokens: the decode batch is split into length buckets."""
    from llmctl.serve.core.scheduler import ScheduledSeq
    from llmctl.serve.model.runner import context_buckets

    long_prompts = [" ".join(PROMPTS) * 4, (PROMPTS[3] + " ") * 3]
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    _check_against_hf(tiny_llama, llm, PROMPTS + long_prompts)

    class Fake:
        def __init__(self, n):
            self.num_computed_tokens = n

    items = [ScheduledSeq(Fake(n), 1) for n in (500, 3, 90, 260, 40, 130, 1000)]
    buckets = [[i.seq.num_computed_tokens for i in b] for b in context_buckets(items)]
    assert buckets == [[3, 40, 90], [130, 260], [500, 1000]]


def test_chunked_prefill_with_a_tiny_token_budget(tiny_llama):
    llm = LLM(str(tiny_llama), max_num_batched_tokens=7, kv_cache_memory="8MiB")
    _check_against_hf(tiny_llama, llm)
    assert llm.engine.stats().num_steps > 24  # prompts really were cut into chunks


def test_without_chunked_prefill(tiny_llama):
    llm = LLM(str(tiny_llama), enable_chunked_prefill=False, max_model_len=128,
              max_num_batched_tokens=128, kv_cache_memory="8MiB")
    _check_against_hf(tiny_llama, llm)


@pytest.mark.parametrize("prefix_caching,budget", [(True, 512), (False, 512), (True, 5)])
def test_forced_preemption_loses_and_duplicates_nothing(tiny_llama, prefix_caching, budget):
    # 30 blocks of 4 tokens = 120 slots for six sequences of 31 to 99 tokens
    llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=30, max_model_len=112,
              enable_prefix_caching=prefix_caching, max_num_batched_tokens=budget)
    _check_against_hf(tiny_llama, llm, params=SamplingParams(temperature=0, max_tokens=30))
    assert llm.engine.stats().num_preemptions > 0


def test_prefix_cache_hits_and_gives_the_same_tokens(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    shared = PROMPTS[3] + " " + PROMPTS[1]
    prompts = [shared + " one", shared + " two and three"]
    first = _check_against_hf(tiny_llama, llm, prompts[:1])
    second = _check_against_hf(tiny_llama, llm, prompts)
    assert first[0].metrics.num_cached_tokens == 0
    cached = second[1].metrics.num_cached_tokens
    assert cached >= 16 and cached % 16 == 0
    assert llm.engine.stats().prefix_cache_hit_rate > 0


def test_n_completions_share_the_prompt_and_each_equal_greedy(tiny_llama):
    llm = LLM(str(tiny_llama), enable_prefix_caching=False, kv_cache_memory="8MiB")
    ids = encode(tiny_llama, PROMPTS[1])  # 10 tokens: the fork shares a partial block
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=20, n=3))[0]
    expected = hf_greedy(tiny_llama, ids, 20)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(o.token_ids == expected for o in out.outputs)
    assert_all_blocks_free(llm.engine)


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=123, n=2)
    alone = llm.generate([PROMPTS[0]], params)[0]
    crowd = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[3]],
                         [SamplingParams(temperature=0.8, max_tokens=9), params,
                          SamplingParams(max_tokens=5)])[1]
    assert [o.token_ids for o in alone.outputs] == [o.token_ids for o in crowd.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids  # seed + index


def test_stop_token_ids_end_with_reason_stop(tiny_llama):
    ids = encode(tiny_llama, PROMPTS[0])
    expected = hf_greedy(tiny_llama, ids, 24)
    stop = expected[5]
    cut = expected.index(stop) + 1
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24,
                                             stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == expected[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_abort_frees_everything_and_reports_abort(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=40,
                                                           ignore_eos=True, n=2 if i else 1))
    engine.step()
    engine.step()
    engine.abort_request("r1")
    engine.abort_request("r3")
    engine.abort_request("does-not-exist")
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert {o.finish_reason for o in final["r1"].outputs} == {"abort"}
    assert final["r0"].outputs[0].finish_reason == "length"
    assert len(final["r0"].outputs[0].token_ids) == 40
    assert_all_blocks_free(engine)


def test_priority_orders_admission(tiny_llama):
    llm = LLM(str(tiny_llama), max_num_seqs=1, kv_cache_memory="8MiB")
    engine = llm.engine
    for name, prio in [("low", 5), ("high", -1), ("mid", 0)]:
        engine.add_request(name, PROMPTS[0], SamplingParams(temperature=0, max_tokens=3),
                           priority=prio, arrival_time=0.0)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "low"]


def test_streamed_deltas_add_up(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    params = SamplingParams(temperature=0, max_tokens=20)
    tokens, text, finals = {}, {}, {}
    for out in llm.stream(PROMPTS[:3], params):
        rid = out.request_id
        tokens[rid] = tokens.get(rid, []) + out.outputs[0].new_token_ids
        text[rid] = text.get(rid, "") + out.outputs[0].text_delta
        if out.finished:
            finals[rid] = out.outputs[0]
    assert len(finals) == 3
    for rid, final in finals.items():
        assert tokens[rid] == final.token_ids
        assert text[rid] == final.text


def test_request_validation(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=64, kv_cache_memory="8MiB")
    engine = llm.engine
    with pytest.raises(UsageError, match="empty prompt"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(UsageError, match="outside"):
        engine.add_request("v", [1, 99999], SamplingParams())
    with pytest.raises(ResourceError, match="exceeds the context length"):
        engine.add_request("long", [5] * 60, SamplingParams(max_tokens=10))
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(UsageError, match="already in use"):
        engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(UsageError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    # max_tokens=None runs to the context length
    engine.add_request("open", [5] * 60, SamplingParams(max_tokens=None, temperature=0,
                                                       ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(done["open"].outputs[0].token_ids) == 4
    assert done["open"].outputs[0].finish_reason == "length"


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_smollm2_greedy_chat_batch_equals_transformers(smollm2, prefix_caching):
    from llmctl.models.prompting import encode_prompt
    from tests.serve.conftest import tokenizer

    tok = tokenizer(str(smollm2))
    questions = ["What is the capital of France?", "Name three colours.",
                 "Write one sentence about the sea and the sky and the wind."]
    ids = [encode_prompt(tok, q, chat=True) for q in questions]
    # a small token budget and a small cache: chunked prefill, and either prefix sharing
    # (the chat template's system prompt) or, without it, preemption on the real model
    llm = LLM(str(smollm2), max_model_len=128, block_size=8, num_kv_blocks=16,
              max_num_batched_tokens=24, enable_prefix_caching=prefix_caching)
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=30))
    for prompt_ids, out in zip(ids, outs):
        assert out.outputs[0].token_ids == hf_greedy(smollm2, prompt_ids, 30)
    assert "Paris" in outs[0].outputs[0].text
    stats = llm.engine.stats()
    if prefix_caching:
        assert stats.prefix_cache_hit_rate > 0
    else:
        assert stats.num_preemptions > 0
    assert_all_blocks_free(llm.engine)
