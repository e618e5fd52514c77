"""Attention logit soft-capping (Gemma 2) on every attention path, against float64
attention written out by hand: each scaled score ``s`` becomes ``cap * tanh(s / cap)``
before the mask and the softmax (transformers' eager attention), with and without a
sliding window.

Paths: the native paged kernel in every instruction-set variant this CPU runs (float32
AVX-512 / AVX2, bf16 AVX512-BF16, the portable loop; float32, bf16 and int8 caches), the
bf16 prefill kernel, and the torch fallbacks (the gather path, fresh groups with and
without a window, the sliced windowed path). A cap of None leaves every path bit for bit
as it was; a cap so large that tanh is the identity agrees with no cap.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmctl.serve.kernels import cpu as cpu_kernels
from llmctl.serve.layers import attention
from llmctl.serve.layers.attention import (
    AttnGroup,
    AttnMetadata,
    build_kernel_group,
    build_paged_group,
    paged_attention,
    windowed_causal_attention,
)
from llmctl.serve.layers.kv_quant import quantize_int8
from llmctl.utils.cpu import cpu_flags
from tests.serve.paged_cases import CASES, needs_kernels, prefill_qkv, random_case

CPU = torch.device("cpu")
# a cap that bites: the random scores reach ~3 * scale * sqrt(d) ~ 3, and inputs are scaled
# up so that many are past the cap's knee
CAP = 2.5
Q_GAIN = 4.0


def _by_hand(q, k_of, v_of, tables, contexts, q_len, window, scale, cap):
    """float64: each query against the keys of its window, read through its table
    (``k_of(blocks, offsets)``: dequantized keys ``[n, Hkv, d]``), scores capped."""
    heads, d = q.shape[1], q.shape[2]
    outs = []
    for b, (table, ctx) in enumerate(zip(tables, contexts)):
        pos = torch.arange(ctx)
        blocks = torch.tensor(table)[pos // k_of.block_size]
        k, v = k_of(blocks, pos % k_of.block_size), v_of(blocks, pos % k_of.block_size)
        k = k.repeat_interleave(heads // k.shape[1], 1)
        v = v.repeat_interleave(heads // v.shape[1], 1)
        qb = q[b * q_len:(b + 1) * q_len].double()
        qpos = ctx - q_len + torch.arange(q_len)
        allowed = pos[None, :] <= qpos[:, None]
        if window:
            allowed &= pos[None, :] > qpos[:, None] - window
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        if cap:
            scores = torch.tanh(scores / cap) * cap
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q_len, heads * d))
    return torch.cat(outs)


class _Rows:
    """K or V of a cache as float64 rows by (block, offset): codes times their scales."""

    def __init__(self, cache, scales, which):
        self.cache, self.scales, self.which = cache, scales, which
        self.block_size = cache.shape[2]

    def __call__(self, blocks, offsets):
        rows = self.cache[self.which][blocks, offsets].double()
        if self.scales is not None:
            rows = rows * self.scales[self.which][blocks, offsets].double()[..., None]
        return rows


def _case(case, q_len, dtype, seed=0):
    heads, kv_heads, head_dim, block_size = CASES[case]
    contexts = [q_len + extra for extra in (0, 5, 15, 16, 31, 33, 200)]
    cache, tables, q, num_blocks = random_case(
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
        contexts=contexts, q_len=q_len, dtype=dtype, seed=seed)
    return cache, tables, (q.float() * Q_GAIN).to(dtype), num_blocks, contexts


# bf16 queries: the AVX512-BF16 body rounds the probabilities to bf16 for P.V (as
# FlashAttention does), 2^-9 relative each: 2e-2 as test_cpu_kernels.py allows
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [0, 5, 37])
@pytest.mark.parametrize("q_len", [1, 3, 20])
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_kernel_caps_the_scores(case, q_len, window, dtype, isa):
    """The native kernel against float64 capped attention (float32: 1e-5; bf16: 2e-2)."""
    cache, tables, q, _, contexts = _case(case, q_len, dtype)
    scale = q.shape[2] ** -0.5
    kernel = cpu_kernels.paged_attention_kernel(CPU, dtype)
    grp = build_kernel_group(0, q_len, contexts, tables, device=CPU)
    got = kernel(q, cache, grp.block_tables, grp.context_lens, q_len, scale, window, None, CAP)
    want = _by_hand(q, _Rows(cache, None, 0), _Rows(cache, None, 1), tables, contexts, q_len,
                    window, scale, CAP).float()
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    uncapped = _by_hand(q, _Rows(cache, None, 0), _Rows(cache, None, 1), tables, contexts,
                        q_len, window, scale, None).float()
    assert (got - uncapped).abs().max() > 10 * TOL[dtype]  # the cap changed the result


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("case", ["avx512-d64-gqa3", "portable-d16"])
def test_paged_kernel_caps_the_scores_of_an_int8_cache(case, q_len, window, dtype, isa):
    """int8 codes with per-slot scales (the bf16 body applies K's scales outside the
    products, before the cap) against float64 capped attention on the dequantized cache,
    and against the torch fallback (gather, dequantize, softcapped_attention)."""
    cache, tables, q, num_blocks, contexts = _case(case, q_len, torch.float32, seed=1)
    codes, scales = quantize_int8(cache)
    q = q.to(dtype)
    heads, kv_heads, d, block_size = CASES[case]
    scale = d ** -0.5
    kernel = cpu_kernels.paged_attention_kernel(CPU, dtype, codes=torch.int8)
    grp = build_kernel_group(0, q_len, contexts, tables, device=CPU)
    got = kernel(q, codes, grp.block_tables, grp.context_lens, q_len, scale, window, scales, CAP)
    want = _by_hand(q, _Rows(codes, scales, 0), _Rows(codes, scales, 1), tables, contexts,
                    q_len, window, scale, CAP).float()
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    ref_grp = build_paged_group(0, q_len, contexts, tables, block_size=block_size,
                                num_blocks=num_blocks, group_heads=heads // kv_heads,
                                device=CPU, windows=[window] if window else ())
    meta = AttnMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), groups=[ref_grp])
    unused = torch.zeros(q.shape[0], kv_heads, d)
    fallback = paged_attention(q.float(), unused, unused, codes, meta, scale, window or None,
                               scales, softcap=CAP)
    torch.testing.assert_close(fallback, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5, 37])
@pytest.mark.parametrize("q_len", [1, 3, 20])
@pytest.mark.parametrize("case", ["avx512-d64-gqa3", "portable-block8"])
def test_the_gather_path_caps_the_scores(case, q_len, window):
    """The torch fallback of a paged group (gather + additive mask + softcapped_attention)
    against float64 capped attention: float32 1e-5; without a cap it is SDPA as before."""
    cache, tables, q, num_blocks, contexts = _case(case, q_len, torch.float32, seed=2)
    heads, kv_heads, d, block_size = CASES[case]
    scale = d ** -0.5
    grp = build_paged_group(0, q_len, contexts, tables, block_size=block_size,
                            num_blocks=num_blocks, group_heads=heads // kv_heads, device=CPU,
                            windows=[window] if window else ())
    meta = AttnMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), groups=[grp])
    unused = torch.zeros(q.shape[0], kv_heads, d)
    rows = _Rows(cache, None, 0), _Rows(cache, None, 1)
    got = paged_attention(q, unused, unused, cache, meta, scale, window, softcap=CAP)
    want = _by_hand(q, *rows, tables, contexts, q_len, window, scale, CAP).float()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plain = paged_attention(q, unused, unused, cache, meta, scale, window)
    want_plain = _by_hand(q, *rows, tables, contexts, q_len, window, scale, None).float()
    torch.testing.assert_close(plain, want_plain, atol=1e-5, rtol=1e-5)
    # a cap far above every score: tanh(s / cap) * cap = s to float32 rounding
    huge = paged_attention(q, unused, unused, cache, meta, scale, window, softcap=1e6)
    torch.testing.assert_close(huge, plain, atol=1e-5, rtol=1e-5)


def _fresh_by_hand(q, k, v, window, scale, cap):
    """float64 causal (windowed) capped attention of ``[B, H, L, d]`` tensors."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scores = q.double() @ k.transpose(-1, -2) * scale
    if cap:
        scores = torch.tanh(scores / cap) * cap
    i = torch.arange(q.shape[2])
    allowed = i[None, :] <= i[:, None]
    if window:
        allowed &= i[None, :] > i[:, None] - window
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("window", [None, 7, 100])
def test_fresh_groups_on_the_torch_path_cap_the_scores(window, monkeypatch):
    """A fresh group without the prefill kernel: plain causal, and the windowed path both
    whole (L <= W) and sliced (a slice of 16 queries: several slices and their masks)."""
    monkeypatch.setattr(attention, "WINDOW_QUERY_SLICE", 16)
    seqs, length, heads, kv_heads, d = 2, 50, 6, 2, 16
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(seqs * length, heads + 2 * kv_heads, d, generator=gen) * 2
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    grp = AttnGroup(start=0, end=seqs * length, num_seqs=seqs, q_len=length, fresh=True)
    meta = AttnMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), groups=[grp])
    scale = 0.3
    got = paged_attention(q, k, v, torch.zeros(1), meta, scale, window, softcap=CAP)

    def per_seq(t):
        return t.view(seqs, length, t.shape[1], d).transpose(1, 2)

    want = _fresh_by_hand(per_seq(q), per_seq(k), per_seq(v), window, scale, CAP)
    want = want.transpose(1, 2).reshape(seqs * length, heads * d).float()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if window:  # the function itself, as the engine's other callers use it
        direct = windowed_causal_attention(per_seq(q), per_seq(k), per_seq(v), window, scale,
                                           softcap=CAP)
        torch.testing.assert_close(direct.transpose(1, 2).reshape(seqs * length, -1), want,
                                   atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("window", [0, 9, 150])
@pytest.mark.parametrize("seqs,length,heads,kv_heads,d", [
    (3, 37, 9, 3, 64),     # SmolLM2's heads, ragged last tile
    (1, 200, 8, 2, 128),   # head_dim 128, two query blocks of 128
])
def test_prefill_kernel_caps_the_scores(seqs, length, heads, kv_heads, d, window, isa):
    """csrc/prefill_attention.cpp with a cap against float64 capped attention on the same
    bf16 q/k/v: four bf16 steps (2^-9 relative) of the largest output, as its uncapped
    test allows."""
    fn = cpu_kernels.prefill_attention_kernel(CPU, torch.bfloat16)
    if fn is None:
        assert isa not in ("native", "avx512-bf16") or "avx512_bf16" not in cpu_flags()
        pytest.skip(f"the {isa} build has no AVX512-BF16 prefill kernel")
    q, k, v = prefill_qkv(seqs, length, heads, kv_heads, d)
    tokens = seqs * length
    scale = 1 / math.sqrt(d)
    got = fn(q, k, v, seqs, length, scale, window, CAP)

    def per_seq(t):
        return t.view(seqs, length, t.shape[1], d).transpose(1, 2)

    want = _fresh_by_hand(per_seq(q), per_seq(k), per_seq(v), window, scale, CAP)
    want = want.transpose(1, 2).reshape(tokens, heads * d)
    assert (got.double() - want).abs().max() <= 4 * 2.0 ** -9 * want.abs().max()
    uncapped = fn(q, k, v, seqs, length, scale, window)
    assert (got.double() - uncapped.double()).abs().max() > 0.05


@needs_kernels
def test_no_cap_is_the_uncapped_kernel_bit_for_bit():
    """softcap None / 0 through paged_attention: the very bits of the call without it."""
    cache, tables, q, _, contexts = _case("avx512-d64-gqa3", 3, torch.bfloat16)
    kernel = cpu_kernels.paged_attention_kernel(CPU, torch.bfloat16)
    grp = build_kernel_group(0, 3, contexts, tables, device=CPU)
    meta = AttnMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), groups=[grp],
                        kernel=kernel)
    unused = torch.zeros(q.shape[0], 3, 64)
    base = kernel(q, cache, grp.block_tables, grp.context_lens, 3, 0.125, 5)
    for cap in (None, 0.0):
        assert torch.equal(paged_attention(q, unused, unused, cache, meta, 0.125, 5,
                                           softcap=cap), base)
