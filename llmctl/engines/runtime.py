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
"""

from __future__ import annotations

import abc
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
