"""Load, disconnects, fuzzed bodies and agreement with the offline engine."""

import asyncio
import json
import random
import re
import threading

import httpx
import pytest

from tests.serve.api.conftest import EngineGate
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
    from llmctl.serve.core.sampling_params import SamplingParams
    from llmctl.serve.engine.llm import LLM

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
    assert stats.num_running == 0
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

    gate = EngineGate(served, 1)  # the request cannot finish before the client leaves
    try:
        asyncio.run(leave())
    finally:
        gate.remove()
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


# Values no client should send but some will: ints past every machine width, floats that
# are not numbers (Python's json writes NaN / Infinity tokens, which are not JSON), lists
# far longer than any limit. (json.dumps cannot write ints past 4300 digits; the server's
# refusal of those is in test_errors.)
_BIG_INTS = [2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1,
             10**30, -(10**30), 10**4000]
_ODD_FLOATS = [float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, -0.0]
_HUGE_LISTS = [[1] * 5000, [2**64] * 3, [-1] * 3, ["x"] * 5000, [[1]] * 5000, [[2**70]],
               [{"role": "user", "content": "x"}] * 5000, [[5, 6]] * 3]
_EXTREMES = [*_BIG_INTS, *_ODD_FLOATS, *_HUGE_LISTS, 0, -1, None, True, {"1": 1e308}]
_CHAT_FIELDS = ["messages", "max_completion_tokens", "top_logprobs", "logprobs"]
_FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop",
           "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
           "logit_bias", "stop_token_ids", "priority", "best_of", "echo", "stream"]
_BASES = {"/v1/completions": {"prompt": "x", "max_tokens": 4},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}],
                                   "max_tokens": 4}}


class _Background(threading.Thread):
    """Streams one body over and over until stopped; records every run."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True}
        self.stop = threading.Event()
        self.runs: list[tuple[int, bool, str, bool]] = []  # status, [DONE], text, error

    def run(self) -> None:
        while not self.stop.is_set():
            text, done, error = [], False, False
            with httpx.stream("POST", self.url, json=self.body, timeout=180) as resp:
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        error |= "error" in event
                        text += [c["text"] for c in event.get("choices", [])]
            self.runs.append((resp.status_code, done, "".join(text), error))


def _never_5xx(client: httpx.Client, path: str, fields: dict) -> None:
    body = {**_BASES[path], **fields}
    for key in ("max_tokens", "max_completion_tokens"):  # keep valid ones short
        if isinstance(body.get(key), int) and 4 < body[key] < 10**4:
            body[key] = 4
    resp = client.post(path, content=json.dumps(body),
                       headers={"content-type": "application/json"})
    assert resp.status_code < 500, (fields, resp.text)
    if resp.status_code >= 400:
        assert set(resp.json()["error"]) >= {"message", "type", "param", "code"}
    elif body.get("stream") is True:
        assert resp.text.rstrip().endswith("data: [DONE]"), (fields, resp.text[-300:])


def test_fuzzed_extremes_never_5xx_and_spare_streams_in_flight(served):
    """Extreme numbers and lists in any field are 400s (or served when valid), never a
    500, and streams running meanwhile finish with the text they produce alone: every
    field with every extreme value, then hypothesis's combinations of them."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    url = served.url + "/v1/completions"
    background = [{"prompt": "The file object", "max_tokens": 24, "temperature": 0,
                   "ignore_eos": True},
                  {"prompt": "In Python, a class", "max_tokens": 24, "temperature": 0.9,
                   "seed": 11, "ignore_eos": True}]
    alone = [httpx.post(url, json=b, timeout=120).json()["choices"][0]["text"]
             for b in background]

    ints = st.one_of(st.integers(-(10**4000), 10**4000), st.sampled_from(_BIG_INTS))
    floats = st.one_of(st.floats(), st.sampled_from(_ODD_FLOATS))
    values = st.one_of(st.sampled_from(_EXTREMES), ints, floats, st.lists(ints, max_size=4),
                       st.dictionaries(st.text(max_size=3), st.one_of(ints, floats),
                                       max_size=2))
    fuzz = st.dictionaries(st.sampled_from(_FIELDS + _CHAT_FIELDS), values, min_size=1,
                           max_size=3)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(fields=fuzz, path=st.sampled_from(sorted(_BASES)))
    def combinations(fields, path):
        _never_5xx(client, path, fields)

    threads = [_Background(url, b) for b in background]
    for thread in threads:
        thread.start()
    client = httpx.Client(base_url=served.url, timeout=120)
    try:
        # the sampling fields are one model for both endpoints: each is swept once
        for path, fields in [("/v1/completions", _FIELDS), ("/v1/chat/completions",
                                                              _CHAT_FIELDS)]:
            for field in fields:
                for value in _EXTREMES:
                    _never_5xx(client, path, {field: value})
        combinations()
    finally:
        client.close()
        for thread in threads:
            thread.stop.set()
        for thread in threads:
            thread.join(180)
    for thread, text in zip(threads, alone):
        assert thread.runs  # it ran while the fuzzing did
        assert all(run == (200, True, text, False) for run in thread.runs), thread.runs
    assert httpx.get(served.url + "/health").status_code == 200
    _wait_idle(served)
