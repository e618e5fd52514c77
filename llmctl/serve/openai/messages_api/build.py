"""Chat updates (:class:`~llmctl.serve.openai.render.Update`, thinking already split off)
as an Anthropic message and its stream events.

One state machine serves both answers, as the Responses builder does: a stream sends
the events :meth:`MessageBuilder.feed` returns as they come, a whole response feeds
every update and keeps only :attr:`MessageBuilder.message`, so the two cannot
disagree. Content blocks open as their first text arrives (``thinking`` for the
reasoning parser's thinking, ``text`` for the answer, ``tool_use`` per call the tool
parser reads) and close when the next one opens or the message ends. Event, block and
field names are Anthropic's, as the ``anthropic`` SDK's types spell them."""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

from llmctl.serve.openai.render import Update
from llmctl.serve.openai.responses import Assembly
from llmctl.serve.openai.tools.request import ToolPlan

# chat finish reasons as Anthropic's stop reasons ("stop" is end_turn or stop_sequence)
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


class StopAssembly(Assembly):
    """The chat path's assembly, also keeping what ended the output: the stop string
    (or stop token id) the engine matched, which chat's finish reason "stop" hides."""

    stop_reason: str | int | None = None

    def updates(self, job, out):
        for completion in out.outputs:
            if completion.finish_reason:
                self.stop_reason = completion.stop_reason
        return super().updates(job, out)


class MessageBuilder:
    """One message's content blocks, usage and events, from its updates in order."""

    def __init__(self, skeleton: dict[str, Any], prompt_tokens: int,
                 tools: ToolPlan | None = None, stop_sequences: list[str] | None = None,
                 assembly: StopAssembly | None = None) -> None:
        """``skeleton``: the message's id and model; ``tools``: the request's plan, whose
        parser reads calls out of the answer; ``assembly``: where the matched stop
        sequence is read."""
        self.skeleton = skeleton
        self.prompt_tokens = prompt_tokens
        self.reader = tools.new_choice() if tools is not None and tools.active else None
        self.stop_sequences = stop_sequences or []
        self.assembly = assembly
        self.content: list[dict[str, Any]] = []  # blocks, the open one last
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # the tool parser's index -> block
        self.arguments: dict[int, str] = {}  # a tool_use block's index -> its JSON text
        self.output_tokens = 0
        self.finish_reason: str | None = None

    # --- the message ---------------------------------------------------------------
    @property
    def stop(self) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence); (None, None) while the message is running."""
        if self.finish_reason is None:
            return None, None
        if self.finish_reason in _STOP_REASONS:
            return _STOP_REASONS[self.finish_reason], None
        matched = self.assembly.stop_reason if self.assembly is not None else None
        if isinstance(matched, str) and matched in self.stop_sequences:
            return "stop_sequence", matched
        return "end_turn", None

    @property
    def usage(self) -> dict[str, int]:
        return {"input_tokens": self.prompt_tokens, "output_tokens": self.output_tokens}

    @property
    def message(self) -> dict[str, Any]:
        stop_reason, stop_sequence = self.stop
        content = copy.deepcopy(self.content)
        for index, block in enumerate(content):
            if block["type"] == "tool_use":
                block["input"] = _input(self.arguments.get(index, ""))
        return {**self.skeleton, "type": "message", "role": "assistant",
                "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": self.usage}

    # --- the life of a message -----------------------------------------------------
    def start(self) -> list[dict[str, Any]]:
        message = self.message
        message["usage"] = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def feed(self, upd: Update) -> list[dict[str, Any]]:
        """The events ``upd`` makes (none when it only adds tokens held back)."""
        self.output_tokens += len(upd.token_ids)
        events: list[dict[str, Any]] = []
        if upd.reasoning:
            events += self._text("thinking", upd.reasoning)
        text, calls, reason = upd.text, [], upd.finish_reason
        if self.reader is not None:
            text, calls, reason = self.reader.update(upd.text, upd.finish_reason)
        if text:
            events += self._text("text", text)
        for delta in calls:
            events += self._call(delta)
        if upd.finish_reason:
            self.finish_reason = reason
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The last block closed, ``message_delta`` (the stop reason, the usage) and
        ``message_stop``."""
        if self.finish_reason is None:  # no update said so: the stream ended early
            self.finish_reason = "length"
        stop_reason, stop_sequence = self.stop
        return self._close() + [
            {"type": "message_delta",
             "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
             "usage": self.usage},
            {"type": "message_stop"}]

    # --- blocks --------------------------------------------------------------------
    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        """``text`` added to the open ``kind`` block ("thinking" or "text"), opening one
        (and closing another) first when needed."""
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            block = {"type": "thinking", "thinking": "", "signature": ""} \
                if kind == "thinking" else {"type": "text", "text": ""}
            events += self._open(block)
        self.open[kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {
            "type": "text_delta", "text": text}
        return events + [{"type": "content_block_delta", "index": len(self.content) - 1,
                          "delta": delta}]

    def _call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """One tool-call delta of the chat stream's shape: a new call (with ``id`` and
        ``name``), or a piece of an open call's arguments."""
        events: list[dict[str, Any]] = []
        function = delta.get("function", {})
        if "id" in delta:
            events += self._close()
            block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                     "name": function["name"], "input": {}}
            events += self._open(block)
            self.calls[delta["index"]] = block
        block = self.calls.get(delta["index"])
        if block is not None and function.get("arguments"):
            index = next(i for i, b in enumerate(self.content) if b is block)
            self.arguments[index] = self.arguments.get(index, "") + function["arguments"]
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta",
                                     "partial_json": function["arguments"]}})
        return events

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self.content.append(block)
        self.open = block
        return [{"type": "content_block_start", "index": len(self.content) - 1,
                 "content_block": dict(block)}]

    def _close(self) -> list[dict[str, Any]]:
        block, self.open = self.open, None
        if block is None:
            return []
        index = next(i for i, b in enumerate(self.content) if b is block)
        return [{"type": "content_block_stop", "index": index}]


def _input(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as tool_use ``input``: an object, ``{}`` when the text is
    no JSON object (a call cut short by max_tokens)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
