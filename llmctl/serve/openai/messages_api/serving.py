"""``/v1/messages``: a Messages request served by the chat frontend. The request becomes
the chat request it means (:mod:`.convert`), the chat path renders, plans tools and
samples it, and a :class:`~.build.MessageBuilder` turns the chat updates into the
message; a 400 from the chat path names the parameter as the Messages request does."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from llmctl.serve.openai import errors
from llmctl.serve.openai.chat import OpenAIChat
from llmctl.serve.openai.errors import APIError
from llmctl.serve.openai.jobs import Job
from llmctl.serve.openai.messages_api.build import MessageBuilder, StopAssembly, message_id
from llmctl.serve.openai.messages_api.convert import MessagesChatRequest, chat_request
from llmctl.serve.openai.messages_api.protocol import _Conversation
from llmctl.serve.openai.models import OpenAIModels
from llmctl.serve.openai.responses import Responses
from llmctl.serve.openai.tools.request import ToolPlan
from llmctl.serve.openai.validation import first_error

# the chat path's parameter names, as a Messages client knows them
_PARAMS: list[tuple[str, str]] = [
    (r"^messages(\..*)?$", "messages"), (r"^max_(completion_)?tokens$", "max_tokens"),
    (r"^stop(\..*)?$", "stop_sequences"), (r"^chat_template_kwargs$", "thinking"),
    (r"^parallel_tool_calls$", "tool_choice.disable_parallel_tool_use"),
    (r"^user$", "metadata.user_id"),
    (r"^tools\.(\d+)\.function\.parameters(\..*)?$", r"tools.\1.input_schema\2"),
    (r"^tools\.(\d+)\.function\.(.*)$", r"tools.\1.\2")]


def messages_param(param: str | None) -> str | None:
    for pattern, name in _PARAMS:
        if param is not None and re.match(pattern, param):
            return re.sub(pattern, name, param)
    return param


class AnthropicMessages:
    def __init__(self, chat: OpenAIChat, models: OpenAIModels) -> None:
        self.chat = chat
        self.models = models

    # --- the request ----------------------------------------------------------------
    def chat_request(self, req: _Conversation) -> MessagesChatRequest:
        thinking = req.thinking
        if thinking is not None and thinking.type != "disabled" and \
                self.chat.reasoning is None:
            raise errors.bad_request(
                f'thinking type "{thinking.type}" needs a server started with '
                "--reasoning-parser NAME (the thinking is split from the answer by it); "
                'send thinking {"type": "disabled"} or leave it out', "thinking")
        try:
            return chat_request(req)
        except ValidationError as exc:  # e.g. a tool name chat's rules refuse
            message, param = first_error(exc, MessagesChatRequest)
            raise errors.bad_request(message, messages_param(param) or "messages") from None

    def encode(self, chat_req: MessagesChatRequest) -> list[int]:
        return _renamed(self.chat.encode, chat_req)

    def tool_plan(self, chat_req: MessagesChatRequest) -> ToolPlan:
        if chat_req.tool_mode == "auto" and self.chat.sampling.auto_tool_parser is None:
            raise errors.bad_request(
                'tool_choice "auto" (the default when tools are given) needs a server '
                "started with --enable-auto-tool-choice --tool-call-parser NAME; send "
                'tool_choice {"type": "any"}, {"type": "tool", "name": NAME} or '
                '{"type": "none"} instead', "tool_choice")
        return _renamed(self.chat.tool_plan, chat_req)

    def jobs(self, chat_req: MessagesChatRequest, ids: list[int], cap: int | None,
             tools: ToolPlan) -> tuple[list[Job], Any]:
        jobs, params = _renamed(self.chat.jobs, chat_req, ids, cap, tools)
        for job in jobs:  # the message's id is its engine request's, as chat's are
            job.request_id = f"{message_id()}-{job.request_id.rsplit('-', 1)[1]}"
        return jobs, params

    # --- the response ---------------------------------------------------------------
    def assembly(self, responses: Responses, chat_req: MessagesChatRequest,
                 jobs: list[Job]) -> StopAssembly:
        return StopAssembly(responses, "chat", chat_req, jobs)

    def builder(self, chat_req: MessagesChatRequest, jobs: list[Job],
                assembly: StopAssembly) -> MessageBuilder:
        skeleton = {"id": jobs[0].request_id.rsplit("-", 1)[0],
                    "model": self.models.response_model(jobs)}
        return MessageBuilder(skeleton, sum(len(j.prompt_ids) for j in jobs),
                              jobs[0].tools, chat_req.stop_list, assembly)


def _renamed(fn: Callable[..., Any], *args) -> Any:
    """``fn(*args)`` with a 400's ``param`` named as the Messages request names it."""
    try:
        return fn(*args)
    except APIError as exc:
        exc.param = messages_param(exc.param)
        raise
