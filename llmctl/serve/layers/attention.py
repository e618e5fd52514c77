"""Attention over the paged KV cache.

A step's tokens are one flat stream ``[T]`` ordered by attention group; each group is
one call:

- ``fresh``: sequences whose whole context is computed in this step (prompts with no
  cached prefix), all of the same length. Their K/V are the ones just computed: causal
  SDPA on them directly, ``[B, heads, L, d]``; with bf16 on a CPU with AVX512-BF16,
  :file:`csrc/prefill_attention.cpp` instead (``AttnMetadata.prefill``).
- ``paged``: sequences that all compute ``q_len`` tokens on top of cached context
  (decodes: ``q_len = 1``; draft verification: ``1 + k``; later prompt chunks). Their
  K/V are gathered through the block tables into ``[B, S]`` (S = the group's longest
  context, rounded up to blocks) and masked: query ``i`` of a sequence with ``ctx``
  tokens sits at position ``ctx - q_len + i`` and sees keys ``j <= ctx - q_len + i``.

  With a native kernel (:mod:`llmctl.serve.kernels.cpu`) a ``paged`` group with a short
  ``q_len`` skips the gather: the kernel walks the block tables itself
  (``context_lens`` set, no mask or gather index).

Sliding windows (per layer, :attr:`llmctl.serve.model.decoder.ModelSpec.layer_windows`): a
windowed layer's query at position ``p`` sees keys ``p - W + 1 .. p``. A paged group
carries one additive mask per window the model uses (``window_masks``); a fresh group
longer than the window runs in slices of queries, each against the keys its window
reaches (a mask of ``slice x (slice + W - 1)``, never ``L x L``); the native kernels take
``W`` and start each walk at the first key in the window. Blocks that fell out of every
layer's window are dropped from the block tables (-1, read as block 0 and masked out:
:mod:`llmctl.serve.core.block_manager`); a gathered group whose sequences all have dropped
leading blocks starts its gather after them (``first_block``).

Logit soft-capping (Gemma 2, ``softcap``): each scaled score ``s`` becomes ``softcap *
tanh(s / softcap)`` before the mask and the softmax (transformers' eager attention). SDPA
has no such hook: the torch paths of a soft-capped layer run :func:`softcapped_attention`
(float32 scores, softmax and products); the native kernels cap inside their score loops.
Without a cap every path is the one it was.

Attention sinks (gpt-oss, ``sinks``: one learned float32 logit per query head): the
softmax runs over ``[scores, sink]`` and the sink's column is dropped, so a head may attend
to nothing (its weights sum to less than 1); transformers' eager ``GptOssAttention``. With
``m = max(max_j s_j, sink)``: ``out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) +
exp(sink - m))``. SDPA has no such hook: the torch paths of a layer with sinks run
:func:`softcapped_attention` (float32). The native kernels (csrc's paged and prefill
attention) take the sinks per call: an online-softmax body starts each row as if it had
seen the sink, a key with a zero value (running max ``sink``, sum ``1``); a two-pass one
(AVX512-BF16) takes it into each row's max and sum. The fused decode layers pass none;
gpt-oss, the one family with sinks, is a mixture of experts, which they do not run
(:mod:`llmctl.serve.model.decoder`).

Grouped-query attention without repeating K/V: the ``g = heads / kv_heads`` query heads
of one KV head are folded into the query length, ``q [B, kv_heads, g * q_len, d]``
against ``k [B, kv_heads, S, d]`` (HF's ``repeat_kv`` gives query head ``h`` the KV head
``h // g``, which is this layout).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmctl.serve.layers.kv_quant import CODECS


@dataclass
class AttnGroup:
    start: int  # token range [start, end) in the flat stream
    end: int
    num_seqs: int
    q_len: int
    fresh: bool
    block_tables: torch.Tensor | None = None  # [B, max_blocks] long
    # rows of the layer cache viewed as [2 * blocks, block_size * Hkv * d]: the K blocks
    # of every table, then the V blocks (index_select on contiguous rows is a plain
    # memcpy per row, several times faster than advanced indexing on the 5-d cache)
    gather_index: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [B, 1, g * q_len or 1, S] additive: 0 or -inf
    context_lens: torch.Tensor | None = None  # [B] long: set when the kernel runs the group
    # window W -> the additive mask of a layer with that window, shaped as ``mask``
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class AttnMetadata:
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V is written
    groups: list[AttnGroup]
    # cpu_kernels.paged_attention_kernel's callable, for groups with context_lens
    kernel: Callable | None = None
    # cpu_kernels.prefill_attention_kernel's callable, for fresh groups (bf16)
    prefill: Callable | None = None


def block_table_tensor(block_tables: list[list[int]]) -> torch.Tensor:
    """``[B, max_blocks]`` long, rows zero-padded. One conversion of padded lists: a
    tensor and a copy per row cost ~6x more at 64 rows (0.46 vs 0.08 ms here), on the
    engine thread, every step."""
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
    # a dropped block (-1: out of every layer's window) reads as block 0; no query of
    # the step sees its keys, so whatever block 0 holds is masked out or never walked
    return tables.clamp_(min=0)


def build_kernel_group(start: int, q_len: int, context_lens: list[int],
                       block_tables: list[list[int]], *, device: torch.device) -> AttnGroup:
    """Metadata for a paged group the native kernel runs: tables and context lengths."""
    return AttnGroup(start=start, end=start + len(context_lens) * q_len,
                     num_seqs=len(context_lens), q_len=q_len, fresh=False,
                     block_tables=block_table_tensor(block_tables).to(device),
                     context_lens=torch.tensor(context_lens, dtype=torch.long, device=device))


def build_paged_group(start: int, q_len: int, context_lens: list[int],
                      block_tables: list[list[int]], *, block_size: int, num_blocks: int,
                      group_heads: int, device: torch.device,
                      dtype: torch.dtype = torch.float32, windows: Iterable[int] = (),
                      first_block: int = 0) -> AttnGroup:
    """Metadata for sequences computing ``q_len`` tokens each with the given contexts
    (``num_blocks``: the cache's block count, where the V rows start). ``windows``: the
    sliding windows to build masks for; ``first_block``: leading blocks of every table
    that no query of the group reads (out of every window), left out of the gather."""
    num_seqs = len(context_lens)
    tables = block_table_tensor([t[first_block:] for t in block_tables])
    max_blocks = tables.shape[1]
    ctx = torch.tensor(context_lens, dtype=torch.long)
    keys = first_block * block_size + torch.arange(max_blocks * block_size)
    # last visible key of query i: ctx - q_len + i
    limit = (ctx[:, None] - q_len + torch.arange(q_len)[None, :])[:, :, None]  # [B, q_len, 1]
    visible = keys[None, None, :] <= limit  # [B, q_len, S]

    def additive(mask: torch.Tensor) -> torch.Tensor:
        if q_len == 1:
            mask = mask.unsqueeze(1)  # [B, 1, 1, S], broadcast over the g folded heads
        else:
            mask = mask.unsqueeze(1).expand(num_seqs, group_heads, q_len, -1)
            mask = mask.reshape(num_seqs, 1, group_heads * q_len, -1)
        # additive float mask, built once per step: a bool mask is converted on every call
        bias = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
        return bias.to(device)

    flat = tables.flatten()
    gather = torch.cat([flat, flat + num_blocks])
    return AttnGroup(start=start, end=start + num_seqs * q_len, num_seqs=num_seqs, q_len=q_len,
                     fresh=False, block_tables=tables.to(device), mask=additive(visible),
                     gather_index=gather.to(device),
                     window_masks={w: additive(visible & (keys[None, None, :] > limit - w))
                                   for w in set(windows)})


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor, scale: float, softcap: float | None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Eager attention with soft-capped scores and/or sinks, in float32, cast back to
    ``q``'s dtype: ``q [B, H, L, d]``, ``k, v [B, Hkv, S, d]`` (query head ``h`` reads KV
    head ``h // (H / Hkv)``), ``mask`` broadcast to ``[B, H, L, S]``: bool (True: visible)
    or additive (0 or -inf). transformers' Gemma 2: ``w = q k^T * scaling; w = tanh(w /
    cap) * cap; w += mask; softmax(w, float32) v``. ``sinks``: each query row's sink logit,
    broadcast to ``[B, H, L, 1]`` (gpt-oss: ``w = cat([w, sink]); w -= max(w); softmax(w)``
    with the sink's column dropped)."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    w = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap:
        w = torch.tanh(w / softcap) * softcap
    w = w.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else w + mask
    if sinks is None:
        return torch.matmul(torch.softmax(w, dim=-1), v.float()).to(q.dtype)
    w = torch.cat([w, sinks.float().expand(*w.shape[:-1], 1)], dim=-1)
    w = w - w.amax(dim=-1, keepdim=True)
    probs = torch.softmax(w, dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def _head_sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """``[H]`` -> ``[1, H, 1, 1]``: one sink per query head of ``q [B, H, L, d]``."""
    return None if sinks is None else sinks.view(1, -1, 1, 1)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      softcap: float | None, sinks: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Causal attention of ``q [B, H, L, d]`` on ``k, v [B, Hkv, L, d]`` (``sinks [H]``).
    With sinks, a long prompt runs in slices of queries, each against the keys up to its
    last (the eager float32 scores of a whole 8K prompt of 64 heads would be 16 GiB)."""
    length = q.shape[2]
    if sinks is not None and length > WINDOW_QUERY_SLICE:
        outs = []
        for s in range(0, length, WINDOW_QUERY_SLICE):
            e = min(length, s + WINDOW_QUERY_SLICE)
            mask = torch.arange(s, e, device=q.device)[:, None] \
                >= torch.arange(e, device=q.device)[None, :]
            outs.append(softcapped_attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e], mask,
                                             scale, softcap, _head_sinks(sinks)))
        return torch.cat(outs, dim=2)
    if softcap or sinks is not None:
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        return softcapped_attention(q, k, v, causal, scale, softcap, _head_sinks(sinks))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


