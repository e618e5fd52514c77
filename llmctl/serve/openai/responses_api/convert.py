"""A Responses request as the chat request it means: input items as chat messages, the
Responses shapes of tools, ``tool_choice`` and ``text.format`` as chat's, so the chat
path (templates, tool grammars and parsers, response_format grammars, reasoning) serves
both alike. Pure functions: no tokenizer, no engine."""

from __future__ import annotations

from typing import Any

from llmctl.serve.openai.protocol import ChatCompletionRequest
from llmctl.serve.openai.responses_api.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    NamedFunction,
    ReasoningItem,
    ResponsesRequest,
)


def chat_messages(items: list, instructions: str | None = None) -> list[dict[str, Any]]:
    """Input items (a conversation so far) as chat messages (OpenAI's chat shape).

    ``instructions`` is a system message first. ``function_call`` items are the tool
    calls of an assistant message: the one just before them when it is an assistant's
    (a turn that said something and then called), else a new one with no content;
    consecutive calls share it. ``function_call_output`` items are tool messages. A
    ``reasoning`` item is the thinking of the assistant message that follows it (its
    ``reasoning_content``, which templates that keep thinking read)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    thinking = ""  # a reasoning item's text, waiting for its assistant message
    for item in items:
        if isinstance(item, ReasoningItem):
            thinking += item.text()
        elif isinstance(item, MessageItem):
            message: dict[str, Any] = {"role": item.role, "content": item.text()}
            if item.role == "assistant" and thinking:
                message["reasoning_content"], thinking = thinking, ""
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            if thinking:
                last["reasoning_content"] = last.get("reasoning_content", "") + thinking
                thinking = ""
            last.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function",
                 "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.text()})
    return messages


def chat_request(req: ResponsesRequest, history: list) -> ChatCompletionRequest:
    """The chat request ``req`` means, after ``history`` (the items of the responses its
    ``previous_response_id`` continues; their instructions are not carried over, as
    OpenAI does)."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages([*history, *req.input], req.instructions),
        "stream": req.stream, "priority": req.priority}
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if req.tools:
        body["tools"] = [{"type": "function", "function": tool.model_dump(
            exclude={"type"}, exclude_none=True)} for tool in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}} \
            if isinstance(choice, NamedFunction) else choice
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        body["response_format"] = {"type": fmt.type}
        if fmt.type == "json_schema":
            body["response_format"]["json_schema"] = {
                "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict,
                "description": fmt.description}
    return ChatCompletionRequest.model_validate(body)

