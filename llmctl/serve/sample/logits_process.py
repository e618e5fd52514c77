"""Constraints and ``logit_bias`` applied to a step's raw logits rows.

The constraint protocol and its per-step contract: :mod:`llmctl.serve.core.constraints`.

OpenAI's ``logit_bias`` is applied where the constraints' masks are (:func:`apply_logit_bias`): added
to the raw logits before penalties, temperature and filters, as vLLM's sampler does
(its step 5b, "logit processors which are not argmax-invariant", after the allowed-token
whitelist and before penalties); log-probs are computed from the logits before either,
as vLLM's default ``logprobs_mode="raw_logprobs"`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmctl.serve.core.constraints import LogitsConstraint

if TYPE_CHECKING:
    import torch


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
