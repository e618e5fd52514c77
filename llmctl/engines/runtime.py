"""The one primitive every runnable engine implements: extend sequences by tokens.

``Runtime.forward(states, chunks)`` appends ``chunks[i]`` to sequence ``states[i]``
(its KV cache lives in the state) and returns the logits that follow: the last
position's ``[vocab]`` row, or ``[len(chunk), vocab]`` with ``all_logits``. Prefill,
chunked prefill, decode and continuous batching are all calls of this one method; the
runtime decides what it can batch:

- decodes (one new token per sequence) run as one batched call: the sequences' caches
  are gathered into one right-padded buffer with per-row lengths, and that buffer is
  kept while the same sequences decode together (a changed membership costs one copy);
- chunks of several tokens run one sequence per call (ONNX Runtime's GroupQueryAttention
  and the compiled torch forward take a rectangular ``[batch, tokens]`` input, so a
  prefill cannot share a call with decodes the way the paged engine's flat token stream
  can). This is the limit on continuous batching for engine directories: requests join
  and leave the decode batch at any step, but a joining prompt is prefilled in its own
  call, between two decode steps.

:class:`BatchedRuntime` is that policy, written once: the split, the decode groups of at
most ``max_batch_size``, and which sequences own their cache and which are rows of the
shared decode buffer (:class:`BatchedState`, :class:`DecodeBatch`). A backend supplies
the cache arrays and the model calls (:mod:`llmctl.engines.onnx_runtime`,
:mod:`llmctl.engines.aoti_runtime`).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import numpy as np


class SeqState:
    """One sequence's cache; backends subclass it. ``length`` = tokens already cached."""

    __slots__ = ("__weakref__", "length")

    def __init__(self) -> None:
        self.length = 0


class Runtime(abc.ABC):
    vocab_size: int
    max_len: int
    max_batch_size: int | None = None
    provider: str = "cpu"

    @abc.abstractmethod
    def new_state(self) -> SeqState: ...

    @abc.abstractmethod
    def forward(self, states: list[SeqState], chunks: list[list[int]],
                all_logits: bool = False) -> list[np.ndarray]: ...

    def describe(self) -> dict[str, Any]:
        return {"provider": self.provider, "max_len": self.max_len,
                "max_batch_size": self.max_batch_size}

    def _check(self, states: list[SeqState], chunks: list[list[int]]) -> None:
        from llmctl.errors import ResourceError, UsageError

        if len(states) != len(chunks):
            raise UsageError("forward needs one chunk of tokens per sequence",
                             "pass lists of equal length")
        for state, chunk in zip(states, chunks):
            if not chunk:
                raise UsageError("a chunk has no tokens", "pass at least one token per sequence")
            if state.length + len(chunk) > self.max_len:
                raise ResourceError(
                    f"a sequence would grow to {state.length + len(chunk)} tokens; this engine "
                    f"was built for at most {self.max_len}",
                    "rebuild the engine with a larger --max-seq-len or shorten the request")
            bad = [t for t in chunk if not 0 <= t < self.vocab_size]
            if bad:
                raise UsageError(f"token ids outside [0, {self.vocab_size}): {bad[:5]}",
                                 "encode the prompt with this engine's tokenizer")


def split_work(chunks: list[list[int]]) -> tuple[list[int], list[int]]:
    """Indices of single-token chunks (batched decode) and of longer ones (one by one)."""
    decode = [i for i, c in enumerate(chunks) if len(c) == 1]
    single = [i for i, c in enumerate(chunks) if len(c) != 1]
    return decode, single


class BatchedState(SeqState):
    """A sequence whose cache is its own arrays, or row ``row`` of a :class:`DecodeBatch`."""

    __slots__ = ("batch", "row")

    def __init__(self) -> None:
        super().__init__()
        self.batch: DecodeBatch | None = None
        self.row = -1

    def detach(self) -> None:
        """Copy this row out of its shared buffer (the buffer is being replaced)."""
        if self.batch is not None:
            self._copy_out()
            self.batch, self.row = None, -1

    def join(self, batch: DecodeBatch, row: int) -> None:
        """Become row ``row`` of ``batch`` (whose buffer already holds a copy of the cache)."""
        self._drop_own()
        self.batch, self.row = batch, row

    def _copy_out(self) -> None:
        """Own a copy of this sequence's rows of ``self.batch`` (backends implement)."""
        raise NotImplementedError

    def _drop_own(self) -> None:
        """Forget the cache arrays this sequence owned (backends implement)."""
        raise NotImplementedError


class DecodeBatch:
    """A right-padded decode buffer shared by ``states`` (row i = states[i]); backends
    add the buffer itself."""

    def __init__(self, states: Sequence[BatchedState]) -> None:
        self.states = list(states)

    def holds(self, states: Sequence[BatchedState]) -> bool:
        return len(self.states) == len(states) and all(
            a is b for a, b in zip(self.states, states))


class BatchedRuntime(Runtime):
    """:meth:`forward` for a backend with a per-sequence call (:meth:`_prefill`) and a
    batched single-token call over a shared buffer (:meth:`_decode`).

    The decode buffer is kept while the same sequences decode together in the same order;
    any other group gets a new one (:meth:`_gather`), and a sequence of the old buffer
    that is not in the new one copies its rows out first.
    """

    _batch: DecodeBatch | None = None

    def forward(self, states: list[BatchedState], chunks: list[list[int]],
                all_logits: bool = False) -> list[np.ndarray]:
        self._check(states, chunks)
        out: list[np.ndarray | None] = [None] * len(states)
        decode, single = split_work(chunks)
        for i in single:
            if states[i].batch is not None:
                self._leave_batch(states[i])
            out[i] = self._prefill(states[i], chunks[i], all_logits)
        step = self.max_batch_size or len(decode) or 1
        for lo in range(0, len(decode), step):
            part = decode[lo:lo + step]
            group = [states[i] for i in part]
            rows = self._decode(self._batch_for(group), group, [chunks[i][0] for i in part])
            for j, i in enumerate(part):
                out[i] = rows[j:j + 1] if all_logits else rows[j]
        return out  # type: ignore[return-value]

    @abc.abstractmethod
    def _prefill(self, state: BatchedState, chunk: list[int], all_logits: bool) -> np.ndarray:
        """Run ``chunk`` for one sequence that owns its cache; its logits (float32)."""

    @abc.abstractmethod
    def _gather(self, states: list[BatchedState]) -> DecodeBatch:
        """A new buffer holding a copy of each state's cache, row i = states[i]."""

    @abc.abstractmethod
    def _decode(self, batch: DecodeBatch, states: list[BatchedState],
                tokens: list[int]) -> np.ndarray:
        """One token per row of ``batch``; ``[B, vocab]`` float32 logits. Advances lengths."""

    def _leave_batch(self, state: BatchedState) -> None:
        batch = state.batch
        if batch is not None and batch is self._batch:
            for s in batch.states:
                s.detach()
            self._batch = None
        else:
            state.detach()

    def _batch_for(self, states: list[BatchedState]) -> DecodeBatch:
        old = self._batch
        if old is not None and old.holds(states):
            return old
        batch = self._gather(states)
        if old is not None:  # rows of the old buffer that are not moving lose their home
            keep = {id(s) for s in states}
            for s in old.states:
                if id(s) not in keep and s.batch is old:
                    s.detach()
        for row, s in enumerate(states):
            s.join(batch, row)
        self._batch = batch
        return batch
