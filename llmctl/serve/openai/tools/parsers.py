"""Tool calls out of generated text, incrementally: one parser per chat choice.

A parser is fed the choice's text as it is generated (``feed``) and told when it ends
(``finish``); it answers with events: :class:`Text` (message content), :class:`CallStart`
(a call's index and function name) and :class:`CallArgs` (a piece of that call's
arguments, JSON text). A non-streamed response is the same parser fed the whole text
once, so streamed and non-streamed answers agree by construction.

Model formats for ``tool_choice: "auto"`` (``llmctl serve --tool-call-parser NAME``, as
vLLM's flag; :data:`AUTO_PARSERS`):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
  (Hermes 2 Pro/3, Qwen2.5, SmolLM2-style templates), any number, text around them. A
  block whose JSON does not parse stays in the content as written; an unclosed block at
  the end is still a call if its JSON is complete (the model stopped at EOS first).
- ``llama3_json``: the whole message is ``{"name": ..., "parameters": {...}}``
  (``"arguments"`` accepted too), optionally after ``<|python_tag|>``, several
  separated by ``;``. Anything else is content. Nothing can be streamed before the end
  of such a message: it is a call only if all of it parses.
- ``openai`` (gpt-oss, with ``--reasoning-parser harmony``): commentary-channel
  messages to ``functions.NAME`` (:mod:`llmctl.serve.openai.tools.harmony`).

Content is the text outside the calls, without leading and trailing whitespace
(``None`` when nothing is left). Text that may still become the start of a call is held
back while streaming, as stop strings are.

The formats that grammars force (``tool_choice: "required"`` or a named function,
:mod:`llmctl.serve.openai.tools.request`) have parsers here too: :class:`RequiredCallsParser` (a
JSON array of ``{"name", "parameters"}``) and :class:`NamedCallParser` (the arguments
object alone); their arguments stream piece by piece.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str


Event = Text | CallStart | CallArgs


class ToolCallParser(Protocol):
    def feed(self, text: str) -> list[Event]:
        ...

    def finish(self) -> list[Event]:
        ...


class _Content:
    """Content without leading/trailing whitespace, streamable: trailing whitespace is
    held until more content follows (and dropped at the end)."""

    def __init__(self) -> None:
        self.held = ""
        self.started = False

    def add(self, text: str) -> list[Event]:
        full = self.held + text
        if not self.started:
            full = full.lstrip()
        body = full.rstrip()
        self.held = full[len(body):]
        if not body:
            return []
        self.started = True
        return [Text(body)]


def _holdback(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _call(obj: Any, *arg_keys: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in arg_keys if k in obj), None)
    args = obj[key] if key else {}
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"
    skip_special_tokens = False  # <tool_call> is a special token in some tokenizers (vLLM)

    def __init__(self) -> None:
        self.pending = ""
        self.in_call = False
        self.calls = 0
        self.content = _Content()

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        events: list[Event] = []
        while True:
            if self.in_call:
                end = self.pending.find(self.END)
                if end < 0:
                    return events  # the whole block is needed to parse it
                events += self._block(self.pending[:end], closed=True)
                self.pending = self.pending[end + len(self.END):]
                self.in_call = False
            else:
                start = self.pending.find(self.START)
                if start < 0:
                    keep = _holdback(self.pending, self.START)
                    cut = len(self.pending) - keep
                    events += self.content.add(self.pending[:cut])
                    self.pending = self.pending[cut:]
                    return events
                events += self.content.add(self.pending[:start])
                self.pending = self.pending[start + len(self.START):]
                self.in_call = True

    def finish(self) -> list[Event]:
        if self.in_call:
            events = self._block(self.pending, closed=False)
        else:
            events = self.content.add(self.pending)
        self.pending = ""
        self.in_call = False
        return events

    def _block(self, body: str, closed: bool) -> list[Event]:
        try:
            call = _call(json.loads(body), "arguments", "parameters")
        except ValueError:
            call = None
        if call is None:  # not a call after all: the text stays content, as written
            return self.content.add(self.START + body + (self.END if closed else ""))
        index, self.calls = self.calls, self.calls + 1
        return [CallStart(index, call[0]), CallArgs(index, call[1])]


class Llama3JsonParser:
    TAG = "<|python_tag|>"
    skip_special_tokens = True  # the tag is special; the parser reads the text either way

    def __init__(self) -> None:
        self.pending = ""
        self.mode = "undecided"  # -> "json" (held to the end) or "text" (streamed)
        self.content = _Content()

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        if self.mode == "undecided":
            head = self.pending.lstrip()
            if head.startswith(("{", self.TAG)):
                self.mode = "json"
            elif head and not self.TAG.startswith(head):
                self.mode = "text"
        if self.mode != "text":
            return []
        text, self.pending = self.pending, ""
        return self.content.add(text)

    def finish(self) -> list[Event]:
        text, self.pending = self.pending, ""
        calls = self._calls(text) if self.mode == "json" else None
        if calls is None:
            return self.content.add(text)
        events: list[Event] = []
        for index, (name, args) in enumerate(calls):
            events += [CallStart(index, name), CallArgs(index, args)]
        return events

    @classmethod
    def _calls(cls, text: str) -> list[tuple[str, str]] | None:
        body = text.strip()
        body = body.removeprefix(cls.TAG)
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        while True:
            while pos < len(body) and body[pos].isspace():
                pos += 1
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return None
            call = _call(obj, "parameters", "arguments")
            if call is None:
                return None
            calls.append(call)
            rest = body[pos:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                return None
            pos = len(body) - len(rest) + 1


AUTO_PARSERS: dict[str, type] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}


# ``openai`` lives in its own module, which imports the events above and enters itself
# in AUTO_PARSERS on its last line (import_module: whichever of the two comes first)
importlib.import_module("llmctl.serve.openai.tools.harmony")


def auto_parser(name: str) -> type:
    try:
        return AUTO_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: "
                         f"{', '.join(AUTO_PARSERS)}") from None


class NamedCallParser:
    """The grammar forced the arguments of one known function: the text is all arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not self.started:
            self.started = True
            events.append(CallStart(0, self.name))
        if text:
            events.append(CallArgs(0, text))
        return events

    def finish(self) -> list[Event]:
        return self.feed("")


