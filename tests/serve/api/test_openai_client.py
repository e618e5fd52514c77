"""The official openai client against a real llmctl server."""

import json

import pytest
from openai import OpenAI


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def test_completion_and_usage(client):
    out = client.completions.create(model="tiny", prompt="The file object", max_tokens=7,
                                    temperature=0)
    assert out.usage.completion_tokens == 7
    assert out.usage.prompt_tokens > 0
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text


def test_chat_and_streaming_with_usage(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9,
                                          temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 9
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finish == ["length"]


def test_n_greater_than_one(client):
    out = client.completions.create(model="tiny", prompt="Once", max_tokens=6, n=3,
                                    temperature=1.0, seed=5)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 18


def test_seed_reproducibility(client):
    kwargs = dict(model="tiny", prompt="The", max_tokens=12, temperature=1.0, seed=1234)
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    c = client.completions.create(**{**kwargs, "seed": 4321}).choices[0].text
    assert a == b
    assert a != c


def test_stop_string_is_not_leaked(client):
    base = client.completions.create(model="tiny", prompt="The file object", max_tokens=12,
                                     temperature=0).choices[0].text
    stop = base[3:6]
    assert stop
    out = client.completions.create(model="tiny", prompt="The file object", max_tokens=12,
                                    temperature=0, stop=[stop])
    assert out.choices[0].text == base[:base.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_logprobs(client):
    out = client.completions.create(model="tiny", prompt="The", max_tokens=4, temperature=0,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) <= 3 for t in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(max(t.values()) == pytest.approx(c, abs=1e-5)
               for t, c in zip(lp.top_logprobs, lp.token_logprobs))


def test_models_endpoint(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_token_id_prompts_and_lists(client):
    out = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=3,
                                    temperature=0)
    assert [c.index for c in sorted(out.choices, key=lambda c: c.index)] == [0, 1]
    assert out.usage.prompt_tokens == 5
    json.dumps(out.model_dump())
