"""``/v1/responses`` over HTTP with the official openai client (``client.responses``):
one server on the thinking tiny model of test_reasoning_http (``<think>`` tokens, a
``--reasoning-parser``, the hermes tool parser), its thinking switched off by default so
the real model's greedy answers are plain; a scripted sampler where the test needs a
known output (thinking, a tool call)."""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from tests.serve.api.test_reasoning_http import (  # noqa: F401 - thinking_model: a fixture
    ANSWER,
    THOUGHT,
    _start,
    ids_of,
    scripted,
    thinking_model,
)

TIME = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["tz"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_time", "description": "The time",
          "parameters": TIME}]
CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
# renders tool calls and tool results, which the thinking template does not
TOOL_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}{{ '<tool_call>' + c['function']['name'] + ' '"
    " + (c['function']['arguments'] | tojson) + '</tool_call>' }}{% endfor %}"
    "{% if m.get('tool_call_id') %}{{ ' [' + m['tool_call_id'] + ']' }}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def served(thinking_model):  # noqa: F811 - the imported fixture
    running = _start(thinking_model, reasoning_parser="qwen3",
                     default_chat_template_kwargs='{"enable_thinking": false}')
    # tool_choice auto reads calls with the hermes parser (--tool-call-parser hermes)
    running.server.frontend.sampling.auto_tool_parser = "hermes"
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(served):
    return served.engine.engine.tokenizer


@contextmanager
def thinking(served):
    """The template leaves the thinking open (the model thinks), as a request's
    ``enable_thinking: true`` would."""
    prompts = served.server.frontend.prompts
    before, prompts.default_template_kwargs = prompts.default_template_kwargs, {}
    try:
        yield
    finally:
        prompts.default_template_kwargs = before


@contextmanager
def engine_prompts(served, tok):
    """The prompt text of every request the engine is handed."""
    engine, seen = served.engine, []
    real = engine.submit

    def submit(request_id, prompt_token_ids, *args, **kwargs):
        seen.append(tok.decode(prompt_token_ids))
        return real(request_id, prompt_token_ids, *args, **kwargs)

    engine.submit = submit
    try:
        yield seen
    finally:
        del engine.submit


@contextmanager
def template(served, text: str):
    tokenizer = served.server.frontend.prompts.tokenizer
    before, tokenizer.chat_template = tokenizer.chat_template, text
    try:
        yield
    finally:
        tokenizer.chat_template = before


def create(client, **kwargs):
    return client.responses.create(model="tiny", temperature=0, **kwargs)


def test_text_and_message_input_answer_as_chat_does(client):
    chat = client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=12,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hi there"}])
    text = create(client, input="Hi there", instructions="Be brief.", max_output_tokens=12)
    items = create(client, max_output_tokens=12, input=[
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text",
                                                               "text": "there"}]}])
    expected = chat.choices[0].message.content
    assert expected and text.output_text == expected and items.output_text == expected
    assert text.id.startswith("resp_") and text.object == "response"
    [message] = text.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    usage = text.usage
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert text.model == "tiny" and text.created_at > 0
    # every field the SDK's type requires (it parses leniently itself)
    from openai.types.responses import Response
    raw = httpx.post(str(client.base_url) + "responses", json={"model": "tiny", "input": "Hi",
                                                               "max_output_tokens": 3})
    Response.model_validate(raw.json())


def test_max_output_tokens_is_incomplete(client):
    out = create(client, input="Tell me a long story", max_output_tokens=3)
    assert out.status == "incomplete"
    assert out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3 and out.output[0].status == "incomplete"


def test_reasoning_is_its_own_item(client, served, tok):
    with thinking(served), scripted(served, f"<think>{THOUGHT}</think>"):
        out = create(client, input="What is 2 + 2?", max_output_tokens=60)
        events = list(create(client, input="What is 2 + 2?", max_output_tokens=60,
                             stream=True))
    reasoning, message = out.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", THOUGHT)]
    assert message.type == "message" and out.output_text == ANSWER
    assert out.usage.output_tokens_details.reasoning_tokens == len(ids_of(tok, THOUGHT))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == done.text == THOUGHT
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output_text == ANSWER


