"""Constraints on what a sequence may generate next (structured output), as the engine sees them.

A request carries a :class:`ConstraintFactory` (built by the HTTP layer, e.g. from a
JSON schema by :mod:`llmctl.serve.api.grammar`); every sequence of the request gets its
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

The engine knows only this protocol (no grammar library imports).

OpenAI's ``logit_bias`` is applied at the same point (:func:`apply_logit_bias`): added
to the raw logits before penalties, temperature and filters, as vLLM's sampler does
(its step 5b, "logit processors which are not argmax-invariant", after the allowed-token
whitelist and before penalties); log-probs are computed from the logits before either,
as vLLM's default ``logprobs_mode="raw_logprobs"`` does.
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


def apply_constraints(logits: torch.Tensor, constraints: list[LogitsConstraint | None]
                      ) -> torch.Tensor:
    """``logits`` (float, ``[rows, vocab]``) with each row masked by its constraint.

    Returns a new tensor when any row is constrained (the caller's logits also feed
    logprobs, which report the model's raw distribution), else ``logits`` itself.
    """
    if all(c is None for c in constraints):
        return logits
    out = logits.clone()
    for row, constraint in enumerate(constraints):
        if constraint is not None:
            constraint.mask(out[row])
    return out


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float] | None]
                     ) -> torch.Tensor:
    """``logits`` (``[rows, vocab]``) plus each row's ``{token id: bias}``, in float32.

    Returns a new tensor when any row is biased (the caller's logits also feed logprobs),
    else ``logits`` itself. float32 because a bias of +-100 on bf16 logits would round the
    biased logit to a multiple of 0.5 (bf16 keeps 8 significant bits).
    """
    if not any(biases):
        return logits
    import torch

    out = logits.to(torch.float32, copy=True)
    for row, bias in enumerate(biases):
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=out.device)
            values = torch.tensor(list(bias.values()), dtype=out.dtype, device=out.device)
            out[row].index_add_(0, ids, values)
    return out
