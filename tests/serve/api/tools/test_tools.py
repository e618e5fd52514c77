"""Chat tool calls over HTTP with the official openai client: forced calls (required,
named) validate against the tools' schemas, streamed deltas assemble to the non-streamed
answer, "auto" reads the model's own calls, and mistakes are 400s."""

import json
from contextlib import contextmanager

import jsonschema
import openai
import pytest
from openai import OpenAI

from tests.serve.api.conftest import start_server

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["tz"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
BASE = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "temperature": 0}


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def _calls(message) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, arguments validated against the tool's schema."""
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def _streamed(client, **kwargs) -> tuple[str | None, list[tuple[str, dict]], str]:
    """Content, calls and finish reason assembled from the stream's deltas."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        [choice] = chunk.choices
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            if d.id is not None:  # the first delta of a call: id, type, name
                assert d.index not in calls and d.type == "function"
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
        reason = choice.finish_reason or reason
    return content or None, [(n, json.loads(a)) for n, a in
                             (calls[i] for i in sorted(calls))], reason


def test_required_gives_valid_calls_and_streams_the_same(client):
    args = {**BASE, "tool_choice": "required", "max_tokens": 80}
    out = client.chat.completions.create(**args)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = _calls(choice.message)
    assert len(calls) >= 1
    assert _streamed(client, **args) == (None, calls, "tool_calls")


def test_required_single_call_sampled(client):
    # parallel_tool_calls=false: the grammar allows exactly one call
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", n=3, seed=5,
        temperature=1.0, max_tokens=60, parallel_tool_calls=False)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(_calls(choice.message)) == 1


def test_named_function(client):
    args = {**BASE, "tool_choice": NAMED, "max_tokens": 40}
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "tool_calls"
    [(name, arguments)] = _calls(choice.message)
    assert name == "get_time"
    assert _streamed(client, **args) == (None, [(name, arguments)], "tool_calls")


def test_none_is_plain_content(client):
    args = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    plain = client.chat.completions.create(**args).choices[0]
    out = client.chat.completions.create(tools=TOOLS, tool_choice="none", **args).choices[0]
    assert out.message.tool_calls is None
    assert out.finish_reason in ("stop", "length")
    # the tiny template does not render tools: the same prompt, the same greedy text
    assert out.message.content == plain.message.content


@contextmanager
def _auto_parser(served, name: str):
    sampling = served.server.frontend.sampling
    before, sampling.auto_tool_parser = sampling.auto_tool_parser, name
    try:
        yield
    finally:
        sampling.auto_tool_parser = before


@contextmanager
def _scripted(served, text: str):
    """The in-process engine's sampler replaced by one that writes ``text`` then EOS:
    what a tool-calling model would say, through the real engine, detokenizer and API."""
    engine = served.engine.engine
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert engine.tokenizer.decode(ids) == text
    eos = engine.tokenizer.eos_token_id

    def sample(logits, seqs):
        return [ids[len(s.output_token_ids)] if len(s.output_token_ids) < len(ids) else eos
                for s in seqs]

    engine.sampler.sample = sample
    try:
        yield
    finally:
        del engine.sampler.sample


HERMES_OUTPUT = ('Let me check. <tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}'
                 "</tool_call>")


def test_auto_hermes_reads_the_models_call(client, served):
    args = {**BASE, "max_tokens": 100}  # tool_choice auto: the default with tools
    with _auto_parser(served, "hermes"), _scripted(served, HERMES_OUTPUT):
        choice = client.chat.completions.create(**args).choices[0]
        streamed = _streamed(client, **args)
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert _calls(choice.message) == [("get_time", {"tz": "CET"})]
    assert streamed == ("Let me check.", [("get_time", {"tz": "CET"})], "tool_calls")


def test_auto_hermes_without_a_call_is_content(client, served):
    with _auto_parser(served, "hermes"), _scripted(served, "It is sunny <tool_call"):
        choice = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                tool_choice="auto", max_tokens=50).choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content == "It is sunny <tool_call"  # held back, then released
    assert choice.finish_reason == "stop"


def test_auto_llama3_json_with_the_model_forced_by_a_schema(client, served):
    # response_format makes the tiny model write a Llama 3 style call as its whole message
    call = {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_time"]},
                                             "parameters": TIME},
            "required": ["name", "parameters"], "additionalProperties": False}
    args = {**BASE, "tool_choice": "auto", "max_tokens": 60,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "call", "schema": call}}}
    with _auto_parser(served, "llama3_json"):
        choice = client.chat.completions.create(**args).choices[0]
        streamed = _streamed(client, **args)
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = _calls(choice.message)
    assert [name for name, _ in calls] == ["get_time"]
    assert streamed == (None, calls, "tool_calls")


def test_tool_messages_render_through_the_template(client):
    history = [*MESSAGES,
               {"role": "assistant", "content": None,
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "get_time",
                                             "arguments": '{"tz": "CET"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    out = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                         tool_choice="none", max_tokens=4)
    assert out.usage.prompt_tokens > 0


def test_for_template_follows_transformers_conventions(tiny_llama):
    from transformers import AutoTokenizer

    from llmctl.serve.openai.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_time", "arguments": '{"tz": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}], "tools": TOOLS})
    # a template in the style of Qwen2.5's: tools, calls' arguments with tojson, tool ids
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}:"
                "{% for c in m.tool_calls or [] %}{{ c.function.name }}"
                "{{ c.function.arguments | tojson }}{% endfor %}"
                "{{ m.tool_call_id or '' }}{{ m.content }};{% endfor %}")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    from llmctl.serve.openai.tools.request import template_tools

    text = tokenizer.apply_chat_template([m.for_template() for m in req.messages],
                                         tools=template_tools(req), chat_template=template,
                                         tokenize=False)
    assert text == '[get_weather][get_time]assistant:get_time{"tz": "CET"};tool:call_112:00;'


@pytest.mark.parametrize("extra,needle", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "'nope', which is not in tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, 'must be "none", "auto", "required"'),
    ({"tools": TOOLS}, "--enable-auto-tool-choice --tool-call-parser"),  # auto by default
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "nonsense"}}}], "tool_choice": "none"}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "appears twice"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format cannot be combined"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
     "tool_call_id belongs to tool messages"),
])
def test_mistakes_are_400(client, extra, needle):
    messages = extra.get("messages", MESSAGES)
    body = {k: v for k, v in extra.items() if k != "messages"}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                       extra_body=body)
    assert info.value.status_code == 400
    assert needle in info.value.message


def test_in_an_engine_process(tiny_llama, served, client):
    """Forced calls and their grammars cross the process boundary (pickled as text): the
    same calls as the in-process engine gives, token for token (greedy)."""
    required = {**BASE, "tool_choice": "required", "max_tokens": 80}
    named = {**required, "tool_choice": NAMED, "max_tokens": 40}
    expected = [_calls(client.chat.completions.create(**a).choices[0].message)
                for a in (required, named)]
    running = start_server(str(tiny_llama), engine_process=True)
    try:
        remote = OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        got = [_calls(remote.chat.completions.create(**a).choices[0].message)
               for a in (required, named)]
        assert got == expected
        assert _streamed(remote, **named) == (None, expected[1], "tool_calls")
    finally:
        running.stop()


@pytest.mark.parametrize("extra", [
    {"tools": [{}]}, {"tools": "x"}, {"tools": [TOOLS[0]] * 129},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}],
     "tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": {"type": "function"}},
    {"tools": TOOLS, "tool_choice": 5}, {"tools": TOOLS, "parallel_tool_calls": "x"},
    {"tools": [{"type": "code", "function": {"name": "f"}}]},
    {"messages": [{"role": "assistant", "tool_calls": [{"id": 1}]}]},
    {"messages": [{"role": "assistant", "tool_calls": "x"}]},
])
def test_odd_tool_fields_are_refused_not_500(served, extra):
    import httpx

    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **extra}
    resp = httpx.post(served.url + "/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert set(resp.json()["error"]) >= {"message", "type", "param", "code"}
