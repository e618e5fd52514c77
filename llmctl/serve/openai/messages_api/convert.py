"""A Messages request as the chat request it means, so the chat path (templates, tool
grammars and parsers, reasoning) serves both alike. Pure functions: no tokenizer, no
engine.

- ``system`` is a system message first; text blocks join with a newline (as vLLM joins
  a message's text parts). Consecutive user (or assistant) turns are one turn, as
  Anthropic combines them.
- An assistant message's ``text`` blocks are its content, ``tool_use`` blocks its
  ``tool_calls`` (``input`` as JSON arguments), ``thinking`` blocks its
  ``reasoning_content`` (which templates that keep thinking read).
- A user message's ``tool_result`` blocks are tool messages (``tool_use_id`` their
  ``tool_call_id``; ``is_error`` puts "Error: " before the result, since chat templates
  have no field for it); its text blocks a user message, in the order they come.
- A final assistant message is a prefill: the answer continues it (the template is
  rendered with ``continue_final_message``, no generation prompt).
- ``tool_choice``: ``auto`` -> "auto", ``any`` -> "required", ``tool`` -> that named
  function, ``none`` -> "none"; ``disable_parallel_tool_use`` -> ``parallel_tool_calls:
  false``.
- ``thinking``: ``enabled`` / ``adaptive`` keep the template's thinking on
  (``enable_thinking: true`` for ``enabled``; ``adaptive`` leaves the server's default),
  ``disabled`` switches it off (``enable_thinking: false``).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from llmctl.serve.openai.messages_api.protocol import (
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    _Conversation,
)
from llmctl.serve.openai.protocol import ChatCompletionRequest


class MessagesChatRequest(ChatCompletionRequest):
    """The chat request a Messages request means: chat's fields, and a prefill's
    ``continue_final_message`` (which :meth:`Prompts.chat
    <llmctl.serve.openai.prompts.Prompts.chat>` reads)."""

    continue_final_message: bool = Field(False)


def chat_messages(req: _Conversation) -> list[dict[str, Any]]:
    """``req``'s system prompt and messages as chat messages (OpenAI's chat shape)."""
    messages: list[dict[str, Any]] = []
    if system := req.system_text():
        messages.append({"role": "system", "content": system})
    for message in req.messages:
        if message.role == "assistant":
            turn = [_assistant(message.blocks())]
        else:
            turn = _user(message.role, message.blocks())
        for chat in turn:
            if messages and chat["role"] in ("user", "assistant") and \
                    messages[-1]["role"] == chat["role"]:
                _combine(messages[-1], chat)
            else:
                messages.append(chat)
    return messages


def _combine(into: dict[str, Any], turn: dict[str, Any]) -> None:
    """``turn`` (a user or assistant chat message) added to the one before it."""
    into["content"] = "\n".join(t for t in (into["content"], turn["content"]) if t)
    if "reasoning_content" in turn:
        into["reasoning_content"] = "\n".join(
            t for t in (into.get("reasoning_content"), turn["reasoning_content"]) if t)
    if "tool_calls" in turn:
        into["tool_calls"] = into.get("tool_calls", []) + turn["tool_calls"]


def _assistant(blocks: list) -> dict[str, Any]:
    text, thinking, calls = [], [], []
    for block in blocks:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name,
                                       "arguments": json.dumps(block.input)}})
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(text)}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(role: str, blocks: list) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    text: list[str] = []

    def flush() -> None:
        if text:
            messages.append({"role": role, "content": "\n".join(text)})
            text.clear()

    for block in blocks:
        if isinstance(block, ToolResultBlock):
            flush()
            result = block.text()
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                             "content": f"Error: {result}" if block.is_error else result})
        elif isinstance(block, TextBlock):
            text.append(block.text)
    flush()
    return messages


def chat_request(req: _Conversation) -> MessagesChatRequest:
    """The chat request ``req`` (a MessagesRequest or CountTokensRequest) means."""
    messages = chat_messages(req)
    prefill = req.messages[-1].role == "assistant"
    body: dict[str, Any] = {
        "model": req.model, "messages": messages,
        "add_generation_prompt": not prefill, "continue_final_message": prefill}
    for name in ("max_tokens", "temperature", "top_p", "top_k"):
        if (value := getattr(req, name, None)) is not None:
            body[name] = value
    body["stream"] = getattr(req, "stream", False)
    body["priority"] = getattr(req, "priority", 0)
    if stop := getattr(req, "stop_sequences", None):
        body["stop"] = list(stop)
    metadata = getattr(req, "metadata", None)
    if metadata is not None and metadata.user_id is not None:
        body["user"] = metadata.user_id
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": tool.name, "parameters": tool.input_schema,
            **({"description": tool.description} if tool.description is not None else {})}}
            for tool in req.tools]
    choice = req.tool_choice
    if choice is not None and req.tools:  # auto or none without tools: nothing to choose
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type) or {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    thinking = req.thinking
    if thinking is not None and thinking.type != "adaptive":
        body["chat_template_kwargs"] = {"enable_thinking": thinking.type == "enabled"}
    return MessagesChatRequest.model_validate(body)
