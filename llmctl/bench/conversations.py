"""Multi-turn conversations: each turn's request carries the whole history (every earlier
user message and the answer the server actually gave), so a server's prefix cache can
serve all but the newest turn, and what is measured is what a chat user sees per turn.

A conversation's first turn is sent by the run's arrival process (``--request-rate``,
``--max-concurrency``); each later turn ``think_time`` seconds after the answer to the one
before it (``--think-time``), and only if that answer came back: a failed turn ends its
conversation. The report gives TTFT per turn number (:func:`ttft_by_turn`): with a
working prefix cache it stays flat as the history grows; without one it climbs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from llmctl.bench.records import RequestRecord, SampleRequest


@dataclass(frozen=True, eq=False)
class Conversation:
    """The user side of one conversation: each turn's message (``prompt``, its tokens in
    ``prompt_len``) and the ``max_tokens`` to ask for (``output_len``)."""

    turns: tuple[SampleRequest, ...]
    think_time: float = 0.0

    def first(self) -> SampleRequest:
        return replace(self.turns[0], conversation=self, turn=0)

    def follow_up(self, sample: SampleRequest, record: RequestRecord) -> SampleRequest | None:
        """The turn after ``sample`` once ``record`` answered it, or None (the last turn,
        or a failed one). Its prompt length counts the history as the server saw it
        (its usage where it reported one) plus the answer and the new message."""
        nxt = sample.turn + 1
        if nxt >= len(self.turns) or not record.success:
            return None
        message = self.turns[nxt]
        seen = record.input_tokens + (record.output_tokens or 0)
        return replace(message, prompt_len=seen + message.prompt_len, conversation=self,
                       turn=nxt, history=(*sample.history, (sample.prompt, record.text)))

    @property
    def requests(self) -> int:
        return len(self.turns)


def chat_messages(sample: SampleRequest) -> list[dict]:
    """The chat body's messages: the system prompt, the history in order, the new turn."""
    messages = [{"role": "system", "content": sample.system}] if sample.system else []
    for user, assistant in sample.history:
        messages += [{"role": "user", "content": user},
                     {"role": "assistant", "content": assistant}]
    return [*messages, {"role": "user", "content": sample.prompt}]


def ttft_by_turn(records: Sequence[RequestRecord]) -> dict[str, dict[str, float]]:
    """Per turn number (from 1): mean, median and p90 TTFT in ms over the turns answered."""
    out: dict[str, dict[str, float]] = {}
    turns = sorted({r.turn for r in records if r.turn is not None})
    for turn in turns:
        ttfts = [r.ttft * 1000 for r in records
                 if r.turn == turn and r.success and r.ttft is not None]
        if ttfts:
            out[str(turn + 1)] = {"n": len(ttfts), "mean_ms": float(np.mean(ttfts)),
                                  "median_ms": float(np.median(ttfts)),
                                  "p90_ms": float(np.percentile(ttfts, 90))}
    return out
