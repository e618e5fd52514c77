"""``--tool-call-parser openai`` (vLLM's name for gpt-oss): calls out of harmony messages.

gpt-oss calls a function with a commentary-channel message addressed to it::

    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{"arg": 1}<|call|>

``--reasoning-parser harmony`` (:mod:`llmctl.serve.openai.reasoning.harmony`) reads the
messages from the token ids and hands such a message on in the content as
``<|channel|>commentary to=functions.NAME<|message|>ARGS<|call|>``; this parser turns
each into a call (its arguments streamed as they come) and leaves the rest as content.
A message to another recipient (a built-in tool such as ``browser.search``) is no
function call: it stays in the content as written. Use the two together.
"""

from __future__ import annotations

from llmctl.serve.openai.reasoning.harmony import CALL, CHANNEL, MESSAGE, Header
from llmctl.serve.openai.tools.parsers import (
    AUTO_PARSERS,
    CallArgs,
    CallStart,
    Event,
    _Content,
    _holdback,
)

_FUNCTIONS = "functions."


class OpenAIToolParser:
    skip_special_tokens = True  # the reasoning parser reads the ids; the text is its own
    # the reasoning parsers that write the call markup this one reads (startup refuses
    # the pair otherwise: no call would ever be found)
    needs_reasoning_parser = ("harmony", "openai_gptoss")

    def __init__(self) -> None:
        self.pending = ""
        self.state = "text"  # text | header | args
        self.calls = 0
        self.content = _Content()

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        events: list[Event] = []
        while True:
            if self.state == "text":
                at = self.pending.find(CHANNEL)
                if at < 0:
                    cut = len(self.pending) - _holdback(self.pending, CHANNEL)
                    events += self.content.add(self.pending[:cut])
                    self.pending = self.pending[cut:]
                    return events
                events += self.content.add(self.pending[:at])
                self.pending, self.state = self.pending[at:], "header"
            elif self.state == "header":
                at = self.pending.find(MESSAGE)
                if at < 0:
                    return events  # the whole header is needed
                header, body = self.pending[:at], self.pending[at + len(MESSAGE):]
                recipient = Header.parse(header).recipient
                if recipient is None or not recipient.startswith(_FUNCTIONS):
                    events += self.content.add(header + MESSAGE)  # not a function call
                    self.pending, self.state = body, "text"
                    continue
                events.append(CallStart(self.calls, recipient[len(_FUNCTIONS):]))
                self.pending, self.state = body, "args"
            else:
                at = self.pending.find(CALL)
                if at < 0:
                    cut = len(self.pending) - _holdback(self.pending, CALL)
                    events += self._args(self.pending[:cut])
                    self.pending = self.pending[cut:]
                    return events
                events += self._args(self.pending[:at])
                self.pending, self.state = self.pending[at + len(CALL):], "text"
                self.calls += 1

    def finish(self) -> list[Event]:
        rest, self.pending = self.pending, ""
        if self.state == "args":  # cut short: the arguments so far
            events = self._args(rest)
            self.calls += 1
        else:
            events = self.content.add(rest)
        self.state = "text"
        return events

    def _args(self, text: str) -> list[Event]:
        return [CallArgs(self.calls, text)] if text else []


AUTO_PARSERS["openai"] = OpenAIToolParser
