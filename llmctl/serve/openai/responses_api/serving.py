"""``/v1/responses``: a Responses request served by the chat frontend. The request
becomes the chat request it means (:mod:`.convert`, after the stored conversation its
``previous_response_id`` names), the chat path renders, plans tools and samples it, and
a :class:`~.build.ResponseBuilder` turns the chat updates into the response; finished
responses go to the store unless ``store: false``."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import TypeAdapter, ValidationError

from llmctl.serve.openai import errors
from llmctl.serve.openai.chat import OpenAIChat
from llmctl.serve.openai.errors import APIError
from llmctl.serve.openai.jobs import Job
from llmctl.serve.openai.models import OpenAIModels
from llmctl.serve.openai.protocol import ChatCompletionRequest
from llmctl.serve.openai.responses_api.build import ResponseBuilder
from llmctl.serve.openai.responses_api.convert import chat_request
from llmctl.serve.openai.responses_api.protocol import InputItem, ResponsesRequest
from llmctl.serve.openai.responses_api.store import ResponseStore, Stored
from llmctl.serve.openai.tools.request import ToolPlan
from llmctl.serve.openai.validation import first_error

_ITEMS = TypeAdapter(list[InputItem])

# the chat path's parameter names, as a Responses client knows them
_PARAMS: list[tuple[str, str]] = [
    (r"^messages(\..*)?$", "input"), (r"^max_(completion_)?tokens$", "max_output_tokens"),
    (r"^response_format(\..*)?$", "text.format"),
    (r"^tools\.(\d+)\.function\.(.*)$", r"tools.\1.\2")]


def responses_param(param: str | None) -> str | None:
    for pattern, name in _PARAMS:
        if param is not None and re.match(pattern, param):
            return re.sub(pattern, name, param)
    return param


def not_found(response_id: str, param: str | None = None) -> APIError:
    what = "Previous response" if param else "Response"
    code = "previous_response_not_found" if param else "response_not_found"
    return APIError(404, f"{what} with id {response_id!r} not found (never stored, stored "
                    "with store=false, or evicted: --responses-store-size)",
                    "invalid_request_error", param, code)


class OpenAIResponsesAPI:
    def __init__(self, chat: OpenAIChat, models: OpenAIModels, store_size: int = 256) -> None:
        self.chat = chat
        self.models = models
        self.store = ResponseStore(store_size)

    # --- the request ----------------------------------------------------------------
    def history(self, req: ResponsesRequest, owner: str | None = None) -> list:
        """The items before ``req``'s input: the conversation its previous response
        ended (that response's history, then its output); a 404 for an unknown id.
        ``owner``: the tenant asking (None without API keys)."""
        if req.previous_response_id is None:
            return []
        stored = self.store.get(req.previous_response_id, owner)
        if stored is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        return [*stored.history, *_ITEMS.validate_python(stored.response["output"])]

    def chat_request(self, req: ResponsesRequest, history: list) -> ChatCompletionRequest:
        try:
            return chat_request(req, history)
        except ValidationError as exc:  # e.g. more messages than a chat takes
            message, param = first_error(exc, ChatCompletionRequest)
            raise errors.bad_request(message, responses_param(param) or "input") from None

    def encode(self, chat_req: ChatCompletionRequest) -> list[int]:
        return _renamed(self.chat.encode, chat_req)

    def tool_plan(self, chat_req: ChatCompletionRequest) -> ToolPlan:
        return _renamed(self.chat.tool_plan, chat_req)

    def jobs(self, chat_req: ChatCompletionRequest, ids: list[int], cap: int | None,
             tools: ToolPlan) -> tuple[list[Job], Any]:
        jobs, params = _renamed(self.chat.jobs, chat_req, ids, cap, tools)
        for job in jobs:  # the response's id is its engine request's, as chat's are
            job.request_id = f"resp_{uuid.uuid4().hex}-{job.request_id.rsplit('-', 1)[1]}"
        return jobs, params

    # --- the response ---------------------------------------------------------------
    def builder(self, req: ResponsesRequest, chat_req: ChatCompletionRequest,
                jobs: list[Job]) -> ResponseBuilder:
        skeleton = {
            "id": jobs[0].request_id.rsplit("-", 1)[0], "object": "response",
            "created_at": int(time.time()), "status": "in_progress", "error": None,
            "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.models.response_model(jobs), "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": None,
            "store": req.stores, "temperature": chat_req.temperature,
            "text": req.text.model_dump(by_alias=True, exclude_none=True)
            if req.text is not None and req.text.format is not None
            else {"format": {"type": "text"}},
            "tool_choice": _tool_choice(req),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_p": chat_req.top_p, "truncation": "disabled", "usage": None,
            "user": req.user, "metadata": req.metadata or {}}
        return ResponseBuilder(skeleton, sum(len(j.prompt_ids) for j in jobs),
                               jobs[0].tools)

    def finished(self, req: ResponsesRequest, history: list, builder: ResponseBuilder,
                 owner: str | None = None) -> None:
        """Keep a finished response (unless ``store: false``) for its follow-ups."""
        if req.stores:
            self.store.put(Stored(builder.response, [*history, *req.input], owner))

    def retrieve(self, response_id: str, owner: str | None = None) -> dict[str, Any]:
        stored = self.store.get(response_id, owner)
        if stored is None:
            raise not_found(response_id)
        return stored.response


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if choice is None:
        return "auto" if req.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


def _renamed(fn: Callable[..., Any], *args) -> Any:
    """``fn(*args)`` with a 400's ``param`` named as the Responses request names it."""
    try:
        return fn(*args)
    except APIError as exc:
        exc.param = responses_param(exc.param)
        raise
