"""Attention pieces shared by the reference forwards (the quantizer's block, the static
decoder): q/k norm, grouped-query expansion, the causal (sliding-window) mask, and
scaled dot-product attention with its score hooks as data.

Shapes are transformers': ``[batch, heads, seq, head_dim]``. The engine attends through
its paged cache (:mod:`llmctl.serve.layers.attention`) and uses only the norm from here.

Score hooks: ``scale`` multiplies ``q . k`` (None: SDPA's own ``1/sqrt(head_dim)``;
Gemma's ``query_pre_attn_scalar ** -0.5`` is a different value), ``softcap`` bounds the
scores to ``cap * tanh(s / cap)`` before the softmax (Gemma 2's attention soft-capping),
``sinks`` (one learned logit per query head, gpt-oss's ``self_attn.sinks``) is one more
column of every row of scores, dropped after the softmax: ``p_j = exp(s_j) / (exp(sink)
+ sum_i exp(s_i))``, so a head may attend to nothing; as transformers' eager attention
computes them (the max over the row and the sink subtracted first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmctl.models.layers.norm import RMSNorm


def qk_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
            norm: RMSNorm, *, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over each head's vector of q and of k, before RoPE (Qwen3, Gemma 3)."""
    apply = norm.fused if fused else norm
    return apply(q, q_weight), apply(k, k_weight)


def repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[b, kv_heads, s, d] -> [b, kv_heads * group, s, d]``: query head ``h`` reads KV
    head ``h // group`` (transformers' ``repeat_kv`` layout)."""
    if group == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, group, s, d).reshape(b, kv * group, s, d)


def sliding_causal_mask(t: int, window: int, device=None) -> torch.Tensor:
    """``[t, t]`` bool: query ``i`` sees key ``j`` iff ``i - window < j <= i``."""
    i = torch.arange(t, device=device)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           *, causal: bool = False, scale: float | None = None,
           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(hooks(q k^T) + mask) v`` with as many KV heads as query heads; ``mask``
    bool (True: attend), ``causal`` instead of a mask; ``sinks [heads]`` (module doc)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale)
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        t, s = scores.shape[-2:]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        b, h, t, _ = scores.shape
        column = sinks.to(scores.dtype).reshape(1, h, 1, 1).expand(b, h, t, 1)
        scores = torch.cat([scores, column], dim=-1)
        scores = scores - scores.amax(dim=-1, keepdim=True)
        return torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1].to(v.dtype) @ v
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
