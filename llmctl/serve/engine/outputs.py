"""What the engine hands back after each step: snapshots, safe to pass between threads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from llmctl.serve.sample.sampler import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]  # all output tokens so far (a stop token id included)
    text: str  # output text so far (stop strings cut, held-back stop prefixes not shown)
    new_token_ids: list[int]  # tokens added since the previous output of this request
    text_delta: str  # text added since the previous output
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None  # per output token so far, when requested

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # For traces (llmctl.serve.api.tracing): each prefill chunk before the first token as
    # (wall time its step started, tokens computed), and each preemption's wall time.
    # Tuples shared with the Request, never copied: it replaces them, never mutates.
    prefill_chunks: tuple[tuple[float, int], ...] = ()
    preemption_times: tuple[float, ...] = ()

    @property
    def num_preemptions(self) -> int:
        return len(self.preemption_times)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    # per prompt token when requested: None for the first, then its TokenLogprobs
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # set on the final output of a request whose own work failed (finish reason "error")
    error: str | None = None
    # with error: the engine process serving it died or was restarted, not this request's
    # own fault, so the same request may succeed if sent again (HTTP 503, Retry-After)
    retryable: bool = False
    # who sent it and its class (Request.tenant / priority_class); None: not given
    tenant: str | None = None
    priority_class: str | None = None
    # an embedding request's final output: its prompt's pooled final hidden states
    # (llmctl.serve.core.pooling), not normalised; None otherwise
    embedding: list[float] | None = None

    def to_dict(self) -> dict:
        return asdict(self)
