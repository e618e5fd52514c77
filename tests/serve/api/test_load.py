"""Load, disconnects, fuzzed bodies and agreement with the offline engine."""

import asyncio
import json
import random
import re

import httpx
import pytest

from tests.serve.api.test_errors import _wait_idle


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()) and \
                    re.match(re.escape(name) + r"(\{|$| )", head):
                total += float(value)
    return total


def test_greedy_over_http_equals_offline_engine(served, tiny_llama):
    from llmctl.serve.llm import LLM
    from llmctl.serve.sampling_params import SamplingParams

    prompts = ["The file object", "In Python, a class", "x"]
    llm = LLM(str(tiny_llama), kv_cache_memory="32MiB")
    offline = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0,
                                                   ignore_eos=True))
    for prompt, ref in zip(prompts, offline):
        body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        got = httpx.post(served.url + "/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == ref.outputs[0].text


async def _stream_one(client, url, body, disconnect_after=None):
    chunks = 0
    done = False
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            return resp.status_code, chunks, done
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                assert "error" not in json.loads(line[6:])
                chunks += 1
                if disconnect_after is not None and chunks >= disconnect_after:
                    return 200, chunks, done  # leaving the block closes the connection
    return resp.status_code, chunks, done


def test_200_concurrent_streams_then_disconnects(served):
    url = served.url + "/v1/completions"
    before = httpx.get(served.url + "/metrics").text
    rng = random.Random(0)
    bodies = [{"prompt": "word " * rng.randint(1, 60), "max_tokens": rng.randint(1, 24),
               "temperature": 0.8, "seed": i, "stream": True, "ignore_eos": True}
              for i in range(200)]

    async def run_all():
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*[_stream_one(client, url, b) for b in bodies])

    results = asyncio.run(run_all())
    assert all(status == 200 for status, _, _ in results)
    assert all(done for _, _, done in results)
    stats = _wait_idle(served)
    assert stats["num_running"] == 0
    after = httpx.get(served.url + "/metrics").text
    finished = (_metric(after, "llmctl:request_success_total")
                - _metric(before, "llmctl:request_success_total"))
    generated = (_metric(after, "llmctl:generation_tokens_total")
                 - _metric(before, "llmctl:generation_tokens_total"))
    assert finished == 200
    assert generated == sum(b["max_tokens"] for b in bodies)

    # 50 clients that leave mid-stream: their requests are aborted and blocks freed.
    long = [{"prompt": "word " * 20, "max_tokens": 300, "ignore_eos": True, "stream": True}
            for _ in range(50)]

    async def leave_early():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=60)) as c:
            return await asyncio.gather(*[_stream_one(c, url, b, disconnect_after=2)
                                          for b in long])

    left = asyncio.run(leave_early())
    assert all(chunks == 2 and not done for _, chunks, done in left)
    _wait_idle(served)
    assert served.engine.num_streams == 0
    assert httpx.get(served.url + "/health").status_code == 200


def test_non_streaming_disconnect_frees_blocks(served):
    async def leave():
        async with httpx.AsyncClient(timeout=0.3) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(served.url + "/v1/completions",
                                  json={"prompt": "x", "max_tokens": 400, "ignore_eos": True})

    asyncio.run(leave())
    _wait_idle(served)


def test_fuzzed_bodies_never_5xx(served):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                        st.floats(allow_nan=False, allow_infinity=False, width=32),
                        st.text(max_size=20))
    values = st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=8)
    keys = st.sampled_from(["prompt", "messages", "max_tokens", "temperature", "top_p", "n",
                            "stop", "seed", "stream", "logprobs", "top_logprobs", "model",
                            "response_format", "stream_options", "echo", "top_k", "min_p",
                            "presence_penalty", "frequency_penalty", "ignore_eos", "junk"])
    bodies = st.dictionaries(keys, values, max_size=6)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def check(body, path):
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
            body["max_tokens"] = 8
        body.pop("n", None) if isinstance(body.get("n"), int) and body["n"] > 4 else None
        resp = httpx.post(served.url + path, json=body, timeout=60)
        assert resp.status_code < 500, (body, resp.text)

    check()
    assert httpx.get(served.url + "/health").status_code == 200
    _wait_idle(served)
