"""Chat updates (:class:`~llmctl.serve.openai.render.Update`, thinking already split off)
as a Responses object and its stream events.

One state machine serves both answers: a stream sends the events :meth:`feed` returns
as they come, a whole response feeds every update and keeps only :attr:`response`, so
the two cannot disagree. Items open as their first text arrives (a ``reasoning`` item
for thinking, a ``message`` for the answer, a ``function_call`` per call the tool
parser reads) and close when the next one opens or the response ends; event and field
names are OpenAI's, as the ``openai`` SDK's types and vLLM spell them."""

from __future__ import annotations

import copy
import uuid
from typing import Any

from llmctl.serve.openai.render import Update
from llmctl.serve.openai.tools.request import ToolPlan


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """One response's output items, usage and events, from its updates in order."""

    def __init__(self, skeleton: dict[str, Any], prompt_tokens: int,
                 tools: ToolPlan | None = None) -> None:
        """``skeleton``: the response object's request-derived fields (id, model,
        created_at, tools, ...); ``tools``: the request's plan, whose parser reads calls
        out of the answer."""
        self.skeleton = skeleton
        self.prompt_tokens = prompt_tokens
        self.reader = tools.new_choice() if tools is not None and tools.active else None
        self.output: list[dict[str, Any]] = []  # items, the open one last
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # the tool parser's index -> item
        self.sequence = 0
        self.output_tokens = 0
        self.reasoning_tokens = 0
        self.finish_reason: str | None = None

    # --- the response object ------------------------------------------------------
    @property
    def status(self) -> str:
        if self.finish_reason is None:
            return "in_progress"
        return "incomplete" if self.finish_reason == "length" else "completed"

    @property
    def response(self) -> dict[str, Any]:
        body = copy.deepcopy(self.skeleton)
        status = self.status
        body.update(status=status, output=copy.deepcopy(self.output),
                    incomplete_details={"reason": "max_output_tokens"}
                    if status == "incomplete" else None)
        if status != "in_progress":
            body["usage"] = {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": self.prompt_tokens + self.output_tokens}
        return body

    def _event(self, type_: str, **fields) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    # --- the life of a response ---------------------------------------------------
    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def feed(self, upd: Update) -> list[dict[str, Any]]:
        """The events ``upd`` makes (none when it only adds tokens held back)."""
        self.output_tokens += len(upd.token_ids)
        self.reasoning_tokens += upd.reasoning_tokens
        events: list[dict[str, Any]] = []
        if upd.reasoning:
            events += self._text("reasoning", upd.reasoning)
        text, calls, reason = upd.text, [], upd.finish_reason
        if self.reader is not None:
            text, calls, reason = self.reader.update(upd.text, upd.finish_reason)
        if text:
            events += self._text("message", text)
        for delta in calls:
            events += self._call(delta)
        if upd.finish_reason:
            self.finish_reason = "length" if reason == "length" else reason
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The last item closed and ``response.completed`` (``response.incomplete`` when
        max_output_tokens or the context cut the answer)."""
        if self.finish_reason is None:  # no update said so: the stream ended early
            self.finish_reason = "length"
        events = self._close("incomplete" if self.status == "incomplete" else "completed")
        type_ = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return events + [self._event(type_, response=self.response)]

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """``response.failed`` with OpenAI's error (``code``, ``message``)."""
        body = self.response
        body.update(status="failed", error=error)
        return [self._event("response.failed", response=body)]

    # --- items --------------------------------------------------------------------
    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        """``text`` added to the open ``kind`` item ("reasoning" or "message"), opening
        one (and closing another) first when needed."""
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != kind:
            events += self._close("completed")
            events += self._open_text(kind)
        item, index = self.open, len(self.output) - 1
        item["content"][0]["text"] += text
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if kind == "reasoning":
            return events + [self._event("response.reasoning_text.delta", **where,
                                         delta=text)]
        return events + [self._event("response.output_text.delta", **where, delta=text,
                                     logprobs=[])]

    def _open_text(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            item = {"id": item_id("rs"), "type": "reasoning", "summary": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": item_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        index = len(self.output)
        events = [self._event("response.output_item.added", output_index=index,
                              item={**item, "content": []}),
                  self._event("response.content_part.added", item_id=item["id"],
                              output_index=index, content_index=0, part=dict(part))]
        item["content"] = [part]
        self.output.append(item)
        self.open = item
        return events

    def _call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """One tool-call delta of the chat stream's shape: a new call (with ``id`` and
        ``name``), or a piece of an open call's arguments."""
        events: list[dict[str, Any]] = []
        function = delta.get("function", {})
        if "id" in delta:
            events += self._close("completed")
            item = {"id": item_id("fc"), "type": "function_call", "call_id": delta["id"],
                    "name": function["name"], "arguments": "", "status": "in_progress"}
            self.output.append(item)
            self.open = self.calls[delta["index"]] = item
            events.append(self._event("response.output_item.added",
                                      output_index=len(self.output) - 1, item=dict(item)))
        item = self.calls.get(delta["index"])
        if item is not None and function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item["id"],
                                      output_index=self.output.index(item),
                                      delta=function["arguments"]))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The open item's closing events, with ``status`` as its last."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index = self.output.index(item)
        if item["type"] == "function_call":
            return [self._event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=index, name=item["name"],
                                arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=index,
                                item=dict(item))]
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        done = ("response.reasoning_text.done", {}) if item["type"] == "reasoning" else (
            "response.output_text.done", {"logprobs": []})
        return [self._event(done[0], **where, text=part["text"], **done[1]),
                self._event("response.content_part.done", **where, part=dict(part)),
                self._event("response.output_item.done", output_index=index,
                            item=copy.deepcopy(item))]
