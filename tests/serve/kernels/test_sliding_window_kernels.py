"""Sliding-window attention on every attention path, against float64 attention written out
by hand: query ``p`` sees keys ``p - W + 1 .. p`` (transformers' ``kv_idx > q_idx - W``).

Paths: the gather + SDPA path with its per-window masks (and its gather starting after
blocks out of every window), the native paged kernel in every instruction-set variant
this CPU runs (float32 AVX-512 or AVX2, bf16 AVX512-BF16, the portable loop; blocks before
the window are never read: they hold NaN here), the
bf16 prefill kernel, and the sliced SDPA of fresh groups.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmctl.serve.kernels import cpu as cpu_kernels
from llmctl.serve.layers import attention
from llmctl.serve.layers.attention import (
    AttnMetadata,
    build_kernel_group,
    build_paged_group,
    paged_attention,
    windowed_causal_attention,
)
from llmctl.utils.cpu import cpu_flags
from tests.serve.paged_cases import CASES, needs_kernels, random_case

WINDOWS = [1, 5, 16, 37]  # 16: one tile/block exactly


def _by_hand(q, cache, tables, contexts, q_len, window, scale) -> torch.Tensor:
    """float64: each query against the keys of its window, read through its table."""
    heads, d = q.shape[1], q.shape[2]
    bs, kv_heads = cache.shape[2], cache.shape[3]
    outs = []
    for b, (table, ctx) in enumerate(zip(tables, contexts)):
        pos = torch.arange(ctx)
        blocks = torch.tensor(table)[pos // bs]
        k = cache[0][blocks, pos % bs].double().repeat_interleave(heads // kv_heads, 1)
        v = cache[1][blocks, pos % bs].double().repeat_interleave(heads // kv_heads, 1)
        qb = q[b * q_len:(b + 1) * q_len].double()  # [q_len, H, d]
        qpos = ctx - q_len + torch.arange(q_len)
        allowed = (pos[None, :] <= qpos[:, None]) & (pos[None, :] > qpos[:, None] - window)
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        outs.append(out.reshape(q_len, heads * d))
    return torch.cat(outs)


def _contexts(q_len: int) -> list[int]:
    # shorter than a tile, exactly one tile/block, odd tails, long
    return [q_len + extra for extra in (0, 5, 15, 16, 31, 33, 200)]


@pytest.mark.parametrize("q_len", [1, 3, 40])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_gathered_groups_mask_each_window(case, window, q_len):
    """The gather + SDPA path with a window's mask, whole tables and (as the runner does
    when every layer has a window) with the blocks before the earliest window left out."""
    heads, kv_heads, head_dim, block_size = CASES[case]
    contexts = _contexts(q_len)
    cache, tables, q, num_blocks = random_case(heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                         block_size=block_size, contexts=contexts,
                                         q_len=q_len, dtype=torch.float32)
    scale = head_dim ** -0.5
    want = _by_hand(q, cache, tables, contexts, q_len, window, scale).float()
    k = torch.zeros((q.shape[0], kv_heads, head_dim))
    earliest = min(contexts) - q_len - window + 1

    def run(first_block: int, layer_window: int | None) -> torch.Tensor:
        grp = build_paged_group(0, q_len, contexts, tables, block_size=block_size,
                                num_blocks=num_blocks, group_heads=heads // kv_heads,
                                device=torch.device("cpu"), windows=[window, 1000],
                                first_block=first_block)
        meta = AttnMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), groups=[grp])
        return paged_attention(q, k, k, cache, meta, scale, layer_window)

    for first_block in (0, max(0, earliest) // block_size):
        torch.testing.assert_close(run(first_block, window), want, atol=1e-5, rtol=1e-5)
    # a full-attention layer of the same model reads the causal mask of the same group
    full = _by_hand(q, cache, tables, contexts, q_len, 10**9, scale).float()
    torch.testing.assert_close(run(0, None), full, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("q_len", [1, 3, 20])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_kernel_honours_the_window_and_reads_nothing_before_it(case, window, q_len,
                                                                     dtype, isa):
    """The native kernel with a window against attention by hand; the blocks before the
    first query's window are NaN (or dropped from the table, -1), and the result is the
    same finite one: the kernel never reads them."""
    heads, kv_heads, head_dim, block_size = CASES[case]
    contexts = _contexts(q_len)
    cache, tables, q, _ = random_case(heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                block_size=block_size, contexts=contexts, q_len=q_len,
                                dtype=dtype)
    scale = head_dim ** -0.5
    want = _by_hand(q, cache, tables, contexts, q_len, window, scale).float()
    kernel = cpu_kernels.paged_attention_kernel(torch.device("cpu"), dtype)
    dropped = []
    for table, ctx in zip(tables, contexts):
        first_key = max(0, ctx - q_len - window + 1)  # of the sequence's first query
        gone = first_key // block_size
        for b in table[:gone]:
            cache[:, b] = float("nan")
        dropped.append([-1] * gone + table[gone:])
    assert sum(t.count(-1) for t in dropped) > 0  # the long context drops blocks
    # bf16: the second product rounds probabilities to bf16 (as FlashAttention does)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for named in (tables, dropped):
        grp = build_kernel_group(0, q_len, contexts, named, device=torch.device("cpu"))
        got = kernel(q, cache, grp.block_tables, grp.context_lens, q_len, scale, window)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def _fresh_by_hand(q, k, v, seqs, length, window, scale) -> torch.Tensor:
    heads, d = q.shape[1], q.shape[2]

    def per_seq(t: torch.Tensor) -> torch.Tensor:
        out = t.double().reshape(seqs, length, t.shape[1], d).transpose(1, 2)
        return out.repeat_interleave(heads // t.shape[1], 1)

    pos = torch.arange(length)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    want = torch.nn.functional.scaled_dot_product_attention(
        per_seq(q), per_seq(k), per_seq(v), attn_mask=allowed, scale=scale)
    return want.transpose(1, 2).reshape(seqs * length, heads * d)


@needs_kernels
@pytest.mark.parametrize("seqs,length,heads,kv_heads,d,window", [
    (2, 37, 9, 3, 64, 5),       # ragged tiles, a window inside one tile
    (1, 300, 8, 2, 128, 16),    # query blocks of 128 that start past the window: packed late
    (2, 130, 4, 2, 64, 100),    # a window across query blocks
    (1, 17, 6, 6, 64, 1),       # each token sees itself only
    (2, 40, 4, 2, 64, 64),      # a window longer than the prompt: causal
])
def test_prefill_kernel_honours_the_window(seqs, length, heads, kv_heads, d, window):
    """csrc/prefill_attention.cpp with a window against float64 on the same bf16 q/k/v;
    bound as for its causal test (bf16 probabilities and output: 4 half-steps of the
    largest output)."""
    fn = cpu_kernels.prefill_attention_kernel(torch.device("cpu"), torch.bfloat16)
    if fn is None:
        assert "avx512_bf16" not in cpu_flags()  # only a CPU without it may lack the kernel
        pytest.skip("this CPU has no AVX512-BF16")
    gen = torch.Generator().manual_seed(length)
    tokens = seqs * length
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d + 16, generator=gen).bfloat16()
    q = qkv[:, :heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:(heads + 2 * kv_heads) * d].view(tokens, kv_heads, d)
    scale = 1 / math.sqrt(d)
    got = fn(q, k, v, seqs, length, scale, window)
    want = _fresh_by_hand(q, k, v, seqs, length, window, scale)
    assert (got.double() - want).abs().max() <= 4 * 2.0 ** -9 * want.abs().max()
    if window < length:  # and the window really changed the result
        causal = _fresh_by_hand(q, k, v, seqs, length, length, scale)
        assert (causal - want).abs().max() > 0.1 * want.abs().max()


@pytest.mark.parametrize("window", [1, 5, 13, 40])
def test_fresh_groups_attend_in_slices_of_queries(monkeypatch, window):
    """The SDPA path of fresh groups: slices of 8 queries (patched down from 512) against
    the keys their windows reach give windowed attention over the whole prompt."""
    monkeypatch.setattr(attention, "WINDOW_QUERY_SLICE", 8)
    gen = torch.Generator().manual_seed(window)
    seqs, length, heads, kv_heads, d = 2, 30, 6, 2, 16
    q = torch.randn(seqs * length, heads, d, generator=gen)
    k = torch.randn(seqs * length, kv_heads, d, generator=gen)
    v = torch.randn(seqs * length, kv_heads, d, generator=gen)
    got = windowed_causal_attention(q.view(seqs, length, heads, d).transpose(1, 2),
                                    k.view(seqs, length, kv_heads, d).transpose(1, 2),
                                    v.view(seqs, length, kv_heads, d).transpose(1, 2),
                                    window, 0.25)
    got = got.transpose(1, 2).reshape(seqs * length, heads * d)
    want = _fresh_by_hand(q, k, v, seqs, length, window, 0.25).float()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
