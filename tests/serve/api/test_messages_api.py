"""``/v1/messages`` (Anthropic's Messages API) over HTTP with the official ``anthropic``
client: the server of test_responses_api (the thinking tiny model, a qwen3
``--reasoning-parser``, the hermes tool parser, thinking off by default), a scripted
sampler where the test needs a known output (an answer, thinking, a tool call)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from anthropic import Anthropic

from tests.serve.api.test_reasoning_http import (  # noqa: F401 - thinking_model: a fixture
    ANSWER,
    THOUGHT,
    _start,
    scripted,
    thinking_model,
)
from tests.serve.api.test_responses_api import (
    CALL,
    TIME,
    TOOL_TEMPLATE,
    engine_prompts,
    template,
)

TOOLS = [{"name": "get_time", "description": "The time", "input_schema": TIME}]
USER = [{"role": "user", "content": "What is 2 + 2?"}]


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
    return Anthropic(base_url=served.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def chat_client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(served):
    return served.engine.engine.tokenizer


def create(client, **kwargs):
    """Greedy. Fields some SDK versions lack go in ``extra_body``: the newest has no
    ``temperature`` (the server still takes it, as older clients send it), the oldest
    (the 0.40 of pyproject's dev extras) no ``thinking``."""
    kwargs.setdefault("messages", USER)
    kwargs["extra_body"] = {"temperature": 0, **kwargs.get("extra_body", {})}
    return client.messages.create(model="tiny", **kwargs)


def events_of(client, **kwargs) -> list:
    return list(create(client, stream=True, **kwargs))


def streamed_text(events) -> str:
    return "".join(e.delta.text for e in events
                   if e.type == "content_block_delta" and e.delta.type == "text_delta")


def post(served, body, path="/v1/messages", **kwargs) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(served.url + path, content=body, timeout=60,
                          headers={"content-type": "application/json"}, **kwargs)
    return httpx.post(served.url + path, json=body, timeout=60, **kwargs)


def anthropic_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]


def test_whole_and_streamed_agree_with_chat(client, chat_client, served):
    conversation = [{"role": "user", "content": "Hi there"}]
    chat = chat_client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=12,
        messages=[{"role": "system", "content": "Be brief."}, *conversation])
    whole = create(client, messages=conversation, system="Be brief.", max_tokens=12)
    blocks = create(client, max_tokens=12, system=[{"type": "text", "text": "Be brief."}],
                    messages=[{"role": "user", "content": [{"type": "text",
                                                            "text": "Hi there"}]}])
    events = events_of(client, messages=conversation, system="Be brief.", max_tokens=12)
    expected = chat.choices[0].message.content
    assert expected
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == expected
    assert blocks.content[0].text == expected and streamed_text(events) == expected
    assert whole.id.startswith("msg_") and whole.type == "message"
    assert whole.role == "assistant" and whole.model == "tiny"
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens == 12
    # the stream: Anthropic's event order, usage at its start and its end
    types = [e.type for e in events]
    deltas = types.count("content_block_delta")
    assert deltas > 1
    assert types == ["message_start", "content_block_start"] + ["content_block_delta"] * \
        deltas + ["content_block_stop", "message_delta", "message_stop"]
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert events[0].message.stop_reason is None and events[0].message.content == []
    assert events[-2].delta.stop_reason == "max_tokens"
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    # a system prompt makes a difference (it is not dropped)
    plain = create(client, messages=conversation, max_tokens=12)
    assert plain.usage.input_tokens < whole.usage.input_tokens


def test_sse_lines_are_anthropic_events(served):
    raw = post(served, {"model": "tiny", "max_tokens": 3, "stream": True, "messages": USER})
    assert raw.status_code == 200 and raw.headers["content-type"].startswith(
        "text/event-stream")
    frames = [f for f in raw.text.split("\n\n") if f]
    names = []
    for frame in frames:
        event_line, data_line = frame.split("\n")
        name = event_line.removeprefix("event: ")
        assert json.loads(data_line.removeprefix("data: "))["type"] == name
        names.append(name)
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    # every field the SDK's type requires (it parses leniently itself)
    from anthropic.types import Message
    whole = post(served, {"model": "tiny", "max_tokens": 3, "messages": USER})
    Message.model_validate(whole.json())