def test_function_call_round_trip(client, served, tok):
    with scripted(served, "", answer=CALL):
        out = create(client, input="What time is it in Paris?", tools=TOOLS,
                     max_output_tokens=80)
        events = list(create(client, input="What time is it in Paris?", tools=TOOLS,
                             max_output_tokens=80, stream=True))
    [call] = out.output
    assert call.type == "function_call" and call.name == "get_time"
    assert call.call_id.startswith("call_") and json.loads(call.arguments) == {"tz": "CET"}
    assert out.status == "completed" and out.output_text == ""
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"tz": "CET"}
    [added] = [e for e in events if e.type == "response.output_item.added"]
    assert added.item.type == "function_call" and added.item.name == "get_time"

    follow_up = [{"role": "user", "content": "What time is it in Paris?"},
                 call.model_dump(exclude_none=True),
                 {"type": "function_call_output", "call_id": call.call_id,
                  "output": "14:05"}]
    with template(served, TOOL_TEMPLATE), engine_prompts(served, tok) as seen, \
            scripted(served, "", answer="It is 14:05."):
        second = create(client, input=follow_up, tools=TOOLS, max_output_tokens=40)
    assert second.output_text == "It is 14:05."
    assert seen == [(
        "<|im_start|>user\nWhat time is it in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>get_time {"tz": "CET"}</tool_call><|im_end|>\n'
        f"<|im_start|>tool\n14:05 [{call.call_id}]<|im_end|>\n<|im_start|>assistant\n")]


def test_a_call_continued_by_previous_response_id(client, served, tok):
    # the stored output (a reasoning item, then the call) goes back in as the history
    with template(served, TOOL_TEMPLATE):
        with scripted(served, f"<think>{THOUGHT}</think>", answer=CALL):
            first = create(client, input="Time?", tools=TOOLS, max_output_tokens=80)
        assert [i.type for i in first.output] == ["reasoning", "function_call"]
        call = first.output[1]
        with engine_prompts(served, tok) as seen, scripted(served, "", answer="14:05."):
            second = create(client, previous_response_id=first.id, tools=TOOLS,
                            max_output_tokens=40, input=[{
                                "type": "function_call_output", "call_id": call.call_id,
                                "output": "14:05"}])
    assert second.output_text == "14:05."
    assert seen == [(
        "<|im_start|>user\nTime?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>get_time {"tz": "CET"}</tool_call><|im_end|>\n'
        f"<|im_start|>tool\n14:05 [{call.call_id}]<|im_end|>\n<|im_start|>assistant\n")]


def test_tool_choice_required_and_named(client):
    for choice in ("required", {"type": "function", "name": "get_time"}):
        out = create(client, input="Time?", tools=TOOLS, tool_choice=choice,
                     max_output_tokens=60)
        calls = [i for i in out.output if i.type == "function_call"]
        assert calls and calls[0].name == "get_time", out
        jsonschema.validate(json.loads(calls[0].arguments), TIME)
    none = create(client, input="Time?", tools=TOOLS, tool_choice="none",
                  max_output_tokens=8)
    assert [i.type for i in none.output] == ["message"]


def test_json_schema_format_constrains_a_real_generation(client):
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER,
                      "strict": True}}
    out = create(client, input="Weather?", text=fmt, max_output_tokens=80)
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), WEATHER)
    assert out.text.format.type == "json_schema"
    obj = create(client, input="Weather?", text={"format": {"type": "json_object"}},
                 max_output_tokens=80)
    assert obj.status != "completed" or isinstance(json.loads(obj.output_text), dict)
    assert obj.output_text.lstrip().startswith("{")