class RequiredCallsParser:
    """``[{"name": NAME, "parameters": {...}}, ...]`` as the grammar forces it, scanned
    a character at a time: each item's name is announced once its string is complete,
    and its parameters stream as they are generated (held until the name is known, should
    the output put them first).

    Depth counts open brackets outside strings: the array is depth 1, an item 2. Within
    an item the scanner expects, in turn, a key, a colon and a value; a value is
    everything from its first character to the ``,`` or ``}`` that comes back at depth 2.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.index = -1
        self.expect = "item"  # item | key | key_text | colon | value_start | value
        self.key = ""
        self.buf = ""  # the key or value being read
        self.name: str | None = None
        self.args = ""  # the current item's parameters so far
        self.args_sent = 0

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for ch in text:
            events += self._char(ch)
        return events + self._send_args()

    def finish(self) -> list[Event]:
        return self._send_args()

    def _send_args(self) -> list[Event]:
        if self.name is None or self.args_sent == len(self.args):
            return []
        piece, self.args_sent = self.args[self.args_sent:], len(self.args)
        return [CallArgs(self.index, piece)]

    def _lex(self, ch: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "[{":
            self.depth += 1
        elif ch in "]}":
            self.depth -= 1

    def _char(self, ch: str) -> list[Event]:
        depth, in_string = self.depth, self.in_string  # before this character
        self._lex(ch)
        expect = self.expect
        if expect == "item":
            if depth == 1 and ch == "{":
                self.index += 1
                self.name, self.args, self.args_sent = None, "", 0
                self.expect = "key"
            return []
        if expect == "key":
            if ch == '"':
                self.buf, self.expect = ch, "key_text"
            elif ch == "}":
                self.expect = "item"
            return []  # whitespace, commas
        if expect == "key_text":
            self.buf += ch
            if not self.in_string:  # the closing quote
                self.key, self.expect = json.loads(self.buf), "colon"
            return []
        if expect == "colon":
            if ch == ":":
                self.expect = "value_start"
            return []
        if expect == "value_start":
            if ch.isspace():
                return []
            self.buf, self.expect = "", "value"
        if depth == 2 and not in_string and ch in ",}":
            self.expect = "key" if ch == "," else "item"
            return self._value_done()
        self.buf += ch
        if self.key == "parameters":
            self.args += ch
        return []

    def _value_done(self) -> list[Event]:
        if self.key == "parameters":
            return self._send_args()  # before the next item starts over
        if self.key != "name":
            return []
        self.name = json.loads(self.buf)
        return [CallStart(self.index, self.name), *self._send_args()]
