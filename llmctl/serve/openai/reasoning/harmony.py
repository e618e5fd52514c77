"""gpt-oss's chat format "harmony" (``--reasoning-parser harmony``; vLLM names its parser
``openai_gptoss``, which is accepted too).

The prompt ends with ``<|start|>assistant``; the model writes messages, each a header
and a body::

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

The header names the channel (``<|channel|>analysis``), maybe a recipient
(``to=functions.NAME``, before or after the channel) and a content type (``json``,
maybe after ``<|constrain|>``); ``<|message|>`` opens the body, which ``<|end|>``,
``<|return|>`` or ``<|call|>`` closes (the last two end the generation). What each body is:

- ``analysis``: reasoning;
- ``final``, and ``commentary`` without a recipient (a preamble, as vLLM returns it):
  content;
- a message with a recipient (a tool call on the commentary channel): content in its
  harmony form, ``<|channel|>commentary to=functions.NAME<|message|>ARGS<|call|>``,
  which ``--tool-call-parser openai`` turns into ``tool_calls`` (without it the call
  stays in the content as written, as other models' calls do).

Headers are neither. The split follows the token ids (the special tokens are found by
their text in the tokenizer's added vocabulary) and each body is decoded from its own
tokens, so a detokenizer that skips special tokens changes nothing, and a stream's
chunks give the same split as the whole output. A body cut short (``max_tokens``) keeps
what was written; a header cut short writes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from llmctl.errors import UsageError
from llmctl.serve.openai.reasoning.split import Phase, Split

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
SPECIALS = (START, END, MESSAGE, CHANNEL, RETURN, CALL, CONSTRAIN)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(frozen=True)
class HarmonyTokens:
    """The ids of harmony's special tokens in one tokenizer."""

    ids: dict[str, int]

    @classmethod
    def of(cls, tokenizer) -> HarmonyTokens:
        """Found by text in ``tokenizer``'s added vocabulary; a UsageError naming the
        missing ones otherwise (``--reasoning-parser harmony`` is for gpt-oss)."""
        try:
            added = dict(tokenizer.get_added_vocab())
        except Exception:  # noqa: BLE001 - a tokenizer without added tokens has none
            added = {}
        missing = [t for t in SPECIALS if t not in added]
        if missing:
            raise UsageError(f"--reasoning-parser harmony needs gpt-oss's harmony tokens; "
                             f"this tokenizer lacks {', '.join(missing)}",
                             "use it with a gpt-oss model, or another --reasoning-parser")
        return cls({t: added[t] for t in SPECIALS})

    def __getitem__(self, text: str) -> int:
        return self.ids[text]

    @property
    def names(self) -> dict[int, str]:
        return {i: t for t, i in self.ids.items()}


class _BodyDecoder:
    """One body's text from its tokens, incrementally: each step decodes a short window
    twice and emits the difference (a character split over tokens waits for its end)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        after = self.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """What is still held (an incomplete character at the end of the output)."""
        if self.read == len(self.ids):
            return ""
        before = self.decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        after = self.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


@dataclass
class Header:
    """A message's header as written: what it says about the body."""

    channel: str | None = None
    recipient: str | None = None

    @classmethod
    def parse(cls, text: str) -> Header:
        """``text``: the header with its special tokens as text (after ``<|start|>``)."""
        channel = None
        if CHANNEL in text:
            after = text.split(CHANNEL, 1)[1].split(CONSTRAIN, 1)[0].split()
            channel = after[0] if after else ""
        found = _RECIPIENT.search(text)
        return cls(channel, found.group(1) if found else None)

    @property
    def kind(self) -> str:
        """reasoning | content | call"""
        if self.recipient is not None:
            return "call"
        return "reasoning" if self.channel == "analysis" else "content"