def test_stop_reasons(client, served):
    with scripted(served, "", answer=ANSWER):
        done = create(client, max_tokens=40)
        stopped = create(client, max_tokens=40, stop_sequences=["nope", "is"])
        events = events_of(client, max_tokens=40, stop_sequences=["is"])
        cut = create(client, max_tokens=3)
    assert done.content[0].text == ANSWER
    assert (done.stop_reason, done.stop_sequence) == ("end_turn", None)
    assert stopped.content[0].text == "The answer "
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "is")
    assert streamed_text(events) == "The answer "
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == (
        "stop_sequence", "is")
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_tool_use_round_trip(client, served, tok):
    question = [{"role": "user", "content": "What time is it in Paris?"}]
    with scripted(served, "", answer=CALL):
        out = create(client, messages=question, tools=TOOLS, max_tokens=80)
        with client.messages.stream(model="tiny", messages=question, tools=TOOLS,
                                    max_tokens=80, extra_body={"temperature": 0}) as stream:
            events = list(stream)
            final = stream.get_final_message()
    [call] = out.content
    assert call.type == "tool_use" and call.name == "get_time"
    assert call.id.startswith("toolu_") and call.input == {"tz": "CET"}
    assert out.stop_reason == "tool_use"
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    assert json.loads(partial) == {"tz": "CET"}
    [streamed_call] = final.content
    assert streamed_call.input == {"tz": "CET"} and final.stop_reason == "tool_use"

    follow_up = [*question, {"role": "assistant", "content": [call.model_dump(
        exclude_none=True)]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "14:05"}]}]
    with template(served, TOOL_TEMPLATE), engine_prompts(served, tok) as seen, \
            scripted(served, "", answer="It is 14:05."):
        second = create(client, messages=follow_up, tools=TOOLS, max_tokens=40)
        failed = create(client, tools=TOOLS, max_tokens=40, messages=[
            *follow_up[:2], {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                 "content": [{"type": "text", "text": "no clock"}]}]}])
    assert second.content[0].text == "It is 14:05." and second.stop_reason == "end_turn"
    assert failed.content[0].text == "It is 14:05."
    head = ("<|im_start|>user\nWhat time is it in Paris?<|im_end|>\n"
            '<|im_start|>assistant\n<tool_call>get_time {"tz": "CET"}</tool_call>'
            "<|im_end|>\n")
    assert seen == [
        f"{head}<|im_start|>tool\n14:05 [{call.id}]<|im_end|>\n<|im_start|>assistant\n",
        (f"{head}<|im_start|>tool\nError: no clock [{call.id}]<|im_end|>\n"
         "<|im_start|>assistant\n")]


def test_tool_choice_any_and_tool_force_a_call(client):
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_time"}):
        out = create(client, tools=TOOLS, tool_choice=choice, max_tokens=60)
        calls = [b for b in out.content if b.type == "tool_use"]
        assert calls and calls[0].name == "get_time", out
        assert calls[0].input.get("tz") in ("UTC", "CET")
    none = create(client, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=8)
    assert [b.type for b in none.content] == ["text"]


def test_thinking_blocks(client, served):
    thinking = {"type": "enabled", "budget_tokens": 30}
    with scripted(served, f"<think>{THOUGHT}</think>"):
        out = create(client, max_tokens=60, extra_body={"thinking": thinking})
        events = events_of(client, max_tokens=60, extra_body={"thinking": thinking})
        off = create(client, max_tokens=60, extra_body={"thinking": {"type": "disabled"}})
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert out.content[0].thinking == THOUGHT and out.content[1].text == ANSWER
    thought = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                      and e.delta.type == "thinking_delta")
    assert thought == THOUGHT and streamed_text(events) == ANSWER
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == ANSWER
    # without a reasoning parser the thinking cannot be told apart: a 400
    chat = served.server.frontend.chat
    before, chat.reasoning = chat.reasoning, None
    try:
        with pytest.raises(anthropic.BadRequestError) as err:
            create(client, max_tokens=60, extra_body={"thinking": thinking})
    finally:
        chat.reasoning = before
    assert "--reasoning-parser" in err.value.body["error"]["message"]


def test_prefill_continues_the_assistant_message(client, served, tok):
    with engine_prompts(served, tok) as seen, scripted(served, "", answer=" 4."):
        out = create(client, max_tokens=10, messages=[
            *USER, {"role": "assistant", "content": "The answer is"}])
    assert out.content[0].text == " 4."
    assert seen[0].endswith("<|im_start|>assistant\nThe answer is")


def test_count_tokens_is_the_prompt(client, served):
    kwargs = {"messages": USER, "system": "Be brief.", "tools": TOOLS}
    counted = post(served, {"model": "tiny", **kwargs}, "/v1/messages/count_tokens")
    assert counted.status_code == 200 and set(counted.json()) == {"input_tokens"}
    out = create(client, max_tokens=1, tool_choice={"type": "none"}, **kwargs)
    assert counted.json()["input_tokens"] == out.usage.input_tokens > 0


