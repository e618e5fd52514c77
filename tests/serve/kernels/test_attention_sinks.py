"""Attention sinks (gpt-oss) inside the native attention kernels, against the engine's
eager reference :func:`llmctl.serve.layers.attention.softcapped_attention` with sinks in
float32 (itself held to transformers' ``eager_attention_forward`` in
tests/serve/model/test_gpt_oss.py): the softmax runs over ``[scores, sink]`` with the
sink's column dropped.

The paged kernel in every instruction-set variant this CPU runs (``isa``: float32 AVX-512
or AVX2, AVX512-BF16, the portable loop), on float32, bf16, int8 and fp8 caches, with
float32 and bf16 queries, decode and multi-token steps, GQA, with and without a sliding
window and a soft-cap; sinks of either sign, sinks so large that a head attends to
(almost) nothing, and sinks of -inf, which are no sinks bit for bit (exp(-inf) = 0 enters
every sum and no max). The prefill kernel where the build has it; the ``paged_attention``
groups that hand the sinks to the kernels, against its own torch paths.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmctl.serve.kernels import cpu as cpu_kernels
from llmctl.serve.layers.attention import (
    AttnGroup,
    AttnMetadata,
    build_kernel_group,
    build_paged_group,
    paged_attention,
    softcapped_attention,
)
from llmctl.serve.layers.kv_quant import (
    dequantize_fp8,
    dequantize_int8,
    quantize_fp8,
    quantize_int8,
)
from llmctl.utils.cpu import cpu_flags
from tests.serve.paged_cases import CASES, needs_kernels, prefill_qkv, random_case

CPU = torch.device("cpu")
CAP = 2.5  # a soft-cap that bites: the scaled scores of these inputs reach ~3
# float32 queries: the kernels and the reference differ in summation order and exp's
# polynomial only (1e-5, as the kernels' other float32 tests). bf16 queries: the
# AVX512-BF16 body rounds the probabilities to bf16 for P.V, as FlashAttention does
# (2^-9 relative each: 2e-2, as test_cpu_kernels.py allows)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# (window, soft-cap) combinations each paged case runs
SHAPES = [(0, None), (5, None), (0, CAP), (37, CAP)]
# a sink this far above every score (|s| < ~20 here) leaves each key exp(s - 50) < 1e-13:
# the head attends to (almost) nothing
BIG = 50.0


def _float_cache(dtype):
    def make(cache):  # (stored cache, scales, the values it stands for in float32)
        stored = cache.to(dtype)
        return stored, None, stored.float()
    return make


def _int8_cache(cache):
    codes, scales = quantize_int8(cache)  # one scale per (slot, KV head)
    return codes, scales, dequantize_int8(codes, scales, torch.float32)


def _fp8_cache(cache):
    kv_heads = cache.shape[3]
    scales = (torch.rand(2, kv_heads, generator=torch.Generator().manual_seed(5)) + 0.5) * 0.01
    codes = torch.stack([quantize_fp8(cache[i], scales[i]) for i in range(2)])
    values = torch.stack([dequantize_fp8(codes[i], scales[i], torch.float32) for i in range(2)])
    return codes, scales, values


# cache kind -> (query dtype, the cache as stored with its scales and float32 values)
KINDS = {"f32": (torch.float32, _float_cache(torch.float32)),
         "bf16": (torch.bfloat16, _float_cache(torch.bfloat16)),
         "int8-f32q": (torch.float32, _int8_cache), "int8-bf16q": (torch.bfloat16, _int8_cache),
         "fp8-f32q": (torch.float32, _fp8_cache), "fp8-bf16q": (torch.bfloat16, _fp8_cache)}


def reference(q, values, tables, contexts, q_len, window, scale, cap, sinks):
    """softcapped_attention in float32 per sequence: its queries ``[q_len, H, d]`` against
    the keys it sees (causal, within ``window``) read through its table from ``values
    [2, blocks, block_size, Hkv, d]``; ``sinks [H]`` or None."""
    heads, d = q.shape[1], q.shape[2]
    bs = values.shape[2]
    head_sinks = None if sinks is None else sinks.view(1, heads, 1, 1)
    outs = []
    for b, (table, ctx) in enumerate(zip(tables, contexts)):
        pos = torch.arange(ctx)
        blocks = torch.tensor(table)[pos // bs]
        k, v = (values[i][blocks, pos % bs].transpose(0, 1)[None] for i in range(2))
        qb = q[b * q_len:(b + 1) * q_len].float().transpose(0, 1)[None]  # [1, H, q_len, d]
        qpos = ctx - q_len + torch.arange(q_len)
        mask = pos[None, :] <= qpos[:, None]
        if window:
            mask &= pos[None, :] > qpos[:, None] - window
        o = softcapped_attention(qb, k, v, mask, scale, cap, head_sinks)
        outs.append(o[0].transpose(0, 1).reshape(q_len, heads * d))
    return torch.cat(outs)


def paged_case(case, q_len, kind, seed=0):
    """A random paged case stored as ``kind``: (kernel, run(window, cap, sinks), want(...),
    heads)."""
    heads, kv_heads, d, block_size = CASES[case]
    dtype, store = KINDS[kind]
    contexts = [q_len + extra for extra in (0, 5, 15, 16, 31, 33, 200)]
    cache, tables, q, _ = random_case(heads=heads, kv_heads=kv_heads, head_dim=d,
                                      block_size=block_size, contexts=contexts, q_len=q_len,
                                      dtype=torch.float32, seed=seed)
    stored, scales, values = store(cache)
    q = q.to(dtype)
    scale = d ** -0.5
    kernel = cpu_kernels.paged_attention_kernel(
        CPU, dtype, codes=stored.dtype if scales is not None else None)
    grp = build_kernel_group(0, q_len, contexts, tables, device=CPU)

    def run(window, cap, sinks):
        return kernel(q, stored, grp.block_tables, grp.context_lens, q_len, scale, window,
                      scales, cap, sinks)

    def want(window, cap, sinks):
        return reference(q, values, tables, contexts, q_len, window, scale, cap, sinks)

    return run, want, heads


def mixed_sinks(heads: int, seed: int = 0) -> torch.Tensor:
    """Sinks of either sign, about the size of the scores: they move every output."""
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2


@needs_kernels
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("q_len", [1, 3, 20])
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_kernel_computes_the_sinks(case, q_len, kind, isa):
    """Sinks of either sign against the float32 reference (TOL); the sinks changed the
    result; a huge positive sink: (almost) zero output, as the reference; a huge negative
    one: the sink-less reference."""
    run, want, heads = paged_case(case, q_len, kind)
    tol = TOL[KINDS[kind][0]]
    sinks = mixed_sinks(heads)
    for window, cap in SHAPES:
        got = run(window, cap, sinks)
        torch.testing.assert_close(got, want(window, cap, sinks), atol=tol, rtol=tol)
        assert (got - want(window, cap, None)).abs().max() > 10 * tol  # the sinks bite
    window, cap = SHAPES[-1]
    drowned = run(window, cap, torch.full((heads,), BIG))
    assert drowned.abs().max() < 1e-9
    torch.testing.assert_close(drowned, want(window, cap, torch.full((heads,), BIG)),
                               atol=1e-9, rtol=0)
    faint = run(window, cap, torch.full((heads,), -BIG))
    torch.testing.assert_close(faint, want(window, cap, None), atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_sinks_of_minus_infinity_are_no_sinks_bit_for_bit(case, kind, isa):
    """exp(-inf - m) = 0 joins every sum and -inf no max: the very bits of the call
    without sinks, which keeps its arithmetic as it was (the kernels' other tests hold
    that path to their references)."""
    for q_len in (1, 3):
        run, _, heads = paged_case(case, q_len, kind, seed=1)
        none = torch.full((heads,), -math.inf)
        for window, cap in SHAPES:
            assert torch.equal(run(window, cap, none), run(window, cap, None))


def test_the_kernels_refuse_sinks_they_would_misread():
    """The kernels read ``heads`` float32 values with no check: another dtype, length or
    layout is refused before the call."""
    assert cpu_kernels.sink_pointer(None, 4) is None
    good = torch.zeros(4)
    assert cpu_kernels.sink_pointer(good, 4) == good.data_ptr()
    for bad in (torch.zeros(4, dtype=torch.bfloat16), torch.zeros(3), torch.zeros(8)[::2]):
        with pytest.raises(ValueError, match="attention sinks"):
            cpu_kernels.sink_pointer(bad, 4)


def _fresh_reference(q, k, v, seqs, length, window, scale, cap, sinks):
    """softcapped_attention in float32 of fresh sequences (causal, within ``window``)."""
    def per_seq(t):
        return t.float().view(seqs, length, t.shape[1], t.shape[2]).transpose(1, 2)

    i = torch.arange(length)
    mask = i[None, :] <= i[:, None]
    if window:
        mask &= i[None, :] > i[:, None] - window
    head_sinks = None if sinks is None else sinks.view(1, -1, 1, 1)
    out = softcapped_attention(per_seq(q), per_seq(k), per_seq(v), mask, scale, cap, head_sinks)
    return out.transpose(1, 2).reshape(seqs * length, -1)


@needs_kernels
@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("seqs,length,heads,kv_heads,d", [
    (3, 37, 9, 3, 64),     # SmolLM2's heads, ragged last tile
    (1, 200, 8, 2, 128),   # head_dim 128, two query blocks of 128
])
def test_prefill_kernel_computes_the_sinks(seqs, length, heads, kv_heads, d, window, isa):
    """csrc/prefill_attention.cpp with sinks, with and without a cap, against the float32
    reference on the same bf16 q/k/v: four bf16 steps (2^-9 relative) of the largest
    output, as its other tests allow (bf16 probabilities and output); huge sinks: (almost)
    zero; sinks of -inf: the sink-less call bit for bit."""
    fn = cpu_kernels.prefill_attention_kernel(CPU, torch.bfloat16)
    if fn is None:
        assert isa not in ("native", "avx512-bf16") or "avx512_bf16" not in cpu_flags()
        pytest.skip(f"the {isa} build has no AVX512-BF16 prefill kernel")
    q, k, v = prefill_qkv(seqs, length, heads, kv_heads, d)
    scale = 1 / math.sqrt(d)
    sinks = mixed_sinks(heads, seed=length)
    for cap in (None, CAP):
        got = fn(q, k, v, seqs, length, scale, window, cap, sinks)
        want = _fresh_reference(q, k, v, seqs, length, window, scale, cap, sinks)
        assert (got.float() - want).abs().max() <= 4 * 2.0 ** -9 * want.abs().max()
        plain = fn(q, k, v, seqs, length, scale, window, cap)
        assert (got.float() - plain.float()).abs().max() > 0.05  # the sinks bite
        none = torch.full((heads,), -math.inf)
        assert torch.equal(fn(q, k, v, seqs, length, scale, window, cap, none), plain)
    drowned = fn(q, k, v, seqs, length, scale, window, None, torch.full((heads,), BIG))
    assert drowned.float().abs().max() < 1e-9


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_paged_attention_hands_the_sinks_to_the_kernels(dtype):
    """Through ``paged_attention``: a kernel group equals the gathered torch group of the
    same step, and a fresh group on the prefill kernel (bf16, where built) the torch
    fresh path, sinks and a window on both."""
    heads, kv_heads, d, block_size = CASES["avx512-d64-gqa3"]
    q_len, window = 3, 5
    contexts = [q_len + extra for extra in (0, 16, 40)]
    cache, tables, q, num_blocks = random_case(
        heads=heads, kv_heads=kv_heads, head_dim=d, block_size=block_size, contexts=contexts,
        q_len=q_len, dtype=dtype, seed=3)
    sinks = mixed_sinks(heads, seed=3)
    unused = torch.zeros(q.shape[0], kv_heads, d, dtype=dtype)
    kernel = cpu_kernels.paged_attention_kernel(CPU, dtype)
    grp = build_kernel_group(0, q_len, contexts, tables, device=CPU)
    meta = AttnMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), groups=[grp],
                        kernel=kernel)
    got = paged_attention(q, unused, unused, cache, meta, 0.125, window, sinks=sinks)
    gathered = build_paged_group(0, q_len, contexts, tables, block_size=block_size,
                                 num_blocks=num_blocks, group_heads=heads // kv_heads,
                                 device=CPU, dtype=torch.float32, windows=[window])
    meta = AttnMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), groups=[gathered])
    want = paged_attention(q.float(), unused.float(), unused.float(), cache.float(), meta,
                           0.125, window, sinks=sinks)
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])

    prefill = cpu_kernels.prefill_attention_kernel(CPU, dtype)
    if prefill is None:
        return  # float32, or a build without AVX512-BF16: fresh groups run on torch
    seqs, length = 2, 37
    fq, fk, fv = prefill_qkv(seqs, length, heads, kv_heads, d)
    fresh = AttnGroup(start=0, end=seqs * length, num_seqs=seqs, q_len=length, fresh=True)
    on_kernel = AttnMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), groups=[fresh],
                             prefill=prefill)
    on_torch = AttnMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), groups=[fresh])
    got = paged_attention(fq, fk, fv, torch.zeros(1), on_kernel, 0.125, window, sinks=sinks)
    want = paged_attention(fq, fk, fv, torch.zeros(1), on_torch, 0.125, window, sinks=sinks)
    assert (got.float() - want.float()).abs().max() <= 4 * 2.0 ** -9 * want.float().abs().max()