def test_streaming_events_in_order(client):
    kwargs = {"input": "Write about the sea", "max_output_tokens": 10}
    whole = create(client, **kwargs)
    events = list(create(client, stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter
    for event in events:  # every field the SDK's types require
        TypeAdapter(ResponseStreamEvent).validate_python(event.model_dump())
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    head = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.incomplete"]
    assert types == head + ["response.output_text.delta"] * len(deltas) + tail
    assert events[0].response.status == "in_progress"
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == events[-1].response.output_text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in deltas)
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens == 10


def test_streaming_completed(client, served):
    with scripted(served, "", answer=ANSWER):
        events = list(create(client, input="2 + 2?", stream=True, max_output_tokens=40))
    assert events[-1].type == "response.completed"
    assert events[-1].response.status == "completed"
    assert events[-1].response.output_text == ANSWER
    # a streamed response is kept once complete, as a whole one is
    assert client.responses.retrieve(events[-1].response.id).output_text == ANSWER


def test_previous_response_id_continues(client, served, tok):
    with scripted(served, "", answer=ANSWER):
        first = create(client, input="What is 2 + 2?", instructions="Be exact.",
                       max_output_tokens=30)
        with engine_prompts(served, tok) as seen:
            second = create(client, input="And 3 + 3?", previous_response_id=first.id,
                            max_output_tokens=30)
    assert second.previous_response_id == first.id
    [prompt] = seen
    # the first turn (its instructions are not carried over, as OpenAI does)
    assert prompt.startswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
                             f"<|im_start|>assistant\n{ANSWER}<|im_end|>\n"
                             "<|im_start|>user\nAnd 3 + 3?")
    assert "Be exact." not in prompt
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    with pytest.raises(openai.NotFoundError) as err:
        create(client, input="x", previous_response_id="resp_unknown")
    assert err.value.body["param"] == "previous_response_id"
    assert err.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")


def test_store_false_and_lru_eviction(client, served):
    store = served.server.frontend.responses_api.store
    before, store.size = store.size, 2
    try:
        a, b = (create(client, input=x, max_output_tokens=2) for x in "ab")
        client.responses.retrieve(a.id)  # a is now the most recently used
        c = create(client, input="c", max_output_tokens=2)
        assert len(store) == 2
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(b.id)
        assert {client.responses.retrieve(r.id).id for r in (a, c)} == {a.id, c.id}
        unstored = create(client, input="d", max_output_tokens=2, store=False)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unstored.id)
        store.size = 0
        off = create(client, input="e", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(off.id)
    finally:
        store.size = before


UNSUPPORTED = [
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                               "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file",
                                               "file_id": "file_1"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"unheard_of": 1}, "unheard_of"),
]


@pytest.mark.parametrize(("extra", "param"), UNSUPPORTED,
                         ids=[p + str(i) for i, (_, p) in enumerate(UNSUPPORTED)])
def test_unsupported_fields_are_400s_naming_them(client, extra, param):
    body = {"model": "tiny", "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/responses", body=body, cast_to=httpx.Response)
    error = err.value.body
    assert error["param"].split(".")[0] == param, error
    assert error["type"] == "invalid_request_error"
    named = next(iter(extra)) if param != "input" else extra["input"][0].get(
        "type") or extra["input"][0]["content"][0]["type"]
    assert named in error["message"], error


def test_neutral_values_are_taken(client):
    out = create(client, input="hi", max_output_tokens=2, background=False, include=[],
                 truncation="disabled", metadata={"k": "v"}, user="u",
                 reasoning={"effort": None})
    assert out.metadata == {"k": "v"}


MALFORMED = [
    (b'{"input": [', None), (b'["input"]', None),
    (json.dumps({"input": 5}).encode(), "input"),
    (json.dumps({"input": []}).encode(), "input"),
    (json.dumps({"input": [{"role": "robot", "content": "x"}]}).encode(), "input"),
    (json.dumps({"input": [{"type": "function_call_output", "output": "x"}]}).encode(),
     "input"),
    (json.dumps({"input": "x", "temperature": 9}).encode(), "temperature"),
    (json.dumps({"input": "x", "max_output_tokens": 0}).encode(), "max_output_tokens"),
    (json.dumps({"input": "x", "tool_choice": "required"}).encode(), None),
    (json.dumps({"input": "x", "tools": TOOLS,
                 "tool_choice": {"type": "function", "name": "nope"}}).encode(), None),
    (json.dumps({"input": "x", "text": {"format": {"type": "json_schema"}}}).encode(),
     "text.format"),
    (json.dumps({"input": "x", "text": {"format": {"type": "json_schema", "name": "s",
                                                   "schema": {"type": "nonsense"}}}}
                ).encode(), "text.format"),
    (json.dumps({"input": "x", "tools": [{"type": "function", "name": "f",
                                          "parameters": {"type": 5}}]}).encode(),
     "tools.0.parameters"),
    (json.dumps({"input": "x", "max_output_tokens": 10 ** 9}).encode(),
     "max_output_tokens"),
    (json.dumps({"input": [None, 1]}).encode(), "input"),
    (json.dumps({"input": [{"role": "user", "content": [None]}]}).encode(), "input"),
    (json.dumps({"input": [{"role": "user", "content": None}]}).encode(), "input"),
    (json.dumps({"input": "x", "tools": [None]}).encode(), "tools"),
    (json.dumps({"input": "x", "tools": "f"}).encode(), "tools"),
    (json.dumps({"input": "x", "tool_choice": {"type": "web_search"}}).encode(),
     "tool_choice"),
    (json.dumps({"input": "x", "text": "json"}).encode(), "text"),
    (json.dumps({"input": "x", "metadata": {"a": 1}}).encode(), "metadata"),
]