def test_unknown_model_and_keys_answer_in_anthropic_shape(client, served, tmp_path):
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="nope", max_tokens=3, messages=USER)
    assert err.value.body["error"]["type"] == "not_found_error"
    assert "nope" in err.value.body["error"]["message"]

    import yaml

    from llmctl.serve.api.tenancy.gate import Tenancy
    from llmctl.serve.api.tenancy.keys import TenantTable, hash_key

    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"tenants": {"alice": {}}, "keys": [
        {"key_sha256": hash_key("sk-alice"), "tenant": "alice"}]}))
    handler = served.server
    before = handler.tenancy
    handler.tenancy = Tenancy(TenantTable.load(path), handler.metrics,
                              handler.frontend.models.served_names, str(path))
    try:
        # Anthropic's clients send x-api-key
        keyed = Anthropic(base_url=served.url, api_key="sk-alice", max_retries=0)
        assert create(keyed, max_tokens=2).usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError) as err:
            create(Anthropic(base_url=served.url, api_key="sk-bad", max_retries=0),
                   max_tokens=2)
        assert err.value.body["error"]["type"] == "authentication_error"
    finally:
        handler.tenancy = before


UNSUPPORTED = [
    ({"unheard_of": 1}, "unheard_of"),
    ({"output_config": {"effort": "high"}}, "output_config"),
    ({"container": "c_1"}, "container"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}, "image"),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "data": "x",
                                        "media_type": "text/plain"}}]}]}, "document"),
    ({"messages": [*USER, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "x"}]}]}, "redacted_thinking"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}]}, "image"),
    ({"thinking": {"type": "enabled", "budget_tokens": 10, "display": "omitted"}},
     "display"),
]


@pytest.mark.parametrize(("extra", "named"), UNSUPPORTED,
                         ids=[n + str(i) for i, (_, n) in enumerate(UNSUPPORTED)])
def test_unsupported_fields_are_400s_naming_them(served, extra, named):
    body = {"model": "tiny", "max_tokens": 20, "messages": USER, **extra}
    error = anthropic_error(post(served, body), 400)
    assert error["type"] == "invalid_request_error"
    assert named in error["message"], error


def test_neutral_values_are_taken(client):
    out = create(client, max_tokens=2, metadata={"user_id": "u1"},
                 system=[{"type": "text", "text": "Be brief.",
                          "cache_control": {"type": "ephemeral"}}],
                 extra_body={"speed": "standard", "cache_control": {"type": "ephemeral"},
                             "service_tier": "auto"})
    assert out.usage.output_tokens == 2


MALFORMED = [
    (b'{"messages": [', "malformed JSON"),
    (b'["messages"]', "JSON object"),
    ({"model": "tiny", "messages": USER}, "max_tokens"),
    ({"model": "tiny", "max_tokens": 5}, "messages"),
    ({"max_tokens": 5, "messages": USER}, "model"),
    ({"model": "tiny", "max_tokens": 0, "messages": USER}, "max_tokens"),
    ({"model": "tiny", "max_tokens": 5, "messages": []}, "messages"),
    ({"model": "tiny", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]},
     "messages"),
    ({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": 5}]},
     "messages"),
    ({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [None]}]},
     "messages"),
    ({"model": "tiny", "max_tokens": 5, "messages": USER, "temperature": 1.5},
     "temperature"),
    ({"model": "tiny", "max_tokens": 5, "messages": USER, "top_p": 0}, "top_p"),
    ({"model": "tiny", "max_tokens": 5, "messages": USER, "stop_sequences": [""]},
     "stop_sequences"),
    ({"model": "tiny", "max_tokens": 10 ** 9, "messages": USER}, "max_tokens"),
    ({"model": "tiny", "max_tokens": 5, "messages": USER, "tool_choice": {"type": "any"}},
     "tool_choice"),
    ({"model": "tiny", "max_tokens": 5, "messages": USER, "tools": TOOLS,
      "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"model": "tiny", "max_tokens": 5, "messages": USER, "tools": [
        {"name": "f", "input_schema": {"type": "string"}}]}, "input_schema"),
    ({"model": "tiny", "max_tokens": 5, "messages": USER, "tools": [
        {"name": "f", "input_schema": {"type": "object", "properties": 5}}]}, "tools.0"),
    ({"model": "tiny", "max_tokens": 5, "messages": USER, "tools": [{"name": "f"}]},
     "input_schema"),
    ({"model": "tiny", "max_tokens": 5, "messages": USER,
      "thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"model": "tiny", "max_tokens": 5, "messages": USER,
      "thinking": {"type": "enabled", "budget_tokens": 5}}, "budget_tokens"),
    ({"model": "tiny", "max_tokens": 5, "messages": USER, "metadata": {"tags": 1}},
     "metadata"),
    ({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]}, "tool_use_id"),
]


