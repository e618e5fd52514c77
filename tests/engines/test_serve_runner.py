"""llmctl's serving engine (scheduler, sampler, detokenizer) driving an engine directory."""

import pytest

from tests.engines.conftest import PROMPTS, hf_greedy

pytest.importorskip("llmctl.serve.engine.llm")


def _llm(tiny_llama, engine_dir, **config):
    from llmctl.engines.engine_dir import open_engine
    from llmctl.serve.engine.llm import LLM

    llm = LLM(str(tiny_llama), enable_prefix_caching=False, max_num_batched_tokens=32,
              kv_cache_memory="32MiB", **config)
    llm.engine.runner = open_engine(engine_dir, threads=1).runner()
    return llm


@pytest.mark.parametrize("engine_fixture,speculative", [
    ("onnx_fp32", None), ("torch_compiled", {"method": "ngram", "num_speculative_tokens": 3}),
])
def test_scheduler_drives_engine_dir_greedy_equal_to_transformers(
        request, tiny_llama, hf_tiny, engine_fixture, speculative):
    from llmctl.serve.core.sampling_params import SamplingParams

    engine_dir = request.getfixturevalue(engine_fixture)
    llm = _llm(tiny_llama, engine_dir, speculative=speculative)
    # the first prompt (50 tokens) is prefilled in two chunks of <= 32 tokens
    prompts = [PROMPTS[2] * 5] + PROMPTS[:2]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_tiny, prompt, 24)


def test_n_greater_than_one_forks_from_the_sibling_cache(tiny_llama, onnx_fp32, hf_tiny):
    from llmctl.serve.core.sampling_params import SamplingParams

    llm = _llm(tiny_llama, onnx_fp32)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0, n=2,
                                                    ignore_eos=True))[0]
    want = hf_greedy(hf_tiny, PROMPTS[0], 6)
    assert [c.token_ids for c in out.outputs] == [want, want]
