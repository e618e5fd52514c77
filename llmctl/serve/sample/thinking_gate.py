"""A constraint that starts after the thinking: structured output for reasoning models.

A reasoning model thinks (``<think>...</think>``) before it answers; a
``response_format`` or tool grammar is about the answer, and masking the thinking with
it would force the model to answer at once, or worse, make it write JSON as thoughts.
:class:`ThinkingGate` wraps the answer's :class:`~llmctl.serve.core.constraints.
ConstraintFactory`: each sequence's constraint masks nothing while the sequence thinks
and hands over to the grammar from the token after the end-of-thinking token.

Before any thinking (a model that opens ``<think>`` itself, as Qwen3 does) the first
token may be the grammar's or the start token: the mask is the grammar's with the start
token let through, and that token decides which way the sequence goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_BEFORE, _THINKING, _ANSWER = "before", "thinking", "answer"


@dataclass
class ThinkingGate:
    """Per request (a ConstraintFactory); pickles as its parts for engine processes."""

    inner: Any  # the answer's ConstraintFactory
    start_id: int
    end_id: int
    thinking: bool  # the output starts inside the thinking (the prompt opened it)

    def new_constraint(self) -> GatedConstraint:
        return GatedConstraint(self.inner.new_constraint(), self.start_id, self.end_id,
                               _THINKING if self.thinking else _BEFORE)


class GatedConstraint:
    """One sequence: nothing masked while thinking, the answer's constraint after."""

    def __init__(self, inner: Any, start_id: int, end_id: int, phase: str) -> None:
        self.inner = inner
        self.start_id = start_id
        self.end_id = end_id
        self.phase = phase

    def mask(self, logits: torch.Tensor) -> None:
        if self.phase == _THINKING:
            return
        if self.phase == _BEFORE and self.start_id < logits.shape[-1]:
            start = logits[self.start_id].clone()
            self.inner.mask(logits)
            logits[self.start_id] = start
            return
        self.inner.mask(logits)

    def accept(self, token_id: int) -> None:
        if self.phase == _THINKING:
            if token_id == self.end_id:
                self.phase = _ANSWER
        elif self.phase == _BEFORE and token_id == self.start_id:
            self.phase = _THINKING
        else:
            self.phase = _ANSWER
            self.inner.accept(token_id)

    def is_finished(self) -> bool:
        return self.phase == _ANSWER and self.inner.is_finished()