def test_malformed_bodies_are_400s_while_a_stream_completes(client, served):
    with scripted(served, "", answer=ANSWER):
        stream = iter(create(client, max_tokens=40, stream=True))
        events = [next(stream)]  # the stream is in flight
        for body, needle in MALFORMED:
            error = anthropic_error(post(served, body), 400)
            assert error["type"] == "invalid_request_error"
            assert needle in error["message"], (body, error)
        counted = post(served, {"model": "tiny", "messages": USER, "bogus": 1},
                       "/v1/messages/count_tokens")
        assert "bogus" in anthropic_error(counted, 400)["message"]
        events += list(stream)
    assert streamed_text(events) == ANSWER
    assert events[-1].type == "message_stop" and events[-2].delta.stop_reason == "end_turn"


def test_a_body_over_the_limit_is_413_in_anthropic_shape(served):
    limit = served.server.config.max_request_bytes
    body = json.dumps({"model": "tiny", "max_tokens": 5, "messages": [
        {"role": "user", "content": "x" * (limit + 1)}]}).encode()
    error = anthropic_error(post(served, body), 413)
    assert error["type"] == "request_too_large" and "--max-request-bytes" in error["message"]


def test_openai_routes_keep_their_error_shape(served):
    resp = post(served, {"model": "tiny", "messages": USER, "bogus": 1},
                "/v1/chat/completions")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "bogus"
    unknown = post(served, {}, "/v1/messages/nothing_here")
    assert anthropic_error(unknown, 404)["type"] == "not_found_error"


def test_an_error_mid_stream_is_an_error_event():
    import asyncio
    from types import SimpleNamespace

    from llmctl.serve.openai import errors
    from llmctl.serve.openai.messages_api.build import MessageBuilder
    from llmctl.serve.openai.messages_api.stream import message_events
    from llmctl.serve.openai.render import Update

    async def updates():
        yield 0, Update(0, [1], "Hal", None, None)
        raise errors.unavailable("the engine is gone")

    class Counter:  # ServerMetrics.http_errors: labels(...).inc()
        def labels(self, *_):
            return self

        def inc(self):
            self.count = getattr(self, "count", 0) + 1

    metrics = SimpleNamespace(http_errors=Counter())
    builder = MessageBuilder({"id": "msg_x", "model": "tiny"}, 3)

    async def collect():
        return [e async for e in message_events(builder, updates(), metrics)]

    lines = asyncio.run(collect())
    events = [json.loads(line.split("data: ", 1)[1]) for line in lines]
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start",
                                           "content_block_delta", "error"]
    assert all(line.startswith(f"event: {e['type']}\n") for line, e in zip(lines, events))
    assert events[-1]["error"] == {"type": "overloaded_error",
                                   "message": "the engine is gone"}
    assert metrics.http_errors.count == 1


def test_error_types_follow_the_status():
    from llmctl.serve.api.limits import too_large
    from llmctl.serve.openai import errors
    from llmctl.serve.openai.messages_api.errors import error_body

    cases = [(errors.bad_request("x", "p"), "invalid_request_error"),
             (errors.unauthorized(), "authentication_error"),
             (errors.model_forbidden("m"), "permission_error"),
             (errors.model_not_found("m", "tiny"), "not_found_error"),
             (too_large(10, 20), "request_too_large"),
             (errors.overloaded(1), "rate_limit_error"),
             (errors.unavailable("gone"), "overloaded_error"),
             (errors.internal("bug"), "api_error")]
    for exc, kind in cases:
        body = error_body(exc, "/v1/messages")
        assert body["type"] == "error" and body["error"]["type"] == kind
        assert error_body(exc, "/v1/chat/completions") == exc.body()
    assert error_body(errors.bad_request("x", "p"), "/v1/messages")["error"][
        "message"] == "p: x"


def test_a_coding_agent_turn_as_chat_messages():
    from llmctl.serve.openai.messages_api.convert import chat_request
    from llmctl.serve.openai.messages_api.protocol import MessagesRequest

    req = MessagesRequest.model_validate({
        "model": "tiny", "max_tokens": 5, "stop_sequences": ["X"], "top_k": 5,
        "metadata": {"user_id": "u"},
        "system": [{"type": "text", "text": "S1"},
                   {"type": "text", "text": "S2", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "f", "input_schema": {"type": "object"},
                   "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "user", "content": [{"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": ""},
                {"type": "text", "text": "c"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "r"},
                {"type": "text", "text": "more"}]},
            {"role": "assistant", "content": "pre"}]})
    chat = chat_request(req)
    assert [m.for_template() for m in chat.messages] == [
        {"role": "system", "content": "S1\nS2"},
        {"role": "user", "content": "a\nb"},  # consecutive turns are one, as Anthropic's
        {"role": "assistant", "content": "c", "reasoning_content": "hm", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f",
                                                          "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "r", "tool_call_id": "t1"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "pre"}]
    assert chat.continue_final_message and not chat.add_generation_prompt  # a prefill
    assert (chat.stop, chat.top_k, chat.user) == (["X"], 5, "u")
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == {"type": "object"}
