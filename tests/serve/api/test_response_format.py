"""response_format over HTTP with the official openai client: output parses and validates."""

import json

import jsonschema
import openai
import pytest
from openai import OpenAI

SCHEMA = {"type": "object",
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Give me a and b."}]


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def test_chat_json_schema_greedy(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,
                                         temperature=0, response_format=JSON_SCHEMA)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_json_schema_sampled_n2_streamed(client):
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,
                                            temperature=1.0, seed=11, n=2, stream=True,
                                            response_format=JSON_SCHEMA)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_json_schema(client):
    out = client.completions.create(model="tiny", prompt="The file object", max_tokens=40,
                                    temperature=0.8, seed=2, n=2,
                                    extra_body={"response_format": JSON_SCHEMA})
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_json_object(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60,
                                         temperature=0, response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_unconstrained_output_is_not_json(client):
    # the control: without response_format this model does not write JSON by itself
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,
                                         temperature=0)
    with pytest.raises(ValueError):
        json.loads(out.choices[0].message.content)


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
])
def test_invalid_schema_is_400(client, fmt):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                       response_format=fmt)
    assert info.value.status_code == 400
    assert "schema" in info.value.message
