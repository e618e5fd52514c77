"""vLLM's ``structured_outputs`` (and its older ``guided_*`` fields) over HTTP with the
official openai client, against the tiny model: each form (json, regex, choice, Lark and
GBNF grammar, json_object) constrains a real generation on both endpoints, streamed as
whole, with n > 1 and after a reasoning model's thinking; malformed forms and grammars
llguidance refuses are 400s naming the field; pathological grammars and schemas are
refused within the limits while another request's stream goes on."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from tests.serve.api.test_reasoning_http import _start, scripted, thinking_model  # noqa: F401

MESSAGES = [{"role": "user", "content": "Give me a code."}]
SCHEMA = {"type": "object",
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]
# a bounded Lark language (the tiny model would otherwise run on to max_tokens), and the
# regex that is the same language
LARK = 'start: "(" item ("," item)? ("," item)? ")"\nitem: /[0-9]{1,2}/\n'
LARK_RE = r"\(\d{1,2}(,\d{1,2}){0,2}\)"
GBNF = 'root ::= "yes" | "no" | "maybe"'


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def chat(client, so, **kwargs) -> list[str]:
    kwargs = {"max_tokens": 40, "temperature": 0, **kwargs}
    out = client.chat.completions.create(model="tiny", messages=MESSAGES,
                                         extra_body={"structured_outputs": so}, **kwargs)
    assert all(c.finish_reason == "stop" for c in out.choices), out
    return [c.message.content for c in out.choices]


def chat_streamed(client, so, n: int = 1, **kwargs) -> list[str]:
    texts = [""] * n
    for chunk in client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=40, stream=True, n=n,
            extra_body={"structured_outputs": so}, **{"temperature": 0, **kwargs}):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    return texts


def completion(client, body: dict, **kwargs) -> list[str]:
    kwargs = {"max_tokens": 40, "temperature": 0, **kwargs}
    out = client.completions.create(model="tiny", prompt="The file object", extra_body=body,
                                    **kwargs)
    return [c.text for c in out.choices]


# --- each form constrains a real generation ------------------------------------------------
def test_regex(client):
    (text,) = chat(client, {"regex": REGEX})
    assert re.fullmatch(REGEX, text), text


def test_choice(client):
    (text,) = chat(client, {"choice": CHOICES})
    assert text in CHOICES


def test_lark_grammar(client):
    (text,) = chat(client, {"grammar": LARK})
    assert re.fullmatch(LARK_RE, text), text


def test_gbnf_grammar(client):
    (text,) = chat(client, {"grammar": GBNF})
    assert text in ("yes", "no", "maybe")


@pytest.mark.parametrize("schema", [SCHEMA, json.dumps(SCHEMA)], ids=["dict", "text"])
def test_json_schema(client, schema):
    (text,) = chat(client, {"json": schema})
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object(client):
    (text,) = chat(client, {"json_object": True}, max_tokens=60)
    assert isinstance(json.loads(text), dict)


def test_unconstrained_output_matches_none_of_them(client):
    # the control: the model writes none of these languages by itself
    text = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,
                                          temperature=0).choices[0].message.content
    assert not re.fullmatch(REGEX, text) and not re.fullmatch(LARK_RE, text)
    assert text not in CHOICES


@pytest.mark.parametrize("so", [{"regex": REGEX}, {"grammar": LARK}, {"choice": CHOICES},
                                {"json": SCHEMA}], ids=["regex", "lark", "choice", "json"])
def test_streamed_equals_whole_greedy(client, so):
    assert chat_streamed(client, so) == chat(client, so)


def test_sampled_n3_streamed_each_choice_constrained(client):
    texts = chat_streamed(client, {"regex": REGEX}, n=3, temperature=1.0, seed=5)
    assert all(re.fullmatch(REGEX, t) for t in texts), texts
    texts = chat(client, {"grammar": LARK}, n=3, temperature=1.0, seed=7)
    assert all(re.fullmatch(LARK_RE, t) for t in texts), texts


def test_completions_endpoint(client):
    texts = completion(client, {"structured_outputs": {"regex": REGEX}}, n=2,
                       temperature=1.0, seed=3)
    assert len(texts) == 2 and all(re.fullmatch(REGEX, t) for t in texts), texts
    assert completion(client, {"structured_outputs": {"choice": CHOICES}})[0] in CHOICES
    jsonschema.validate(json.loads(
        completion(client, {"structured_outputs": {"json": SCHEMA}})[0]), SCHEMA)
    stream = client.completions.create(model="tiny", prompt="The file object", max_tokens=40,
                                       temperature=0, stream=True,
                                       extra_body={"structured_outputs": {"grammar": LARK}})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert re.fullmatch(LARK_RE, text), text


@pytest.mark.parametrize("field,value,check", [
    ("guided_regex", REGEX, lambda t: re.fullmatch(REGEX, t)),
    ("guided_choice", CHOICES, lambda t: t in CHOICES),
    ("guided_grammar", LARK, lambda t: re.fullmatch(LARK_RE, t)),
    ("guided_json", SCHEMA, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
])
def test_legacy_guided_fields(client, field, value, check):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,
                                         temperature=0, extra_body={field: value})
    assert check(out.choices[0].message.content), out.choices[0].message.content


# --- malformed forms: 400s naming the field ------------------------------------------------
def bad_request(client, body: dict, endpoint: str = "chat") -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                           extra_body=body)
        else:
            client.completions.create(model="tiny", prompt="x", max_tokens=8, extra_body=body)
    assert info.value.status_code == 400
    error = info.value.body
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error"
    assert "\n" not in error["message"]
    return error


@pytest.mark.parametrize("so", [
    {}, {"regex": ""}, {"choice": []}, {"choice": "alpha"}, {"grammar": ""},
    {"json": "{not json"}, {"json": "[1, 2]"}, {"json": 3}, {"json_object": False},
    {"regex": REGEX, "choice": CHOICES}, {"structural_tag": "x"}, "regex",
], ids=lambda so: json.dumps(so))
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_malformed_forms_are_400s_naming_the_field(client, so, endpoint):
    error = bad_request(client, {"structured_outputs": so}, endpoint)
    assert error["param"].startswith("structured_outputs"), error
    assert "structured_outputs" in error["message"], error


@pytest.mark.parametrize("body,param", [
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{"}, "guided_json"),
    ({"structured_outputs": {"regex": REGEX}, "guided_choice": CHOICES}, "guided_choice"),
    ({"guided_regex": REGEX, "guided_grammar": LARK}, "guided_grammar"),
    ({"structured_outputs": {"regex": REGEX}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ({"structured_outputs": {"regex": REGEX}, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}],
      "tool_choice": "required"}, "structured_outputs"),
])
def test_two_ways_in_or_a_bad_alias_are_400s(client, body, param):
    error = bad_request(client, body)
    assert error["param"] == param, error


@pytest.mark.parametrize("so,says", [
    ({"regex": "(ab"}, "unclosed group"),
    ({"grammar": "start: foo"}, 'unknown name: "foo"'),
    ({"grammar": "root ::= (("}, "Expected ')'"),
    ({"json": {"type": "nonsense"}}, "nonsense"),
])
def test_llguidance_refusals_are_400s_with_its_message(client, so, says):
    error = bad_request(client, {"structured_outputs": so})
    assert error["param"] == "structured_outputs"
    assert says in error["message"], error


# --- pathological inputs: refused within the limits, nothing else harmed ----------------
def _chain(rules: int) -> str:
    """A Lark chain of rules: compiled recursively, it overflows an 8 MiB stack at about
    3000 rules (a segfault in llguidance) and takes long at 10k+."""
    return ("start: r0\n" + "".join(f'r{i}: "a" r{i + 1} | "b" r{i + 1}\n'
                                    for i in range(rules)) + f'r{rules}: "z"\n')


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_deep_grammar_compiles_on_the_pools_stack(client):
    """4000 chained rules (112 KiB) would kill a server compiling on an ordinary thread."""
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                         temperature=0,
                                         extra_body={"structured_outputs": {"grammar": _chain(4000)}})
    assert re.fullmatch("[ab]*", out.choices[0].message.content)


def test_pathological_inputs_are_refused_while_a_stream_completes(client, served,
                                                                  monkeypatch):
    grammars = served.server.frontend.sampling.grammars
    # a slow compile on this tiny vocabulary needs a grammar over the size limit: raised
    # here so the time limit (lowered) is what refuses it, while it compiles on
    monkeypatch.setattr(grammars, "max_source_chars", 1 << 20)
    monkeypatch.setattr(grammars.pool, "time_limit", 0.2)
    arrivals: list[float] = []
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=300, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    chunks = iter(stream)
    first = next(chunks)  # in flight
    result: dict = {}

    def drain():
        for chunk in chunks:
            arrivals.append(time.monotonic())
            if chunk.usage is not None:
                result["usage"] = chunk.usage

    reader = threading.Thread(target=drain)
    reader.start()
    cases = [({"grammar": _chain(14000)}, "grammar_too_complex", "longer than"),
             ({"regex": "(" + "|".join(f"w{i}x" for i in range(200_000)) + ")"}, None,
              "characters"),
             ({"json": _nested(200)}, None, "recursion limit")]
    for so, code, says in cases:
        start = time.monotonic()
        error = bad_request(client, {"structured_outputs": so})
        assert time.monotonic() - start < 3.0
        assert error["param"] == "structured_outputs" and error["code"] == code, error
        assert says in error["message"], error
    health = time.monotonic()
    assert httpx.get(served.url + "/health", timeout=5).status_code == 200
    assert time.monotonic() - health < 1.0  # the event loop was never held
    reader.join(120)
    assert first is not None and result["usage"].completion_tokens == 300
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert max(gaps, default=0) < 1.5, max(gaps)  # no compile stalled the engine's steps


def test_the_server_still_serves_grammars_after(client):
    (text,) = chat(client, {"regex": REGEX})
    assert re.fullmatch(REGEX, text)


# --- the reasoning gate: the grammar starts after </think> ------------------------------
@pytest.fixture(scope="module")
def thinking(thinking_model):  # noqa: F811 - the fixture imported above
    running = _start(thinking_model, reasoning_parser="qwen3",
                     default_chat_template_kwargs='{"enable_thinking": true}')
    yield running
    running.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_the_grammar_applies_after_the_thinking(thinking, stream):
    client = OpenAI(base_url=thinking.url + "/v1", api_key="unused", max_retries=0)
    seen: list[bool] = []
    with scripted(thinking, "<think>Let me think</think>", answer=None, seen=seen):
        out = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=40, temperature=0, stream=stream,
            extra_body={"structured_outputs": {"regex": REGEX}})
        if stream:
            reasoning, content = "", ""
            for chunk in out:
                for c in chunk.choices:
                    reasoning += getattr(c.delta, "reasoning", None) or ""
                    content += c.delta.content or ""
        else:
            message = out.choices[0].message
            reasoning, content = message.reasoning, message.content
    assert reasoning == "Let me think"
    assert seen and all(seen)  # no thinking token was masked by the grammar
    assert re.fullmatch(REGEX, content.strip()), content


# --- engine processes: the grammar travels as text and compiles again there -----------------
def test_engine_process_answers_as_the_in_process_engine(client, tiny_llama):
    from tests.serve.api.conftest import start_server

    forms = [{"regex": REGEX}, {"grammar": _chain(4000)}, {"choice": CHOICES}]
    expected = [chat(client, so, max_tokens=12) if "grammar" not in so else None
                for so in forms]
    running = start_server(str(tiny_llama), engine_process=True)
    try:
        remote = OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        for so, want in zip(forms, expected, strict=True):
            out = remote.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=12 if want else 6,
                temperature=0, extra_body={"structured_outputs": so})
            text = out.choices[0].message.content
            assert [text] == want if want else re.fullmatch("[ab]*", text), text
    finally:
        running.stop()
