"""Request and sequence state.

A :class:`Request` is what a user submitted (one prompt, ``n`` completions); each
completion is a :class:`Sequence` with an explicit state machine::

    WAITING ──> RUNNING ──> FINISHED_STOPPED | FINISHED_LENGTH | FINISHED_ABORTED
       │          │  ^
       │          v  │
       │        PREEMPTED ─────> FINISHED_ABORTED
       └──────────────────────> FINISHED_ABORTED

    and from WAITING, RUNNING or PREEMPTED: ──> FINISHED_ERROR

A preempted sequence lost its KV blocks (preemption by recompute): when it runs again it
recomputes prompt + output so far and continues from there, so no token is lost or
produced twice. FINISHED_ERROR ends every sequence of a request whose own work failed
(``Request.error`` says why; finish reason "error"). Any other transition raises
:class:`SequenceStateError`.

Token bookkeeping: ``token_ids`` is prompt + output; the KV of the first
``num_computed_tokens`` of them is in the cache. A step computes the next
``num_new_tokens`` (a prompt chunk, or the last sampled token plus draft tokens), and
a token is sampled when the sequence has caught up with its own tokens.

Structured output: each sequence owns its constraint state (a
:class:`~llmctl.serve.core.constraints.LogitsConstraint` from the request's factory), fed
its output tokens once, as they are appended; recomputing after a preemption does not
touch it. Prompt log-probs belong to the request (its ``n`` sequences share the prompt)
and are collected position by position, so a recomputed chunk is not counted twice; an
embedding request's pooled hidden states likewise (``Request.pooled``).
"""

from __future__ import annotations

import enum
import itertools

from llmctl.serve.core.pooling import PooledHidden
from llmctl.serve.core.sampling_params import SamplingParams


