"""What the engine records for traces: each prefill chunk before the first token, each
preemption, and who sent the request, on every output of the request."""

from __future__ import annotations

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from tests.serve.conftest import PROMPTS, encode


def _finish(engine) -> dict:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_prefill_chunks_are_the_budget_sized_steps_before_the_first_token(tiny_llama):
    llm = LLM(str(tiny_llama), max_num_batched_tokens=7, kv_cache_memory="8MiB",
              enable_prefix_caching=False)
    ids = encode(tiny_llama, PROMPTS[3])  # a long prompt: several 7-token chunks
    [out] = llm.generate([ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    m = out.metrics
    sizes = [n for _, n in m.prefill_chunks]
    full, rest = divmod(len(ids), 7)
    assert sizes == [7] * full + ([rest] if rest else [])
    times = [t for t, _ in m.prefill_chunks]
    assert times == sorted(times) and len(set(times)) == len(times)  # one step each
    assert times[0] == m.first_scheduled_time
    assert m.arrival_time <= times[0] and times[-1] <= m.first_token_time <= m.finish_time
    assert m.preemption_times == () and m.num_preemptions == 0


def test_every_preemption_is_recorded_on_its_request(tiny_llama):
    # test_engine_greedy's forced preemption: 30 blocks of 4 tokens for six sequences
    llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=30, max_model_len=112,
              enable_prefix_caching=False)
    outs = llm.generate([encode(tiny_llama, p) for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=30))
    total = llm.engine.stats().num_preemptions
    assert total > 0
    assert sum(o.metrics.num_preemptions for o in outs) == total
    for out in outs:
        m = out.metrics
        assert all(m.first_scheduled_time <= t <= m.finish_time for t in m.preemption_times)


def test_outputs_carry_tenant_and_priority_class(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3)
    engine.add_request("a", [5, 6, 7], params, tenant="acme", priority_class="batch")
    engine.add_request("b", [5, 6, 7], params)
    final = _finish(engine)
    assert (final["a"].tenant, final["a"].priority_class) == ("acme", "batch")
    assert (final["b"].tenant, final["b"].priority_class) == (None, None)
