"""Constraints on what a sequence may generate next (structured output), as the engine sees them.

A request carries a :class:`ConstraintFactory` (built by the HTTP layer, e.g. from a
JSON schema by :mod:`llmctl.serve.sample.grammar`); every sequence of the request gets its
own :class:`LogitsConstraint` from it, so the ``n`` completions of one prompt walk the
grammar independently. Per step the engine:

1. ``mask(row)``: sets every token the constraint forbids to ``-inf`` in the raw logits
   row, before penalties, temperature, top-k/p and the greedy argmax, so whatever is
   drawn is allowed;
2. ``accept(token)``: after the token is appended to the sequence's output;
3. ``is_finished()``: when the constraint can take nothing more (a complete JSON value),
   the sequence ends with finish reason "stop" even if EOS is ignored.

The constraint's state follows the sequence's *output tokens*, not forward passes: a
sequence preempted by recompute re-runs its prompt and output through the model, but
those tokens were accepted once, when they were sampled, and are not fed again.

The engine knows only this protocol (no grammar library imports); the masks are
applied by :func:`llmctl.serve.sample.logits_process.apply_constraints`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class LogitsConstraint(Protocol):
    """One sequence's constraint state."""

    def mask(self, logits: torch.Tensor) -> None:
        """Set the disallowed entries of one ``[vocab]`` logits row to ``-inf`` in place."""

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token (one the last ``mask`` allowed)."""

    def is_finished(self) -> bool:
        """True once no further token can extend the output."""


@runtime_checkable
class ConstraintFactory(Protocol):
    """Per-request: makes a fresh constraint state for each sequence."""

    def new_constraint(self) -> LogitsConstraint:
        ...
