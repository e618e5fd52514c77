"""An 8-bit KV cache behind the HTTP API, in an engine process (where fp8 calibrates its
scales at start), through the openai client: the answers equal the offline engine's with
the same cache (which tests/serve/test_kv_cache_{int8,fp8}.py hold to transformers with
the same quantization; greedy float32, so texts are equal) and differ from a float
cache's, so the server's cache is the one asked for."""

from __future__ import annotations

import pytest
from openai import OpenAI

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from tests.serve.api.conftest import start_server
from tests.serve.conftest import PROMPTS

MAX_TOKENS = 12


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_completions_over_an_8bit_cache_equal_the_offline_engine(tiny_llama, kv_dtype):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    offline = LLM(str(tiny_llama), kv_cache_dtype=kv_dtype, kv_cache_memory="16MiB")
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS[:3], params)]
    float_cache = LLM(str(tiny_llama), kv_cache_memory="16MiB")
    assert expected != [o.outputs[0].text for o in float_cache.generate(PROMPTS[:3], params)]

    running = start_server(str(tiny_llama), engine_process=True, kv_cache_dtype=kv_dtype)
    try:
        client = OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        got = [client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body={"ignore_eos": True}
                                         ).choices[0].text for p in PROMPTS[:3]]
    finally:
        running.stop()
    assert got == expected
