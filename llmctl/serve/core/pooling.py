"""An embedding request's pooled hidden states, collected as its prompt is computed.

A request whose ``SamplingParams.pooling`` is set samples nothing: the runner hands the
engine the final hidden states (after the model's final norm: what transformers'
``AutoModel(...)(...).last_hidden_state`` holds) of the prompt positions it needs, every
position for ``mean``, the prompt's last for ``last``, and they are pooled here. A prompt
may take several steps (chunked prefill) and a preempted one recomputes what it had
computed, so positions are counted and none is summed twice. The sum is float32 whatever
the model computes in. Normalising and truncating (``dimensions``) are the API's
(:mod:`llmctl.serve.openai.embeddings`): the engine returns the pooled vector as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

POOLING_TYPES = ("last", "mean")


class PooledHidden:
    """One request's pooling: ``add`` each step's rows, ``vector`` once ``complete``."""

    __slots__ = ("count", "kind", "last", "num_tokens", "total")

    def __init__(self, kind: str, num_tokens: int) -> None:
        if kind not in POOLING_TYPES:
            raise ValueError(f"unknown pooling {kind!r}; one of {', '.join(POOLING_TYPES)}")
        self.kind = kind
        self.num_tokens = num_tokens  # the prompt's length
        self.count = 0  # mean: positions 0 .. count - 1 are in ``total``
        self.total: torch.Tensor | None = None
        self.last: torch.Tensor | None = None

    @property
    def every_position(self) -> bool:
        """Every prompt position is read, so none may come from the prefix cache (a
        cached block has K/V, not hidden states); ``last`` reads only the one position
        the engine always computes."""
        return self.kind == "mean"

    def add(self, first: int, hidden: torch.Tensor) -> None:
        """Hidden states ``[rows, hidden]`` of prompt positions ``first, first + 1, ...``;
        positions already pooled (recomputed after a preemption) are skipped."""
        end = first + hidden.shape[0]
        if self.kind == "last":
            if end == self.num_tokens:
                self.last = hidden[-1].float()
            return
        if first > self.count:
            raise RuntimeError(f"pooling rows from position {first}, but only {self.count} "
                               "positions pooled")
        rows = hidden[self.count - first:].float()
        if rows.shape[0]:
            part = rows.sum(dim=0)
            self.total = part if self.total is None else self.total + part
            self.count = end

    @property
    def complete(self) -> bool:
        return self.last is not None if self.kind == "last" else self.count == self.num_tokens

    def vector(self) -> list[float]:
        """The pooled vector (float32 values); raises until :attr:`complete`."""
        if not self.complete:
            raise RuntimeError("the prompt is not fully computed yet")
        pooled = self.last if self.kind == "last" else self.total / self.count
        return pooled.tolist()
