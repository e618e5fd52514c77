"""Speculative sampling: accept draft tokens so the output follows the target model.

Leviathan et al. 2023 / Chen et al. 2023. With draft tokens ``x_1..x_k`` sampled from
the proposer's distributions ``q_j`` and the target's ``p_j`` from one verification pass
(``p_{k+1}`` is the position after the last draft):

- accept ``x_j`` with probability ``min(1, p_j(x_j) / q_j(x_j))``, in order;
- at the first rejection emit a token from the residual ``norm(max(0, p_j - q_j))`` and
  stop; if all ``k`` are accepted emit a bonus token from ``p_{k+1}``.

Every emitted token is then distributed exactly as ``p`` (the papers' Theorem 1), so
sampling with speculation changes speed, not output distribution. A deterministic
proposer (n-gram lookup) has ``q_j = onehot(x_j)``: accept with probability
``p_j(x_j)``, and the residual is ``p_j`` without ``x_j``. Greedy requests accept a draft
while it equals the target's argmax, so their output equals plain greedy decoding.
"""

from __future__ import annotations

import torch

from llmctl.serve.sample.sampler import exponential_noise


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int((probs / exponential_noise(probs.shape, generator, probs.device)).argmax())


def greedy_verify(draft: list[int], target_argmax: list[int]) -> list[int]:
    """Accepted drafts plus the target's own next token (``len(target_argmax) = k + 1``)."""
    out = []
    for j, token in enumerate(draft):
        if token != target_argmax[j]:
            break
        out.append(token)
    out.append(target_argmax[len(out)])
    return out


def rejection_sample(draft: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     generator: torch.Generator) -> list[int]:
    """Accepted drafts plus one corrected or bonus token.

    ``target_probs`` is ``[k + 1, V]``; ``draft_probs`` is ``[k, V]`` or None for a
    deterministic proposer (one-hot ``q``).
    """
    k = len(draft)
    if k == 0:
        return [_draw(target_probs[0], generator)]
    ids = torch.tensor(draft, device=target_probs.device)
    rows = torch.arange(k, device=target_probs.device)
    p_x = target_probs[rows, ids]
    q_x = torch.ones(k, device=p_x.device) if draft_probs is None else draft_probs[rows, ids]
    u = torch.rand(k, generator=generator).to(p_x.device)  # the generator is the CPU's
    accept = (u * q_x < p_x).tolist()  # u < p/q without dividing by a q of 0
    n = accept.index(False) if False in accept else k
    if n == k:
        return draft + [_draw(target_probs[k], generator)]
    p = target_probs[n]
    if draft_probs is None:
        residual = p.clone()
        residual[draft[n]] = 0.0
    else:
        residual = (p - draft_probs[n]).clamp(min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had probability 0
        residual = p
    return draft[:n] + [_draw(residual / residual.sum(), generator)]
