"""Every error case returns its status and an OpenAI-shaped error body."""

import asyncio
import time

import httpx
import pytest

from tests.serve.api.conftest import start_server


def _error(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("body,needle", [
    (b"{not json", "malformed JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"prompt": 5}', "prompt"),
    (b'{"prompt": "x", "max_tokens": "ten"}', "max_tokens"),
    (b'{"prompt": "x", "temperature": -1}', "temperature"),
    (b'{"prompt": "x", "bogus": 1}', "unrecognized request argument supplied: bogus"),
    (b'{"prompt": []}', "prompt"),
    (b'{"prompt": [999999]}', "outside the vocabulary"),
    (b'{"prompt": "x", "max_tokens": 100000}', "context length"),
    (b'{"prompt": "x", "logit_bias": {"1": 500}}', "logit_bias"),
])
def test_bad_completion_bodies_are_400(served, body, needle):
    err = _error(httpx.post(served.url + "/v1/completions", content=body,
                            headers={"content-type": "application/json"}), 400)
    assert needle in err["message"]


_DEEP = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("body,param,needle", [
    ({"prompt": "x", "seed": 2**64}, "seed",
     ("18446744073709551616 is out of range; allowed: -9223372036854775808 <= seed <= "
      "18446744073709551615")),
    ({"prompt": "x", "seed": -(2**63) - 1}, "seed", "out of range"),
    ({"prompt": "x", "top_k": 10**30}, "top_k", "top_k <= 9223372036854775807"),
    ({"prompt": "x", "n": 10**30}, "n", "1 <= n <= 16"),
    ({"prompt": "x", "logprobs": 10**30}, "logprobs", "0 <= logprobs <= 20"),
    ({"prompt": "x", "max_tokens": 10**30}, "max_tokens", "context length"),
    ({"prompt": "x", "top_p": 0}, "top_p", "0.0 < top_p <= 1.0"),
    ({"prompt": "x", "temperature": 1e308, "top_p": 0.5}, "temperature", "temperature <= 2"),
    ({"prompt": "x", "presence_penalty": -1e308}, "presence_penalty", "-2.0 <= presence"),
    ({"prompt": "x", "stop": ["s"] * 100}, "stop", "at most 64 stop strings, got 100"),
    ({"prompt": ["x"] * 2000}, "prompt", "at most 1024 prompts per request, got 2000"),
    ({"prompt": [[1]] * 2000}, "prompt", "at most 1024 prompts"),
    ({"prompt": [1, "x"]}, "prompt", "all strings or all token-id lists"),
    ({"prompt": [1] * 5000}, "prompt", "context"),
    ({"prompt": "x", "stop_token_ids": [2**64]}, "stop_token_ids.0", "less than or equal"),
    ({"prompt": "x", "stop_token_ids": [1] * 2000}, "stop_token_ids", "at most 1024"),
    ({"messages": [{"role": "user", "content": "x"}] * 5000}, "messages", "at most 4096"),
])
def test_extreme_values_are_400_naming_the_field(served, body, param, needle):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    err = _error(httpx.post(served.url + path, json=body, timeout=60), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert needle in err["message"]


@pytest.mark.parametrize("raw,needle", [
    (b'{"prompt": "x", "temperature": NaN}', "NaN is not valid JSON"),
    (b'{"prompt": "x", "top_p": -Infinity}', "-Infinity is not valid JSON"),
    (b'{"prompt": "x", "temperature": 1e999}',  # parses to inf
     "temperature: inf is not a finite number; allowed: 0.0 <= temperature <= 2.0"),
    (b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}", "malformed JSON"),  # > 4300 digits
    (_DEEP, "nested too deeply"),
    (b'{"prompt": "a\\ud800b"}', "cannot be tokenized"),  # a lone surrogate
])
def test_values_json_cannot_carry_are_400(served, raw, needle):
    err = _error(httpx.post(served.url + "/v1/completions", content=raw, timeout=60,
                            headers={"content-type": "application/json"}), 400)
    assert needle in err["message"]


@pytest.mark.parametrize("body,needle", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user"}], "top_logprobs": 2}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format"),
])
def test_bad_chat_bodies_are_400(served, body, needle):
    err = _error(httpx.post(served.url + "/v1/chat/completions", json=body), 400)
    assert needle in err["message"]


def test_prompt_over_context_is_400(served):
    err = _error(httpx.post(served.url + "/v1/completions",
                            json={"prompt": [5] * 600, "max_tokens": 1}), 400)
    assert "context" in err["message"]


def test_unknown_model_is_404(served):
    err = _error(httpx.post(served.url + "/v1/completions",
                            json={"model": "gpt-9", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found"


def test_api_key(tiny_llama):
    running = start_server(str(tiny_llama), api_key="s3cret")
    try:
        url = running.url + "/v1/completions"
        body = {"prompt": "x", "max_tokens": 1}
        _error(httpx.post(url, json=body), 401)
        _error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
        ok = httpx.post(url, json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert httpx.get(running.url + "/health").status_code == 200
    finally:
        running.stop()


def test_the_queue_limit_is_per_class_under_fair(tiny_llama, tmp_path):
    """One slot, --max-queue 1, the fair policy, two tenants: "flood" (batch class) and
    "urgent" (interactive). With a flood request running and another waiting, a third of
    the flood finds its class's queue full (429 queue_full), but an interactive request
    does not: a flood of one class cannot fill the queue against another."""
    import yaml

    from llmctl.serve.api.tenancy.keys import hash_key

    doc = {"tenants": {"flood": {"priority_class": "batch"},
                       "urgent": {"priority_class": "interactive"}},
           "keys": [{"key_sha256": hash_key("sk-flood"), "tenant": "flood"},
                    {"key_sha256": hash_key("sk-urgent"), "tenant": "urgent"}]}
    auth = tmp_path / "keys.yaml"
    auth.write_text(yaml.safe_dump(doc))
    running = start_server(str(tiny_llama), max_queue=1, max_num_seqs=1, auth_file=auth,
                           scheduling_policy="fair")
    url = running.url + "/v1/completions"
    flood = {"Authorization": "Bearer sk-flood"}
    urgent = {"Authorization": "Bearer sk-urgent"}

    async def fire():
        long = {"prompt": "x", "max_tokens": 400, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=60) as client:
            first = asyncio.create_task(client.post(url, json=long, headers=flood))
            await _until(lambda: running.engine.stats().num_running == 1)
            queued = asyncio.create_task(client.post(url, json=long, headers=flood))
            await _until(lambda: dict(running.engine.stats().queued_requests)
                         .get((2,)) == 1)  # batch: rank 2
            refused = await client.post(url, json={**long, "max_tokens": 1}, headers=flood)
            answered = await client.post(url, json={**long, "max_tokens": 1}, headers=urgent)
            return refused, answered, await first, await queued

    try:
        refused, answered, first, queued = asyncio.run(fire())
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "queue_full"
        assert answered.status_code == 200, answered.text
        assert first.status_code == 200 and queued.status_code == 200
    finally:
        running.stop()


async def _until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_queue_limit_gives_429_with_retry_after(tiny_llama):
    running = start_server(str(tiny_llama), max_queue=1, max_num_seqs=1)

    async def fire():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}
            return await asyncio.gather(*[client.post(running.url + "/v1/completions", json=body)
                                          for _ in range(8)])

    try:
        responses = asyncio.run(fire())
        codes = sorted(r.status_code for r in responses)
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
        limited = next(r for r in responses if r.status_code == 429)
        assert int(limited.headers["Retry-After"]) >= 1
        assert limited.json()["error"]["type"] == "rate_limit_error"
    finally:
        running.stop()


def test_request_timeout_gives_408_and_frees_blocks(tiny_llama):
    running = start_server(str(tiny_llama), request_timeout=0.05, max_num_batched_tokens=16)
    try:
        resp = httpx.post(running.url + "/v1/completions",
                          json={"prompt": "x", "max_tokens": 400, "ignore_eos": True}, timeout=30)
        err = _error(resp, 408)
        assert "request-timeout" in err["message"]
        _wait_idle(running)
    finally:
        running.stop()


def _wait_idle(running, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = running.engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and \
                stats.kv_cache_usage == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {running.engine.stats()}")
