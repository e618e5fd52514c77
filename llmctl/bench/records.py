"""The two records a benchmark passes around: what to send, and what happened."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SampleRequest:
    """One prompt of a workload. ``system`` is a shared prefix (prefix-caching workloads):
    a system message for chat endpoints, prepended to the prompt for completions."""

    prompt: str
    prompt_len: int  # tokens of system + prompt, counted with the model's tokenizer
    output_len: int  # max_tokens to ask for
    system: str | None = None
    # seconds after the run's start to send it (a replayed trace); None: the run's
    # arrival process (--request-rate, --burstiness) decides
    arrival: float | None = None
    # a multi-turn conversation's turn (llmctl.bench.conversations): the earlier (user,
    # answer) pairs it carries, its Conversation and its number from 0
    history: tuple[tuple[str, str], ...] = ()
    conversation: Any = None
    turn: int = 0


@dataclass
class RequestRecord:
    """Client-side timings of one request, in seconds. A failure is a record with
    ``error`` set, never an exception."""

    index: int
    prompt_len: int
    output_len_requested: int
    start: float | None = None  # send time, seconds since the measurement started
    scheduled: float | None = None  # when the arrival process wanted it sent (seeded)
    ttft: float | None = None  # send -> first chunk that carries text
    itl: list[float] = field(default_factory=list)  # gaps between later text chunks
    latency: float | None = None  # send -> end of the stream (E2E)
    output_tokens: int | None = None
    output_tokens_source: str = ""  # "usage" | "tokenizer" | "chunks"
    prompt_tokens_server: int | None = None  # usage.prompt_tokens when the server gives it
    text: str = ""
    error: str | None = None
    error_kind: str | None = None  # "http" | "connect" | "stream" | "timeout" | ...
    trace_id: str | None = None  # the W3C trace id its traceparent header carried (32 hex)
    turn: int | None = None  # its turn in a multi-turn conversation (from 0)

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def input_tokens(self) -> int:
        """Server usage if given (it includes a chat template), else our own count."""
        return self.prompt_tokens_server if self.prompt_tokens_server is not None \
            else self.prompt_len