class HarmonyMessages:
    """Token ids in, message events out: the state both the splitter and the grammar
    gate follow. Phases: ``header`` (reading one, its ids kept) and ``body``."""

    def __init__(self, tokens: HarmonyTokens) -> None:
        self.tokens = tokens
        self.names = tokens.names
        self.in_body = False
        self.header_ids: list[int] = []

    def step(self, token: int) -> tuple[str, Any]:
        """What ``token`` is: ("open", header ids) a body begins; ("body", token) a
        body's token; ("close", the end token's text) a body ends; ("header", token)."""
        name = self.names.get(token)
        if self.in_body:
            if name is None or name in (MESSAGE, CONSTRAIN):
                return "body", token
            self.in_body = False  # an end token, or a new header the model began at once
            self.header_ids = [] if name in (START, END, RETURN, CALL) else [token]
            return "close", name
        if name == MESSAGE:
            self.in_body = True
            header, self.header_ids = self.header_ids, []
            return "open", header
        if name in (START, END, RETURN, CALL):  # a new message (or an empty one closed)
            self.header_ids = []
        else:
            self.header_ids.append(token)
        return "header", token


class HarmonySplitter:
    """One choice's reasoning/content split of harmony messages; the same calls as
    :class:`~llmctl.serve.openai.reasoning.split.ThinkingSplitter` (``feed`` each
    update, ``finish`` at the end). The update's text is not read: each body is decoded
    from its own tokens."""

    def __init__(self, parser: HarmonyReasoningParser, messages: HarmonyMessages,
                 header: Header | None) -> None:
        self.parser = parser
        self.messages = messages
        self.header = header  # the open body's header; None: between bodies
        self.body = _BodyDecoder(parser.decode_body)

    @property
    def phase(self) -> Phase:
        if self.header is None:
            return Phase.BEFORE
        return Phase.THINKING if self.header.kind == "reasoning" else Phase.ANSWER

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> Split:
        out = Split()
        for token in token_ids:
            event, value = self.messages.step(token)
            if event == "body":
                self._emit(out, self.body.add(value))
                if self.header is not None and self.header.kind == "reasoning":
                    out.reasoning_tokens += 1
            elif event == "open":
                self.header = self.parser.header(value)
                self.body = _BodyDecoder(self.parser.decode_body)
                if self.header.kind == "call":
                    out.content += (f"{CHANNEL}{self.header.channel or 'commentary'} "
                                    f"to={self.header.recipient}{MESSAGE}")
            elif event == "close":
                self._emit(out, self.body.flush())
                if self.header is not None and self.header.kind == "call":
                    out.content += CALL
                self.header = None
        return out

    def finish(self) -> Split:
        out = Split()
        self._emit(out, self.body.flush())
        return out

    def _emit(self, out: Split, text: str) -> None:
        if not text or self.header is None:
            return
        if self.header.kind == "reasoning":
            out.reasoning += text
        else:
            out.content += text


class HarmonyReasoningParser:
    """``--reasoning-parser harmony``: the tokens as this tokenizer has them."""

    name: ClassVar[str] = "harmony"

    def __init__(self, tokenizer) -> None:
        from llmctl.serve.engine.detokenizer import fast_decode

        self.tokenizer = tokenizer
        self.tokens = HarmonyTokens.of(tokenizer)
        self._decode = fast_decode(tokenizer)

    def decode_body(self, ids: list[int]) -> str:
        return self._decode(ids, skip_special_tokens=True)

    def header(self, ids: Sequence[int]) -> Header:
        """The header of these ids (the special ones as their text)."""
        names, parts, run = self.tokens.names, [], []
        for token in ids:
            if token in names:
                if run:
                    parts.append(self._decode(run, skip_special_tokens=True))
                parts.append(names[token])
                run = []
            else:
                run.append(token)
        if run:
            parts.append(self._decode(run, skip_special_tokens=True))
        return Header.parse("".join(parts))

    def messages_after(self, prompt_ids: Sequence[int]) -> tuple[HarmonyMessages, Header | None]:
        """The message state the prompt leaves the output in: from its last
        ``<|start|>`` (``<|start|>assistant``: a header is being written)."""
        messages = HarmonyMessages(self.tokens)
        start = self.tokens[START]
        last = max((i for i, t in enumerate(prompt_ids) if t == start), default=None)
        header = None
        for token in prompt_ids[last:] if last is not None else ():
            event, value = messages.step(token)
            if event == "open":
                header = self.header(value)
            elif event == "close":
                header = None
        return messages, header

    def plan(self, prompt_ids: Sequence[int]) -> HarmonyPlan:
        return HarmonyPlan(self, list(prompt_ids[-64:]))

    def final_ids(self) -> list[int]:
        """The tokens of the channel name ``final`` (the grammar gate compares them)."""
        return list(self.tokenizer("final", add_special_tokens=False)["input_ids"])