class SequenceStateError(RuntimeError):
    """An engine bug: a sequence was moved along a transition that does not exist."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}

_TRANSITIONS: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    SequenceStatus.WAITING: frozenset({SequenceStatus.RUNNING, SequenceStatus.FINISHED_ABORTED,
                                       SequenceStatus.FINISHED_ERROR}),
    SequenceStatus.RUNNING: frozenset({SequenceStatus.PREEMPTED, SequenceStatus.FINISHED_STOPPED,
                                       SequenceStatus.FINISHED_LENGTH,
                                       SequenceStatus.FINISHED_ABORTED,
                                       SequenceStatus.FINISHED_ERROR}),
    SequenceStatus.PREEMPTED: frozenset({SequenceStatus.RUNNING,
                                         SequenceStatus.FINISHED_ABORTED,
                                         SequenceStatus.FINISHED_ERROR}),
    SequenceStatus.FINISHED_STOPPED: frozenset(),
    SequenceStatus.FINISHED_LENGTH: frozenset(),
    SequenceStatus.FINISHED_ABORTED: frozenset(),
    SequenceStatus.FINISHED_ERROR: frozenset(),
}

_seq_ids = itertools.count()


class Sequence:
    """One completion: its tokens, KV bookkeeping and state."""

    __slots__ = ("seq_id", "request", "index", "token_ids", "num_prompt_tokens",
                 "num_computed_tokens", "block_table", "status", "spec_token_ids",
                 "num_cached_tokens", "num_hashed_blocks", "chain_hash", "logprobs", "detok",
                 "first_token_time", "generator", "num_emitted",
                 "pending_fork", "constraint", "no_drafts", "_stop_reason")

    def __init__(self, request: Request, index: int, token_ids: list[int]) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.spec_token_ids: list[int] = []  # draft tokens proposed for the next step
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.num_hashed_blocks = 0  # leading blocks registered in the prefix cache
        self.chain_hash = b""  # the prefix-cache hash of the last of them (b"": none)
        self.logprobs: list[dict] = []
        self.detok = None  # the IncrementalDetokenizer, attached by the engine
        self.first_token_time: float | None = None
        self.generator = None  # torch.Generator of a seeded request (seed + index)
        self.num_emitted = 0  # output tokens already reported in a RequestOutput
        # the first sequence of an n > 1 request forks its siblings after its prompt
        self.pending_fork = request.params.n - 1 if index == 0 else 0
        factory = request.params.logits_constraint
        self.constraint = factory.new_constraint() if factory is not None else None
        if self.constraint is not None:  # a fork after tokens were sampled: catch up
            for token in token_ids[self.num_prompt_tokens:]:
                self.constraint.accept(token)
        self.no_drafts = False  # set when proposing drafts for it failed: decode without
        self._stop_reason: str | int | None = None

    # --- state ---------------------------------------------------------------------
    def transition(self, new: SequenceStatus) -> None:
        if new not in _TRANSITIONS[self.status]:
            raise SequenceStateError(
                f"sequence {self.seq_id} of request {self.request.request_id!r}: "
                f"illegal transition {self.status.name} -> {new.name}")
        self.status = new

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    # --- tokens ----------------------------------------------------------------------
    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet (draft tokens not included)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_uncomputed_tokens > 1

    def sort_key(self) -> tuple:
        """Scheduling order: lower priority value first, then first come, first served."""
        req = self.request
        return (req.priority, req.arrival_time, req.serial, self.index)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request.request_id!r}, "
                f"{self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")


_request_serials = itertools.count()


class Request:
    """A submitted prompt with its parameters and the ``n`` sequences it grows into."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "priority",
                 "arrival_time", "serial", "seqs", "first_scheduled_time", "finish_time",
                 "eos_token_ids", "prompt_logprobs", "error", "tenant", "priority_class",
                 "deadline", "prefill_chunks", "preemption_times", "lora", "pooled")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 *, prompt: str | None, priority: int, arrival_time: float,
                 eos_token_ids: frozenset[int], tenant: str | None = None,
                 priority_class: str | None = None, deadline: float | None = None,
                 lora=None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.arrival_time = arrival_time
        self.serial = next(_request_serials)
        self.first_scheduled_time: float | None = None
        self.finish_time: float | None = None
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.seqs: list[Sequence] = [Sequence(self, 0, list(prompt_token_ids))]
        # entry i: log-prob of prompt token i given tokens < i (TokenLogprobs); the first
        # token has no context, so entry 0 is None
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None \
            else None
        self.error: str | None = None  # why its own work failed; it ends with "error"
        # Who sent it (the API key's tenant), its class (e.g. "interactive", "batch") and
        # the wall time (time.time()) by which it must finish; None: not given.
        self.tenant = tenant
        self.priority_class = priority_class
        self.deadline = deadline
        # For traces: (step start wall time, tokens) per prefill chunk before the first
        # token, and the wall time of each preemption. Tuples, replaced on each change, so
        # outputs can share them across threads without a copy.
        self.prefill_chunks: tuple[tuple[float, int], ...] = ()
        self.preemption_times: tuple[float, ...] = ()
        # the LoRA adapter its tokens run with (llmctl.serve.lora.adapter.LoRAAdapter),
        # held here so an unload lets it finish; None: the base model
        self.lora = lora
        # an embedding request (params.pooling): its prompt's pooled hidden states
        self.pooled = PooledHidden(params.pooling, len(self.prompt_token_ids)) \
            if params.pooling is not None else None

    @property
    def needs_prompt_logits(self) -> bool:
        """True until every prompt position's log-probs are collected."""
        return self.prompt_logprobs is not None and \
            len(self.prompt_logprobs) < len(self.prompt_token_ids)

    def add_prompt_logprobs(self, first: int, entries: list) -> None:
        """Entries for prompt tokens ``first, first + 1, ...``; ones already held (a chunk
        recomputed after preemption) are skipped."""
        have = len(self.prompt_logprobs)
        if first > have:
            raise RuntimeError(f"request {self.request_id!r}: prompt log-probs from token "
                               f"{first}, but only {have} collected")
        self.prompt_logprobs.extend(entries[have - first:])

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs) and not self.seqs[0].pending_fork

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, n={self.params.n}, seqs={self.seqs})"
