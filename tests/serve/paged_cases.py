"""Shared inputs of the paged-attention kernel tests (test_cpu_kernels,
test_sliding_window_kernels, test_kv_cache_int8): the kernel's dispatch branches and a
random cache with shuffled block tables."""

from __future__ import annotations

import pytest
import torch

from llmctl.serve.kernels import cpu as cpu_kernels
from llmctl.serve.layers.attention import (
    AttnMetadata,
    build_kernel_group,
    build_paged_group,
    paged_attention,
)

CPU = torch.device("cpu")

needs_kernels = pytest.mark.skipif(
    cpu_kernels.paged_attention_kernel(CPU, torch.float32) is None,
    reason="no C++ compiler: the native kernels are not built here")

# Every instruction-set variant this CPU runs (an AVX-512 machine also runs the AVX2 and
# portable bodies), and "native", the build the engine uses by default.
ISA_VARIANTS = ["native", *cpu_kernels.supported_variants()]

# name: heads, kv_heads, head_dim, block_size (the branches of paged_attention.cpp's dispatch;
# an AVX2 build takes the "avx512" ones, head_dim 64 or 128 in 16-key tiles, in attend_avx2)
CASES = {
    "avx512-d64-gqa3": (9, 3, 64, 16),
    "avx512-d128-mha": (4, 4, 128, 32),
    "portable-d16": (4, 2, 16, 16),
    "portable-block8": (6, 2, 64, 8),
}


def random_case(*, heads, kv_heads, head_dim, block_size, contexts, q_len, dtype, seed=0):
    """A random cache ``[2, blocks, block_size, kv_heads, d]``, shuffled block tables for
    ``contexts``, and q as a strided view of a fused q/k tensor (as the model has):
    ``(cache, tables, q, num_blocks)``."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-c // block_size) for c in contexts]
    num_blocks = sum(blocks_needed) + 3
    cache = torch.randn((2, num_blocks, block_size, kv_heads, head_dim), generator=gen)
    cache = cache.to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(order[used:used + n])
        used += n
    fused = torch.randn((len(contexts) * q_len, heads + kv_heads, head_dim), generator=gen)
    return cache, tables, fused.to(dtype)[:, :heads], num_blocks


def assert_8bit_kernel_reads_like_torch(case: str, codes, scales, tables, q, *, contexts,
                                        q_len: int, window: int, num_blocks: int) -> None:
    """The native kernel on an 8-bit cache (``codes`` int8 or uint8 E4M3 with their
    ``scales``) against the torch fallback: gather the blocks, dequantize them, SDPA."""
    heads, kv_heads, d, block_size = CASES[case]
    dtype = q.dtype
    scale = d ** -0.5
    kernel = cpu_kernels.paged_attention_kernel(CPU, dtype, codes=codes.dtype)
    grp = build_kernel_group(0, q_len, contexts, tables, device=CPU)
    out = kernel(q, codes, grp.block_tables, grp.context_lens, q_len, scale, window, scales)
    ref_grp = build_paged_group(0, q_len, contexts, tables, block_size=block_size,
                                num_blocks=num_blocks, group_heads=heads // kv_heads,
                                device=CPU, windows=[window] if window else ())
    meta = AttnMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), groups=[ref_grp])
    unused = torch.zeros(q.shape[0], kv_heads, d)
    ref = paged_attention(q.float(), unused, unused, codes, meta, scale, window or None, scales)
    assert out.shape == ref.shape
    # bf16: the kernel rounds the probabilities (times V's scales) to bf16 for P.V
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def prefill_qkv(seqs: int, length: int, heads: int, kv_heads: int, d: int):
    """bf16 ``q [T, heads, d]``, ``k, v [T, kv_heads, d]`` of ``seqs`` fresh sequences of
    ``length`` tokens, as views of one packed qkv projection (token rows strided apart,
    as the engine hands them to the prefill kernel); seeded by ``length``."""
    gen = torch.Generator().manual_seed(length)
    tokens = seqs * length
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen) * 2).bfloat16()
    q = qkv[:, :heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(tokens, kv_heads, d)
    return q, k, v