# Query slice of a fresh group with a sliding window: the mask of a slice is
# slice x (slice + W - 1), a few MB at W = 4096 (an L x L mask would be 256 MB at 8K).
WINDOW_QUERY_SLICE = 512


def windowed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                              scale: float, softcap: float | None = None,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``q [B, H, L, d]``, ``k, v [B, Hkv, L, d]``: query ``i`` attends to keys
    ``i - window + 1 .. i``; slices of queries against only the keys they reach.
    ``softcap``, ``sinks [H]``: soft-capped scores, sinks (:func:`softcapped_attention`)."""
    length = q.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if length <= window:  # the window never bites
        return _causal_attention(q, k, v, scale, softcap, sinks)
    outs = []
    for s in range(0, length, WINDOW_QUERY_SLICE):
        e = min(length, s + WINDOW_QUERY_SLICE)
        k0 = max(0, s - window + 1)
        offset = torch.arange(s, e, device=q.device)[:, None] \
            - torch.arange(k0, e, device=q.device)[None, :]  # query - key
        mask = (offset >= 0) & (offset < window)
        if softcap or sinks is not None:
            outs.append(softcapped_attention(q[:, :, s:e], k[:, :, k0:e], v[:, :, k0:e], mask,
                                             scale, softcap, _head_sinks(sinks)))
            continue
        outs.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, k0:e], v[:, :, k0:e],
                                                   attn_mask=mask, scale=scale,
                                                   enable_gqa=gqa))
    return torch.cat(outs, dim=2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttnMetadata, scale: float, window: int | None = None,
                    scales: torch.Tensor | None = None,
                    softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``q [T, H, d]``, new ``k, v [T, Hkv, d]``, the layer's cache ``[2, blocks,
    block_size, Hkv, d]`` (this step's K/V already written) -> ``[T, H * d]``; ``window``:
    the layer's sliding window (None: full causal attention); ``scales``: an int8 cache's
    ``[2, blocks, block_size, Hkv]`` or an fp8 cache's ``[2, Hkv]`` (the native kernel
    reads the codes as they are, a gathered group dequantizes the blocks it gathered);
    ``softcap``: the layer's logit soft-cap (None or 0: none); ``sinks``: the layer's
    attention sinks, float32 ``[H]`` (None: none; module doc)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    g = num_heads // kv_heads
    outs = []
    for grp in meta.groups:
        qs = q[grp.start:grp.end]
        b, lq = grp.num_seqs, grp.q_len
        if grp.fresh and meta.prefill is not None:
            o = meta.prefill(qs, k[grp.start:grp.end], v[grp.start:grp.end], b, lq, scale,
                             window or 0, softcap or 0.0, sinks)
            if o is not None:
                outs.append(o)
                continue
        if grp.fresh:
            qf = qs.view(b, lq, num_heads, head_dim).transpose(1, 2)
            kf = k[grp.start:grp.end].view(b, lq, kv_heads, head_dim).transpose(1, 2)
            vf = v[grp.start:grp.end].view(b, lq, kv_heads, head_dim).transpose(1, 2)
            if window:
                o = windowed_causal_attention(qf, kf, vf, window, scale, softcap, sinks)
            else:
                o = _causal_attention(qf, kf, vf, scale, softcap, sinks)
            outs.append(o.transpose(1, 2).reshape(b * lq, num_heads * head_dim))
            continue
        if grp.context_lens is not None:
            outs.append(meta.kernel(qs, kv_cache, grp.block_tables, grp.context_lens, lq, scale,
                                    window or 0, scales, softcap or 0.0, sinks))
            continue
        s = grp.block_tables.shape[1] * kv_cache.shape[2]
        rows = kv_cache.view(-1, kv_cache.shape[2] * kv_heads * head_dim)
        kv = rows.index_select(0, grp.gather_index).view(2, b, s, kv_heads, head_dim)
        if scales is not None:
            kv = CODECS[kv_cache.dtype].dequantize_gathered(kv, scales, grp.gather_index,
                                                            qs.dtype)
        kg, vg = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
        qg = qs.view(b, lq, kv_heads, g, head_dim).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(b, kv_heads, g * lq, head_dim)
        mask = grp.window_masks[window] if window else grp.mask
        if softcap or sinks is not None:
            # the folded rows are (query head of the KV head, query position), head-major
            group_sinks = None if sinks is None else \
                sinks.view(kv_heads, g, 1).expand(kv_heads, g, lq).reshape(1, kv_heads, g * lq, 1)
            o = softcapped_attention(qg, kg, vg, mask, scale, softcap, group_sinks)
        else:
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
        o = o.view(b, kv_heads, g, lq, head_dim).permute(0, 3, 1, 2, 4)
        outs.append(o.reshape(b * lq, num_heads * head_dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
