"""The Responses API without HTTP: input items as chat messages, a Responses request as
the chat request it means (tools, tool_choice, text.format, limits), the response
builder's items and events, and the LRU store."""

from __future__ import annotations

import pytest

from llmctl.serve.openai.render import Update
from llmctl.serve.openai.responses_api.build import ResponseBuilder
from llmctl.serve.openai.responses_api.convert import chat_messages, chat_request
from llmctl.serve.openai.responses_api.protocol import ResponsesRequest
from llmctl.serve.openai.responses_api.serving import responses_param
from llmctl.serve.openai.responses_api.store import ResponseStore, Stored
from llmctl.serve.openai.tools.parsers import auto_parser
from llmctl.serve.openai.tools.request import ToolPlan


def req(**body) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", **body})


def messages(input_, instructions=None) -> list[dict]:
    return chat_messages(req(input=input_).input, instructions)


def test_a_string_is_one_user_message_after_the_instructions():
    assert messages("hi", "Be brief.") == [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "hi"}]


def test_message_items_and_their_parts():
    got = messages([
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "ok", "annotations": [], "logprobs": []}]},
    ])
    assert got == [{"role": "developer", "content": "Rules."},
                   {"role": "user", "content": "ab"},
                   {"role": "assistant", "content": "ok"}]


def test_calls_join_the_assistant_turn_and_outputs_are_tool_messages():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'}
    got = messages([
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"role": "assistant", "content": "Let me look."},
        call, {**call, "call_id": "c2", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "so"}]},
        call,  # a turn that only calls: an assistant message of its own
    ])
    calls = [{"id": "c1", "type": "function", "function": {"name": "f",
                                                           "arguments": '{"x": 1}'}},
             {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert got == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hmm",
         "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "", "reasoning_content": "so",
         "tool_calls": calls[:1]},
    ]


def test_the_chat_request_it_means():
    schema = {"type": "object"}
    chat = chat_request(req(
        input="hi", instructions="sys", max_output_tokens=7, temperature=0.5, top_p=0.9,
        tools=[{"type": "function", "name": "f", "parameters": schema}],
        tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "s", "schema": schema,
                         "strict": True}}, stream=True),
        history=req(input="before").input)
    assert [m.role for m in chat.messages] == ["system", "user", "user"]
    assert chat.messages[1].content == "before"
    assert (chat.token_limit, chat.temperature, chat.top_p, chat.stream) == (7, 0.5, 0.9,
                                                                             True)
    assert chat.tools[0].function.name == "f" and chat.tools[0].function.parameters == schema
    assert chat.tool_mode == "named" and chat.parallel_tool_calls is False
    assert chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema.schema_ == schema
    plain = chat_request(req(input="hi"), [])
    assert (plain.temperature, plain.top_p, plain.token_limit, plain.tools) == (1.0, 1.0,
                                                                                None, None)


def test_parameter_names_as_a_responses_client_knows_them():
    assert responses_param("messages") == "input"
    assert responses_param("max_completion_tokens") == "max_output_tokens"
    assert responses_param("response_format") == "text.format"
    assert responses_param("tools.2.function.parameters") == "tools.2.parameters"
    assert responses_param("tool_choice") == "tool_choice" and responses_param(None) is None


SKELETON = {"id": "resp_1", "object": "response", "created_at": 1, "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": None,
            "max_output_tokens": None, "model": "m", "output": [],
            "parallel_tool_calls": True, "previous_response_id": None, "reasoning": None,
            "store": True, "temperature": 1.0, "text": {"format": {"type": "text"}},
            "tool_choice": "auto", "tools": [], "top_p": 1.0, "truncation": "disabled",
            "usage": None, "user": None, "metadata": {}}


def builder(tools: ToolPlan | None = None) -> ResponseBuilder:
    return ResponseBuilder(SKELETON, 5, tools)


def strictly_valid(events: list[dict]) -> None:
    """Each event (and the response in it) as the openai SDK's types define them, every
    required field there (the SDK itself parses leniently)."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)


def upd(text="", reasoning="", finish=None, n=1, thinking=0) -> Update:
    return Update(0, [1] * n, text, finish, None, reasoning, thinking)


def test_builder_items_and_event_order():
    b = builder()
    events = b.start()
    for u in (upd(reasoning="hm", thinking=1), upd(reasoning="m", thinking=1),
              upd("An"), upd("swer", finish="stop")):
        events += b.feed(u)
    events += b.finish()
    strictly_valid(events)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    body = b.response
    assert body["status"] == "completed" and body["incomplete_details"] is None
    reasoning, message = body["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert message["content"][0]["text"] == "Answer" and message["status"] == "completed"
    assert body["usage"] == {"input_tokens": 5,
                             "input_tokens_details": {"cached_tokens": 0,
                                                      "cache_write_tokens": 0},
                             "output_tokens": 4,
                             "output_tokens_details": {"reasoning_tokens": 2},
                             "total_tokens": 9}
    assert events[-1]["response"] == body


def test_builder_length_is_incomplete_and_failed_keeps_the_items():
    b = builder()
    b.start()
    b.feed(upd("Once", finish="length"))
    events = b.finish()
    assert events[-1]["type"] == "response.incomplete"
    assert b.response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert b.response["output"][0]["status"] == "incomplete"
    strictly_valid(events)
    [failed] = b.failed({"code": "server_error", "message": "late"})
    strictly_valid([failed])
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"


def test_builder_reads_calls_with_the_tool_parser():
    b = builder(ToolPlan("auto", parser=auto_parser("hermes")))
    events = b.feed(upd('Sure. <tool_call>{"name": "f", "arguments": {"x": 1}}'))
    events += b.feed(upd("</tool_call>", finish="stop"))
    events += b.finish()
    strictly_valid(events)
    message, call = b.response["output"]
    assert message["content"][0]["text"].strip() == "Sure."
    assert (call["type"], call["name"], call["call_id"][:5]) == ("function_call", "f",
                                                                 "call_")
    assert call["arguments"].replace(" ", "") == '{"x":1}'
    deltas = "".join(e["delta"] for e in events
                     if e["type"] == "response.function_call_arguments.delta")
    assert deltas == call["arguments"]
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == call["arguments"] and done["name"] == "f"


def stored(rid: str, owner=None) -> Stored:
    return Stored({"id": rid}, [], owner)


def test_store_is_a_bounded_lru_per_owner():
    store = ResponseStore(2)
    store.put(stored("a"))
    store.put(stored("b"))
    assert store.get("a") is not None  # a is now the most recently used
    store.put(stored("c"))
    assert store.get("b") is None and len(store) == 2
    store.put(stored("t", owner="alice"))
    assert store.get("t") is None and store.get("t", "bob") is None
    assert store.get("t", "alice").response == {"id": "t"}
    off = ResponseStore(0)
    off.put(stored("a"))
    assert off.get("a") is None and len(off) == 0


@pytest.mark.parametrize("body", [
    {"input": "x", "background": True}, {"input": "x", "include": ["file_search_call"]},
    {"input": "x", "tools": [{"type": "file_search"}]},
    {"input": [{"type": "computer_call"}]}, {"input": ""},
    {"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
    {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "abc"}]},
])
def test_refused_bodies(body):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate(body)