def test_malformed_bodies_are_400s_while_a_stream_completes(client, served):
    with scripted(served, "", answer=ANSWER):
        stream = iter(create(client, input="2 + 2?", stream=True, max_output_tokens=40))
        events = [next(stream)]  # the stream is in flight
        for raw, param in MALFORMED:
            got = httpx.post(served.url + "/v1/responses", content=raw,
                             headers={"Content-Type": "application/json"})
            assert got.status_code == 400, (raw, got.text)
            error = got.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            if param is not None:
                assert error["param"] == param or error["param"].startswith(param + "."), (
                    raw, error)
        events += list(stream)
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == ANSWER


def test_store_size_flag_reaches_the_frontend_and_hand_offs_refuse_it():
    from llmctl.errors import UsageError
    from llmctl.serve.handoff.engines import refuse_unsupported
    from llmctl.serve.launch.startup import ServeSettings
    from tests.cli.test_usage_errors import assert_usage_error, run

    assert ServeSettings(model="m").responses_store_size == 256
    assert_usage_error(run("serve", "m", "--responses-store-size", "-1"),
                       "--responses-store-size")
    for engine in ("vllm", "trtllm"):
        with pytest.raises(UsageError, match="--responses-store-size"):
            refuse_unsupported(engine, {"--responses-store-size"})


def test_an_error_mid_stream_is_response_failed():
    import asyncio
    from types import SimpleNamespace

    from llmctl.serve.api.streaming import response_events
    from llmctl.serve.openai import errors
    from llmctl.serve.openai.render import Update
    from llmctl.serve.openai.responses_api.build import ResponseBuilder

    async def updates():
        yield 0, Update(0, [1], "Hal", None, None)
        raise errors.timed_out(2.0)

    class Counter:  # ServerMetrics.http_errors: labels(...).inc()
        def labels(self, *_):
            return self

        def inc(self):
            self.count = getattr(self, "count", 0) + 1

    metrics, finished = SimpleNamespace(http_errors=Counter()), []
    builder = ResponseBuilder({"id": "resp_x", "model": "tiny", "output": []}, 3)

    async def collect():
        return [e async for e in response_events(builder, updates(), metrics,
                                                 lambda: finished.append(1))]

    lines = asyncio.run(collect())
    events = [json.loads(line.split("data: ", 1)[1]) for line in lines]
    assert [e["type"] for e in events][-2:] == ["response.output_text.delta",
                                                "response.failed"]
    assert all(line.startswith(f"event: {e['type']}\n") for line, e in zip(lines, events))
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "request_timeout" in failed["error"]["message"]
    assert failed["output"][0]["content"][0]["text"] == "Hal"
    assert not finished and metrics.http_errors.count == 1  # a failed response is not kept


def test_a_tenant_reads_only_its_own_responses(served, tmp_path):
    import yaml

    from llmctl.serve.api.tenancy.gate import Tenancy
    from llmctl.serve.api.tenancy.keys import TenantTable, hash_key

    keys = {"alice": "sk-alice", "bob": "sk-bob"}
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({
        "tenants": {name: {} for name in keys},
        "keys": [{"key_sha256": hash_key(key), "tenant": name} for name, key in keys.items()]}))
    handler = served.server
    before = handler.tenancy
    handler.tenancy = Tenancy(TenantTable.load(path), handler.metrics,
                              handler.frontend.models.served_names, str(path))
    alice, bob = (OpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0)
                  for key in keys.values())
    try:
        mine = create(alice, input="hi", max_output_tokens=2)
        assert alice.responses.retrieve(mine.id).id == mine.id
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            create(bob, input="more", previous_response_id=mine.id, max_output_tokens=2)
        assert create(alice, input="more", previous_response_id=mine.id,
                      max_output_tokens=2).previous_response_id == mine.id
    finally:
        handler.tenancy = before