class OpenAIGptOssReasoningParser(HarmonyReasoningParser):
    """vLLM's name for the same parser."""

    name: ClassVar[str] = "openai_gptoss"


@dataclass
class HarmonyPlan:
    """One chat request's harmony reading (a ReasoningPlan's calls)."""

    parser: HarmonyReasoningParser
    prompt_tail: list[int] = field(default_factory=list)

    @property
    def phase(self) -> Phase:
        _, header = self.parser.messages_after(self.prompt_tail)
        return HarmonySplitter(self.parser, HarmonyMessages(self.parser.tokens), header).phase

    def new_choice(self) -> HarmonySplitter:
        messages, header = self.parser.messages_after(self.prompt_tail)
        return HarmonySplitter(self.parser, messages, header)

    def gate(self, constraint: Any) -> Any:
        """``constraint`` (the answer's grammar) held off until the final channel's body
        begins: analysis and commentary are free."""
        messages, header = self.parser.messages_after(self.prompt_tail)
        if header is not None and header.channel == "final":
            return constraint
        return HarmonyGate(constraint, dict(self.parser.tokens.ids),
                           tuple(self.parser.final_ids()), list(messages.header_ids),
                           messages.in_body)


def _is_final(header_ids: Sequence[int], channel_id: int, constrain_id: int,
              final: tuple[int, ...]) -> bool:
    """Whether a header's channel (its tokens after ``<|channel|>``) is ``final``."""
    if channel_id not in header_ids:
        return False
    at = len(header_ids) - 1 - list(reversed(header_ids)).index(channel_id)
    channel = list(header_ids[at + 1:])
    if constrain_id in channel:
        channel = channel[:channel.index(constrain_id)]
    return tuple(channel[:len(final)]) == final


@dataclass
class HarmonyGate:
    """A ConstraintFactory: the answer's grammar from the final channel's first body
    token on, nothing masked before (analysis, commentary). Pickles as its parts."""

    inner: Any
    ids: dict[str, int]
    final: tuple[int, ...]  # the tokens of "final"
    header_ids: list[int]  # where the prompt left the header
    in_body: bool

    def new_constraint(self) -> HarmonyGatedConstraint:
        messages = HarmonyMessages(HarmonyTokens(self.ids))
        messages.header_ids, messages.in_body = list(self.header_ids), self.in_body
        return HarmonyGatedConstraint(self.inner.new_constraint(), messages, self.final)


class HarmonyGatedConstraint:
    """One sequence: free until ``<|channel|>final...<|message|>``, the grammar after."""

    def __init__(self, inner: Any, messages: HarmonyMessages, final: tuple[int, ...]) -> None:
        self.inner = inner
        self.messages = messages
        self.final = final
        self.answering = False

    def mask(self, logits) -> None:
        if self.answering:
            self.inner.mask(logits)

    def accept(self, token_id: int) -> None:
        if self.answering:
            self.inner.accept(token_id)
            return
        event, value = self.messages.step(token_id)
        if event == "open":
            tokens = self.messages.tokens
            self.answering = _is_final(value, tokens[CHANNEL], tokens[CONSTRAIN], self.final)

    def is_finished(self) -> bool:
        return self.answering and self.inner.is_finished()
