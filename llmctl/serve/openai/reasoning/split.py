"""One choice's output split at its thinking tags into reasoning and content.

Reasoning models (Qwen3, DeepSeek-R1 distills) think inside ``<think>...</think>``
before they answer. :class:`ThinkingSplitter` follows one choice's generated text as it
comes (a stream's deltas, or a whole response's updates one after another: the same
calls, so both give the same split) and says which part of each piece is reasoning and
which is content.

Where the tokenizer has each tag as one token (Qwen3, DeepSeek-R1), the split follows the
token ids: only the tag *token* switches, so a model that writes the characters
``</think>`` inside its answer is not cut there, and a tag whose text is not decoded (a
special token skipped by the detokenizer) still switches. Otherwise the split follows
the text, and a piece that ends in what could be the beginning of a tag (``"</thi"``) is
held back until the next piece says whether it is one, so a tag cut across two stream
chunks is still found.

Phases: ``BEFORE`` (no thinking yet; a start tag opens it, as Qwen3 does when thinking
is on), ``THINKING`` (everything is reasoning until the end tag; a stray start tag is
dropped, as DeepSeek-R1 repeats the one its template opened) and ``ANSWER`` (everything
is content, tags included: one thinking block per answer).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class Phase(enum.Enum):
    BEFORE = "before"
    THINKING = "thinking"
    ANSWER = "answer"


@dataclass(frozen=True)
class ThinkTags:
    """The tags and, where the tokenizer has each as a single token, their ids."""

    start: str = "<think>"
    end: str = "</think>"
    start_id: int | None = None
    end_id: int | None = None

    @property
    def by_id(self) -> bool:
        return self.start_id is not None and self.end_id is not None

    @classmethod
    def of(cls, tokenizer, start: str = "<think>", end: str = "</think>") -> ThinkTags:
        """The tags as ``tokenizer`` writes them: ids only when the text encodes to
        exactly one token (an added token), since only then is "the tag" one event."""
        def single(tag: str) -> int | None:
            try:
                ids = tokenizer(tag, add_special_tokens=False)["input_ids"]
            except Exception:  # noqa: BLE001 - a tokenizer that cannot say: split on text
                return None
            return ids[0] if len(ids) == 1 else None

        start_id, end_id = single(start), single(end)
        if start_id is None or end_id is None:  # both or neither: one way of splitting
            start_id = end_id = None
        return cls(start, end, start_id, end_id)


@dataclass
class Split:
    """What one piece of output adds: its reasoning part, its content part, and how
    many of its tokens were reasoning (the tags themselves are not counted)."""

    reasoning: str = ""
    content: str = ""
    reasoning_tokens: int = 0


def _held_suffix(text: str, tags: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``tags``."""
    for size in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        tail = text[-size:]
        if any(t.startswith(tail) for t in tags):
            return size
    return 0


class ThinkingSplitter:
    """One choice's reasoning/content split (see the module's docstring)."""

    def __init__(self, tags: ThinkTags, phase: Phase,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self.tags = tags
        self.phase = phase
        self.decode = decode  # by id: the text of tokens whose tag text was not decoded
        self.held = ""  # by text: what may begin a tag
        self.held_tokens = 0  # the tokens of ``held`` (reasoning if it turns out text)

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> Split:
        """The split of the next piece of output (its text and the tokens it came from)."""
        if self.tags.by_id:
            return self._feed_ids(text, list(token_ids))
        return self._feed_text(text, len(token_ids))

    def finish(self) -> Split:
        """The held text, released once the output is complete (not a tag after all)."""
        out = Split()
        held, self.held = self.held, ""
        self._emit(out, held)
        if self.phase is Phase.THINKING:
            out.reasoning_tokens = self.held_tokens
        self.held_tokens = 0
        return out

    def _emit(self, out: Split, text: str) -> None:
        if self.phase is Phase.THINKING:
            out.reasoning += text
        else:
            out.content += text

    def _switch(self, is_start: bool) -> None:
        """A tag in BEFORE or THINKING (ANSWER takes tags as text)."""
        if is_start:
            if self.phase is Phase.BEFORE:
                self.phase = Phase.THINKING
        else:  # an end tag ends thinking; with none begun it is dropped all the same
            self.phase = Phase.ANSWER

    def _feed_ids(self, text: str, ids: list[int]) -> Split:
        out = Split()
        tags = self.tags
        cursor = prev = 0
        for k, token in enumerate(ids):
            if self.phase is Phase.ANSWER:
                break
            if token not in (tags.start_id, tags.end_id):
                continue
            tag = tags.start if token == tags.start_id else tags.end
            at = text.find(tag, cursor)
            if at >= 0:
                after = at + len(tag)
            else:  # the tag's text was not decoded: its place is where its tokens end
                before = self.decode(ids[prev:k]) if self.decode and k > prev else ""
                at = after = min(len(text), cursor + len(before))
            self._emit(out, text[cursor:at])
            if self.phase is Phase.THINKING:
                out.reasoning_tokens += k - prev
            self._switch(token == tags.start_id)
            cursor, prev = after, k + 1
        self._emit(out, text[cursor:])
        if self.phase is Phase.THINKING:
            out.reasoning_tokens += len(ids) - prev
        return out

    def _feed_text(self, text: str, num_tokens: int) -> Split:
        out = Split()
        thinking = self.phase is Phase.THINKING
        buf, self.held = self.held + text, ""
        tagged = False  # a tag completed in this piece
        while buf and self.phase is not Phase.ANSWER:
            tags = (self.tags.start, self.tags.end)
            found = [(buf.find(t), t) for t in tags if buf.find(t) >= 0]
            if not found:
                keep = _held_suffix(buf, tags)
                self._emit(out, buf[:len(buf) - keep])
                self.held, buf = buf[len(buf) - keep:], ""
                break
            at, tag = min(found)
            self._emit(out, buf[:at])
            self._switch(tag == self.tags.start)
            buf, tagged = buf[at + len(tag):], True
        self._emit(out, buf)
        out.reasoning_tokens = self._count_text(thinking, tagged, num_tokens, out)
        return out

    def _count_text(self, thinking: bool, tagged: bool, num_tokens: int, out: Split) -> int:
        """Reasoning tokens by text, where a piece's tokens cannot be told apart: a piece
        of thinking counts whole; one held whole waits to learn whether it is a tag's
        (not counted) or reasoning; one that releases reasoning and holds its end counts
        all but its last token (the one that may begin a tag); the piece that completes
        the end tag counts all but its last (the tag's)."""
        held, self.held_tokens = self.held_tokens, 0
        if not thinking:
            return 0
        if tagged:
            return max(num_tokens - 1, 0) if out.reasoning else 0
        if not self.held:
            return held + num_tokens
        if not out.reasoning:
            self.held_tokens = held + num_tokens
            return 0
        self.held_tokens = min(num_tokens, 1)
        return held + num_tokens - self.held_tokens


def split_whole(splitter: ThinkingSplitter, text: str,
                token_ids: Sequence[int] = ()) -> tuple[str, str]:
    """(reasoning, content) of a complete output."""
    a, b = splitter.feed(text, token_ids), splitter.finish()
    return a.reasoning + b.reasoning, a.content + b.content
