"""Partial rotary in csrc/rope_kv.cpp (Phi-3/4 rotate 75 % of each head): a table of
``rot / 2`` rotations per position rotates the first ``rot`` dimensions of every q and k
head as interleaved pairs and passes the rest through, as
:func:`llmctl.models.layers.rope.rotate_pairs` does; the cache gets the rotated keys (bf16
as they are, int8 and fp8 quantized with kv_quant's arithmetic). Two RopeKV objects with
different tables (Gemma 3's sliding and global layers) each rotate with their own, in any
order of calls. Every instruction-set variant this CPU runs.

Tolerance against rotate_pairs: the same float32 products rounded to bf16; a fused
multiply-add in either may move a rare value by one bf16 step (as the whole-head test in
test_cpu_kernels.py allows): under 0.1 % of values, each within 2^-7 relative. The
pass-through dimensions are bit for bit the input, and the cache bit for bit the
kernel's own rotated keys (quantized by kv_quant's functions for 8-bit caches).
"""

from __future__ import annotations

import pytest
import torch

from llmctl.models.layers.rope import rope_freqs, rotate_pairs
from llmctl.serve.kernels import cpu as cpu_kernels
from llmctl.serve.layers.kv_quant import quantize_fp8, quantize_int8
from tests.serve.paged_cases import needs_kernels

CPU = torch.device("cpu")
NH, NKV, D, BLOCK, BLOCKS = 6, 2, 64, 16, 20


def _table(partial: float, theta: float = 10000.0) -> torch.Tensor:
    params = {"rope_type": "default", "rope_theta": theta}
    return rope_freqs(params, D, 2048, 512, partial=partial)


def _step(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (NH + 2 * NKV) * D, generator=gen) * 3).bfloat16()
    qk = qkv[:, :(NH + NKV) * D].view(tokens, NH + NKV, D)  # strided rows, as the model's
    v = qkv[:, (NH + NKV) * D:].view(tokens, NKV, D)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    slots = torch.randperm(BLOCKS * BLOCK, generator=gen)[:tokens]
    return qk, v, positions, slots


def _assert_rotated_like_rotate_pairs(got: torch.Tensor, x: torch.Tensor, freqs, rot: int):
    want = rotate_pairs(x, freqs)
    assert torch.equal(got[..., rot:], x[..., rot:])  # passed through untouched
    assert (got != want).float().mean().item() < 1e-3
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2 ** -7)


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 5, 100])  # 100: the multi-threaded branch
@pytest.mark.parametrize("partial", [0.75, 0.5, 1.0])
@pytest.mark.parametrize("cache_kind", ["bf16", "int8", "fp8"])
def test_partial_rotary_matches_rotate_pairs(cache_kind, partial, tokens, isa):
    table = _table(partial)
    rot = 2 * table.shape[-1]
    assert rot == int(D * partial)
    kernel = cpu_kernels.rope_kv_kernel(CPU, torch.bfloat16, table)
    assert kernel.rot == rot
    qk, v, positions, slots = _step(tokens, seed=tokens)
    before = qk.clone()
    storage = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.uint8}[cache_kind]
    cache = torch.zeros((2, BLOCKS, BLOCK, NKV, D), dtype=storage)
    scales = {"bf16": None,
              "int8": torch.zeros((2, BLOCKS, BLOCK, NKV)),
              "fp8": torch.tensor([[0.5, 2.0], [0.25, 1.0]])}[cache_kind]
    kernel(qk, v, positions, slots, cache, scales)
    _assert_rotated_like_rotate_pairs(qk, before, table[positions].unsqueeze(1), rot)
    k_new = qk[:, NH:]
    k_cache = cache[0].view(-1, NKV, D)[slots]
    v_cache = cache[1].view(-1, NKV, D)[slots]
    if cache_kind == "bf16":
        assert torch.equal(k_cache, k_new) and torch.equal(v_cache, v)
    elif cache_kind == "int8":
        for got, got_s, x in ((k_cache, scales[0].view(-1, NKV)[slots], k_new),
                              (v_cache, scales[1].view(-1, NKV)[slots], v)):
            codes, s = quantize_int8(x)
            assert torch.equal(got, codes) and torch.equal(got_s, s)
    else:
        assert torch.equal(k_cache, quantize_fp8(k_new, scales[0]))
        assert torch.equal(v_cache, quantize_fp8(v, scales[1]))


@needs_kernels
def test_two_tables_each_rotate_with_their_own(isa):
    """Gemma 3: the sliding layers' table (base 10k) and the global layers' (base 1M,
    partial here too, to tell the widths apart), one RopeKV each, calls interleaved."""
    local, glob = _table(1.0, 10_000.0), _table(0.75, 1_000_000.0)
    k_local = cpu_kernels.rope_kv_kernel(CPU, torch.bfloat16, local)
    k_global = cpu_kernels.rope_kv_kernel(CPU, torch.bfloat16, glob)
    assert (k_local.rot, k_global.rot) == (D, 48)
    cache = torch.zeros((2, BLOCKS, BLOCK, NKV, D), dtype=torch.bfloat16)
    for i, (kernel, table) in enumerate([(k_global, glob), (k_local, local),
                                         (k_global, glob), (k_local, local)]):
        qk, v, positions, slots = _step(7, seed=i)
        before = qk.clone()
        kernel(qk, v, positions, slots, cache)
        _assert_rotated_like_rotate_pairs(qk, before, table[positions].unsqueeze(1),
                                          kernel.rot)


@needs_kernels
def test_a_table_wider_than_the_head_is_refused():
    kernel = cpu_kernels.rope_kv_kernel(CPU, torch.bfloat16, rope_freqs(
        {"rope_type": "default", "rope_theta": 1e4}, 2 * D, 2048, 16))
    qk, v, positions, slots = _step(2, seed=0)
    cache = torch.zeros((2, BLOCKS, BLOCK, NKV, D), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="128 rotated dimensions for heads of 64"):
        kernel(qk, v, positions.clamp(max=15), slots, cache)
